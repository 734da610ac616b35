"""Case: tokenize-to-shards (what `lit-pretrain prepare` runs after the tokenizer) against bare `encode_batch`.

Same documents, same tokenizer, same chunks of ~4 MB per call: the candidate is prepare's tokenize stage (encode,
append the end-of-document id, write fixed-width ids to shards, count tokens for the manifest); the reference
calls the `tokenizers` library's `encode_batch` on the same chunks and keeps nothing. The ratio is the share of
the library's speed that our shard writing keeps: bytes/s over bytes/s.
"""

import tempfile
import time
from pathlib import Path
from typing import Dict

from lit_pretrain.bench.step import paired_case
from lit_pretrain.data.corpus import iter_documents
from lit_pretrain.data.datamodule import TokenShardDataModule
from lit_pretrain.data.prepare import _chunks, _tokenize_stage
from lit_pretrain.data.tokenizer import load_tokenizer

TOKENIZE_BYTES = 6 << 20


def _bare(tokenizer, docs) -> float:
    start = time.perf_counter()
    for chunk in _chunks(docs):
        tokenizer.encode_batch([d.text for d in chunk])
    return time.perf_counter() - start


def _to_shards(sample_data, tokenizer, tok_info, docs) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        _tokenize_stage(sample_data, tokenizer, tok_info, {"train": docs, "val": []}, Path(tmp))
        return time.perf_counter() - start


def run(sample_data, repeats: int) -> Dict:
    """`sample_data`: a prepared data config (bench/datamodule.prepare_sample): its documents and its tokenizer."""
    manifest = TokenShardDataModule(sample_data, seq_len=1, micro_batch_size=1, seed=0, val_batches=1).manifest
    tok_info = manifest["tokenizer"]
    tokenizer = load_tokenizer(Path(sample_data.prepared_dir) / tok_info["file"])
    docs, size = [], 0
    for doc in iter_documents(sample_data):  # the first TOKENIZE_BYTES of the sample: seconds per side, 2 chunks
        docs.append(doc)
        size += len(doc.text.encode("utf-8"))
        if size >= TOKENIZE_BYTES:
            break
    mb = size / 1e6
    return paired_case("tokenize_to_shards_mb_per_s", lambda: mb / _bare(tokenizer, docs),
                       lambda: mb / _to_shards(sample_data, tokenizer, tok_info, docs), repeats, ">= 0.8", "MB/s",
                       ("encode_batch", "to_shards"), {"documents": len(docs), "megabytes": mb})
