"""`lit-pretrain prepare`: documents → deduplication → train/val split → tokenizer → token shards + manifest.

A prepared folder is written once: everything goes into a temporary sibling folder that is renamed into place at
the end, so a crash leaves no half-written `data.prepared_dir`. Calling `prepare` again with the same
content-determining config verifies and returns the existing manifest; any other config is refused.
"""

import hashlib
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from lit_pretrain.data.corpus import CorpusStats, Document, corpus_fingerprint, corpus_roots, iter_documents
from lit_pretrain.data.deduplicate import deduplicate
from lit_pretrain.data.deduplication_report import (
    format_report,
    manifest_entry,
    summary_line,
    write_removed,
    write_report,
)
from lit_pretrain.data.quality import check_quality
from lit_pretrain.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    TOKENIZER_FILE,
    ShardWriter,
    check_config,
    content_config,
    load_manifest,
    token_dtype,
    unigram_entropy_nats,
    verify_shards,
    write_manifest,
)
from lit_pretrain.data.tokenizer import (
    encode_texts,
    eod_id,
    load_tokenizer,
    save_tokenizer,
    tokenizer_sha256,
    train_tokenizer,
)
from lit_pretrain.errors import DataError
from lit_pretrain.paths import safe_rmtree

# encode_batch parallelizes across the texts of one call; ~4 MB a call keeps both cores busy while holding only
# that chunk's ids in memory.
_ENCODE_CHUNK_BYTES = 4 << 20


def prepare(cfg, log: Callable[[str], None] = print) -> Dict:
    """Prepare `cfg.prepared_dir` (or reuse it) and return its manifest."""
    out = Path(cfg.prepared_dir)
    manifest = reuse_prepared(out, cfg, log)
    if manifest is not None:
        return manifest
    seconds: Dict[str, float] = {}
    start = time.perf_counter()
    stats = CorpusStats()
    with _timed(seconds, "read"):
        docs = list(iter_documents(cfg, stats))
        fingerprint = corpus_fingerprint(docs)
    # Before anything is written: a corpus that is mostly not text is refused, naming its worst files.
    quality = check_quality(stats.sources, cfg.max_invalid_fraction, f"data.paths={corpus_roots(cfg)}")
    with _timed(seconds, "deduplicate"):
        deduplicated = deduplicate(docs, cfg.deduplication)
    kept, dedup_report = deduplicated.kept, deduplicated.report
    dedup_report["corpus"] = {"invalid_utf8_documents": stats.invalid_utf8_documents,
                              "invalid_utf8_sequences": stats.invalid_utf8_sequences, "dropped_empty": stats.empty}
    with _timed(seconds, "split"):
        split_docs = split_documents(kept, cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f".{out.name}.tmp-"
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=out.parent))
    try:
        with _timed(seconds, "tokenizer"):
            tokenizer, tok_info = _tokenizer_stage(cfg, split_docs["train"], tmp)
        with _timed(seconds, "tokenize"):
            splits, entropy = _tokenize_stage(cfg, tokenizer, tok_info, split_docs, tmp)
        with _timed(seconds, "count_removed_tokens"):
            # Tokens before deduplication = tokens kept + the removed documents' tokens (each + one EOD id).
            tokens_after = sum(splits[split]["tokens"] for split in SPLITS)
            tokens_removed = sum(len(ids) + 1 for chunk in _chunks(deduplicated.removed)
                                 for ids in encode_texts(tokenizer, [d.text for d in chunk]))
            dedup_report.update(tokens_before=tokens_after + tokens_removed, tokens_after=tokens_after)
        seconds["total"] = time.perf_counter() - start
        manifest = {
            "format_version": FORMAT_VERSION,
            "config": content_config(cfg),
            "corpus": {
                "kind": cfg.corpus,
                "paths": corpus_roots(cfg),
                "fingerprint": fingerprint,
                "documents": stats.documents,
                "bytes": stats.bytes,
                "invalid_utf8_documents": stats.invalid_utf8_documents,
                "invalid_utf8_sequences": stats.invalid_utf8_sequences,
                "dropped_empty": stats.empty,
                "invalid_characters": quality.invalid,
                "invalid_fraction": quality.fraction,
            },
            "deduplication": manifest_entry(dedup_report, tokens_after + tokens_removed, tokens_after),
            "tokenizer": tok_info,
            "dtype": token_dtype(tok_info["vocab_size"]).name,
            "splits": splits,
            "unigram_entropy_nats": entropy,
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
        }
        write_report(tmp, dedup_report)
        write_removed(tmp, deduplicated.removals)
        write_manifest(tmp, manifest)
        try:
            # rename(2) replaces an empty folder atomically and fails on a non-empty one: another process may have
            # prepared the same folder meanwhile, and its result is then checked like any existing folder.
            os.rename(tmp, out)
        except OSError:
            existing = reuse_prepared(out, cfg, log)
            if existing is None:
                raise
            return existing
    finally:
        if tmp.exists():
            # Only the temporary folder mkdtemp made above: beside `out`, our prefix, not a link.
            safe_rmtree(tmp, out.parent, lambda folder: folder.name.startswith(tmp_prefix), "temporary folder")
    log(format_report(dedup_report))
    log(summary(manifest, out))
    return manifest


