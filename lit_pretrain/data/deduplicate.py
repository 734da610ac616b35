"""Deduplication: the pipeline stage between reading documents and training the tokenizer.

Repeated text is a leading cause of memorization and wasted compute (Lee et al. 2022, "Deduplicating Training Data
Makes Language Models Better"), so removal belongs before the split and the tokenizer. This stage keeps every
document for now; exact-hash and MinHash near-duplicate removal plug in here, with any config fields they add
listed in `shards.CONTENT_FIELDS` so that a prepared folder records them.
"""

from typing import List

from lit_pretrain.data.corpus import Document


def deduplicate(docs: List[Document], cfg) -> List[Document]:
    """Documents to keep, in corpus order (currently all of them)."""
    return list(docs)
