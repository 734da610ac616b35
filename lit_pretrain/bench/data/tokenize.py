"""Cases: our encoding and our tokenize-to-shards (what `lit-pretrain prepare` runs after the tokenizer) against the
`tokenizers` library's fastest batch encoding that gives ids (`encode_batch_fast`, or `encode_batch` where the
installed tokenizers lacks it: tokenizer.batch_encoder).

Same documents, same tokenizer, same chunks of ~4 MB: the reference calls the library on each chunk and reads each
document's ids (`Encoding.ids`, the least any use of the library does), keeping nothing. The first candidate is the
tokenize stage's unit of work (tokenize_stage.encode_chunk: one library call a chunk, each document's ids wrapped
in its end-of-document id, one array a chunk), so its ratio is the share of the library's speed the stage keeps
(goal >= 0.95). Its detail also gives the library call alone, ids never read: reading them costs ~6% of
the call on the default corpus (a Python int a token, built by the library's getter), which no caller avoids. The
second is prepare's `write_shards` (encode, wrap, write fixed-width ids to shards in order, count tokens for the
manifest) on one process. The third is 2 tokenize processes (data.tokenize_workers=2) over 1. The library already
runs on every core (Rust threads), so on a 2-core machine a second process mostly overlaps reading and writing with
encoding.
"""

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from lit_pretrain.bench import stats
from lit_pretrain.bench.step.step import paired_case
from lit_pretrain.data.datamodule import TokenShardDataModule
from lit_pretrain.data.preparation.corpus import iter_documents
from lit_pretrain.data.preparation.prepare import write_shards
from lit_pretrain.data.preparation.tokenize_stage import TRAIN, chunks, encode_chunk, remember_tokenizer
from lit_pretrain.data.tokenizer import batch_encoder, load_tokenizer

TOKENIZE_BYTES = 12 << 20  # 3 chunks: enough for a second process to take a share


def _bare(tokenizer, pieces, read_ids: bool = True) -> float:
    encode = batch_encoder(tokenizer)
    start = time.perf_counter()
    for texts, _, _ in pieces:
        encodings = encode(texts, add_special_tokens=False)
        if read_ids:
            for enc in encodings:
                enc.ids  # noqa: B018  (the getter builds the list: its cost is what is measured)
    return time.perf_counter() - start


def _ours(tokenizer_file: Path, tok_info, pieces) -> float:
    start = time.perf_counter()
    for texts, where, _ in pieces:
        encode_chunk((str(tokenizer_file), texts, where, tok_info["bos_id"], tok_info["eod_id"], tok_info["dtype"]))
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
    manifest = TokenShardDataModule(sample_data, seq_len=1, micro_batch_size=1, seed=0, val_windows=1).manifest
    tok_info = {**manifest["tokenizer"], "dtype": manifest["dtype"]}
    tok_info.setdefault("bos_id", None)
    tokenizer_file = Path(sample_data.prepared_dir) / tok_info["file"]
    tokenizer = load_tokenizer(tokenizer_file, eos_token=None)
    remember_tokenizer(str(tokenizer_file), tokenizer)  # encode_chunk uses the reference's tokenizer object
    docs, size = [], 0
    # The sample's documents, repeated up to TOKENIZE_BYTES (the sample itself is ~10 MB).
    while size < TOKENIZE_BYTES:
        for doc in iter_documents(sample_data):
            docs.append(doc)
            size += len(doc.text.encode("utf-8"))
            if size >= TOKENIZE_BYTES:
                break
    mb = size / 1e6
    pieces = list(chunks((TRAIN, d.text, d.id) for d in docs))
    library = batch_encoder(tokenizer).__name__
    detail = {"documents": len(docs), "megabytes": mb, "library_call": library}

    def shards(workers: int) -> float:
        return mb / _to_shards(sample_data, tok_info, tokenizer_file, docs, workers)

    encode = paired_case("tokenize_encode_mb_per_s", lambda: mb / _bare(tokenizer, pieces),
                         lambda: mb / _ours(tokenizer_file, tok_info, pieces), repeats, ">= 0.95",
                         f"MB/s (ref: bare {library}, ids read)", (library, "encode_chunk"), detail)
    call_only = [mb / _bare(tokenizer, pieces, read_ids=False) for _ in range(repeats)]
    encode["detail"].update({f"{library}_ids_unread": call_only,
                             "encode_chunk_vs_ids_unread": encode["value"] / stats.median(call_only)})
    one = paired_case("tokenize_to_shards_mb_per_s", lambda: mb / _bare(tokenizer, pieces), lambda: shards(1),
                      repeats, ">= 0.8", f"MB/s (ref: bare {library}, ids read)", (library, "to_shards"), detail)
    two = paired_case("tokenize_2_processes_vs_1", lambda: shards(1), lambda: shards(2), repeats,
                      "report (issue: >= 1.7)", "MB/s", ("1_process", "2_processes"), detail)
    return [encode, one, two]
