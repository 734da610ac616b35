"""Case: tokenize-to-shards (what `lit-pretrain prepare` runs after the tokenizer) against bare `encode_batch`.

Same documents, same tokenizer, same chunks of ~4 MB per call: the candidate is prepare's `write_shards` (encode,
wrap each document in its end-of-document id, write fixed-width ids to shards in order, count tokens for the
manifest); the reference calls the `tokenizers` library's `encode_batch` on the same chunks and keeps nothing. The
first ratio is the share of the library's speed that our shard writing keeps on one process (bytes/s over
bytes/s); the second is 2 tokenize processes (data.tokenize_workers=2) over 1. `encode_batch` already runs on every
core (Rust threads), so on a 2-core machine a second process mostly overlaps reading and writing with encoding.
"""

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from lit_pretrain.bench.step import paired_case
from lit_pretrain.data.corpus import iter_documents
from lit_pretrain.data.datamodule import TokenShardDataModule
from lit_pretrain.data.prepare import write_shards
from lit_pretrain.data.tokenize_stage import TRAIN, chunks
from lit_pretrain.data.tokenizer import load_tokenizer

TOKENIZE_BYTES = 12 << 20  # 3 chunks: enough for a second process to take a share


def _bare(tokenizer, docs) -> float:
    start = time.perf_counter()
    for texts, _, _ in chunks((TRAIN, d.text, d.id) for d in docs):
        tokenizer.encode_batch(texts, add_special_tokens=False)
    return time.perf_counter() - start


def _to_shards(sample_data, tok_info, tokenizer_file: Path, docs, workers: int) -> float:
    cfg = dataclasses.replace(sample_data, tokenize_workers=workers)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(tokenizer_file, Path(tmp) / tok_info["file"])
        start = time.perf_counter()
        write_shards(cfg, tok_info, Path(tmp), ((TRAIN, d.text, d.id) for d in docs))
        return time.perf_counter() - start


def run(sample_data, repeats: int) -> List[Dict]:
    """`sample_data`: a prepared data config (bench/datamodule.prepare_sample): its documents and its tokenizer."""
    manifest = TokenShardDataModule(sample_data, seq_len=1, micro_batch_size=1, seed=0, val_batches=1).manifest
    tok_info = {**manifest["tokenizer"], "dtype": manifest["dtype"]}
    tok_info.setdefault("bos_id", None)
    tokenizer_file = Path(sample_data.prepared_dir) / tok_info["file"]
    tokenizer = load_tokenizer(tokenizer_file, eos_token=None)
    docs, size = [], 0
    # The sample's documents, repeated up to TOKENIZE_BYTES (the sample itself is ~10 MB).
    while size < TOKENIZE_BYTES:
        for doc in iter_documents(sample_data):
            docs.append(doc)
            size += len(doc.text.encode("utf-8"))
            if size >= TOKENIZE_BYTES:
                break
    mb = size / 1e6
    detail = {"documents": len(docs), "megabytes": mb}
    def shards(workers: int) -> float:
        return mb / _to_shards(sample_data, tok_info, tokenizer_file, docs, workers)

    one = paired_case("tokenize_to_shards_mb_per_s", lambda: mb / _bare(tokenizer, docs), lambda: shards(1),
                      repeats, ">= 0.8", "MB/s", ("encode_batch", "to_shards"), detail)
    two = paired_case("tokenize_2_processes_vs_1", lambda: shards(1), lambda: shards(2), repeats,
                      "report (issue: >= 1.7)", "MB/s", ("1_process", "2_processes"), detail)
    return [one, two]