def reuse_prepared(out: Path, cfg, log: Callable[[str], None] = print) -> Optional[Dict]:
    """The verified manifest of an existing prepared folder made from this config, None when there is nothing
    there yet; a DataError for anything else, which is left untouched."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise DataError(f"data.prepared_dir {str(out)!r} is a file: pick another data.prepared_dir")
    if not (out / MANIFEST).exists():
        if any(out.iterdir()):
            raise DataError(
                f"data.prepared_dir {str(out)!r} is a non-empty folder without a {MANIFEST}: pick another "
                "data.prepared_dir, or delete that folder"
            )
        return None
    start = time.perf_counter()
    manifest = load_manifest(out)
    check_config(manifest, cfg, out)
    verify_shards(out, manifest)
    if cfg.tokenizer_path and not Path(cfg.tokenizer_path).is_file():
        raise DataError(f"data.tokenizer_path {cfg.tokenizer_path} does not exist: fix data.tokenizer_path")
    if cfg.tokenizer_path and tokenizer_sha256(cfg.tokenizer_path) != manifest["tokenizer"]["sha256"]:
        raise DataError(
            f"data.tokenizer_path {cfg.tokenizer_path} changed since {out} was prepared with it: prepare into a new "
            "data.prepared_dir"
        )
    # Reading the corpus again (~0.4 s for the 31 MB stdlib) catches edited source files that would otherwise go
    # unnoticed behind an unchanged config.
    if corpus_fingerprint(iter_documents(cfg)) != manifest["corpus"]["fingerprint"]:
        raise DataError(
            f"the corpus at data.paths={corpus_roots(cfg)} changed since {out} was prepared from it (fingerprint "
            "differs): prepare into a new data.prepared_dir, or delete that folder"
        )
    log(f"reusing {out}: manifest matches data config, shards verified ({time.perf_counter() - start:.2f} s)")
    if "deduplication" in manifest:
        log(summary_line(manifest["deduplication"]))
    return manifest


def is_validation(doc_id: str, split_seed: int, val_fraction: float) -> bool:
    """A document's split depends only on its id and the seed: adding documents never moves existing ones."""
    digest = hashlib.sha256(f"{split_seed}\0{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < val_fraction


def split_documents(docs: List[Document], cfg) -> Dict[str, List[Document]]:
    out: Dict[str, List[Document]] = {"train": [], "val": []}
    for doc in docs:
        out["val" if is_validation(doc.id, cfg.split_seed, cfg.val_fraction) else "train"].append(doc)
    for split in SPLITS:
        if not out[split]:
            raise DataError(
                f"the {split} split is empty ({len(docs)} documents, data.val_fraction={cfg.val_fraction}, "
                f"data.split_seed={cfg.split_seed}): use more documents (data.max_documents, data.paths) or change "
                "data.val_fraction"
            )
    return out


def tokenizer_training_texts(docs: List[Document], max_bytes: int) -> List[str]:
    """Documents in corpus order up to `max_bytes` UTF-8 bytes, the last one cut at the budget."""
    texts, used = [], 0
    for doc in docs:
        data = doc.text.encode("utf-8")
        if used + len(data) > max_bytes:
            rest = data[: max_bytes - used].decode("utf-8", errors="ignore")
            if rest:
                texts.append(rest)
            break
        texts.append(doc.text)
        used += len(data)
    return texts


def summary(manifest: Dict, out: Path) -> str:
    c, t = manifest["corpus"], manifest["tokenizer"]
    lines = [
        f"prepared {out}: {c['kind']} corpus, {c['documents']} documents, {c['bytes'] / 1e6:.1f} MB "
        f"({c['invalid_utf8_documents']} with bytes that are not UTF-8, decoded with replacement; "
        f"{c['dropped_empty']} empty dropped)",
        f"tokenizer: vocab {t['vocab_size']}, eod id {t['eod_id']}, {t['source']}, dtype {manifest['dtype']}",
    ]
    for split in SPLITS:
        s = manifest["splits"][split]
        lines.append(
            f"{split}: {s['documents']} documents, {s['bytes'] / 1e6:.1f} MB, {s['tokens']:,} tokens "
            f"({s['bytes'] / max(s['tokens'], 1):.2f} bytes/token), {len(s['shards'])} shards"
        )
    if "deduplication" in manifest:
        lines.append(summary_line(manifest["deduplication"]))
    lines.append(f"unigram entropy of train tokens: {manifest['unigram_entropy_nats']:.3f} nats")
    lines.append("seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in manifest["seconds"].items()))
    return "\n".join(lines)


def _tokenizer_stage(cfg, train_docs: List[Document], folder: Path):
    path = folder / TOKENIZER_FILE
    if cfg.tokenizer_path:
        tokenizer = load_tokenizer(cfg.tokenizer_path)
        shutil.copyfile(cfg.tokenizer_path, path)
        source, train_bytes = f"loaded from {cfg.tokenizer_path}", 0
    else:
        texts = tokenizer_training_texts(train_docs, cfg.tokenizer_train_bytes)
        tokenizer = train_tokenizer(texts, cfg.vocab_size)
        save_tokenizer(tokenizer, path)
        train_bytes = sum(len(t.encode("utf-8")) for t in texts)
        source = f"trained on {train_bytes:,} bytes of the train split"
    # Ids can have gaps in a loaded tokenizer: size the dtype and the entropy counts by the largest id.
    vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    info = {
        "file": TOKENIZER_FILE,
        "sha256": tokenizer_sha256(path),
        "vocab_size": vocab_size,
        "eod_id": eod_id(tokenizer),
        "source": source,
        "train_bytes": train_bytes,
    }
    return tokenizer, info


def _tokenize_stage(cfg, tokenizer, tok_info: Dict, split_docs: Dict[str, List[Document]], folder: Path):
    dtype = token_dtype(tok_info["vocab_size"])
    eod = tok_info["eod_id"]
    splits, train_counts = {}, None
    for split in SPLITS:
        writer = ShardWriter(folder, split, cfg.shard_tokens, dtype, tok_info["vocab_size"])
        docs = split_docs[split]
        for chunk in _chunks(docs):
            ids = encode_texts(tokenizer, [d.text for d in chunk])
            writer.write([np.array(doc_ids + [eod], dtype=dtype) for doc_ids in ids])
        info = writer.close()
        info["bytes"] = sum(len(d.text.encode("utf-8")) for d in docs)
        splits[split] = info
        if split == "train":
            train_counts = writer.counts
    return splits, unigram_entropy_nats(train_counts)


def _chunks(docs: List[Document]):
    chunk: List[Document] = []
    size = 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc.text)
        if size >= _ENCODE_CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


@contextmanager
def _timed(seconds: Dict[str, float], stage: str):
    start = time.perf_counter()
    yield
    seconds[stage] = time.perf_counter() - start
