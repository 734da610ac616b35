"""`lit-pretrain prepare`: documents → deduplication → train/val split → tokenizer → token shards + manifest.

The corpus is streamed, never held: memory does not grow with its size except through deduplication's per-document
state (a size, a hash and a split bit; MinHash signatures go to a file in the staging folder; the LSH index lives in
memory or Redis) and the ids of removed documents that `removed.jsonl` names. Two passes over the files, because
whether a document is kept depends on every later document (a near-duplicate cluster keeps its first member,
known only once all signatures are in the LSH index), while the tokenizer must be trained on kept documents only:
  pass 1  read → fingerprint, quality counts, exact hashes, signatures → LSH → the kept set and the split sizes
  pass 2  read again (checked against pass 1's fingerprint) → the first data.tokenizer_train_bytes of kept train
          documents train the tokenizer (a bounded prefix read) → every document tokenized in parallel processes
          (data.tokenize_workers) and written in corpus order to its split's shards, removed ones only counted.

With data.engine=ray both passes run as tasks on a Ray cluster (data/preparation/ray_engine.py) and write the same
folder, byte for byte; the tokenizer is trained here either way.

A prepared folder is written once: everything goes into a temporary sibling folder that is renamed into place at
the end, so a crash or a refused input leaves no half-written `data.prepared_dir`. Calling `prepare` again with
the same content-determining config verifies and returns the existing manifest; any other config is refused.
"""

import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from lit_pretrain.data.preparation.corpus import (
    CorpusStats,
    Document,
    Fingerprint,
    corpus_fingerprint,
    corpus_roots,
    is_validation,
    iter_documents,
)
from lit_pretrain.data.preparation.deduplicate import Decisions, StreamingDeduplication
from lit_pretrain.data.preparation.deduplication_report import (
    format_report,
    manifest_entry,
    summary_line,
    write_removed,
    write_report,
)
from lit_pretrain.data.preparation.progress import stage_line
from lit_pretrain.data.preparation.quality import check_quality
from lit_pretrain.data.preparation.tokenize_stage import (
    COUNT,
    TRAIN,
    VAL,
    chunks,
    encode_in_order,
    remember_tokenizer,
    write_encoded,
)
from lit_pretrain.data.shards import (
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    TOKENIZER_FILE,
    check_config,
    content_config,
    load_manifest,
    token_dtype,
    unigram_entropy_nats,
    verify_shards,
    write_manifest,
)
from lit_pretrain.data.tokenizer import load_tokenizer, save_tokenizer, tokenizer_sha256, train_tokenizer
from lit_pretrain.errors import DataError
from lit_pretrain.paths import safe_rmtree

# The manifest's corpus.document_ids: what each document id names (data/preparation/corpus.py); manifests without it
# used paths.
RELATIVE_IDS = "relative to the folder holding each data.paths entry"
_STAGING = "staging"  # inside the temporary folder: deduplication's spill files, deleted before the rename


def prepare(cfg, log: Callable[[str], None] = print) -> Dict:
    """Prepare `cfg.prepared_dir` (or reuse it) and return its manifest."""
    out = Path(cfg.prepared_dir)
    manifest = reuse_prepared(out, cfg, log)
    if manifest is not None:
        return manifest
    loaded = None
    if cfg.tokenizer_path:  # a tokenizer without the named tokens, or too large for the dtype, is refused before
        loaded = load_tokenizer(cfg.tokenizer_path, cfg.eos_token, cfg.bos_token)  # the corpus is read
        token_dtype(_id_count(loaded), cfg.token_dtype, cfg.tokenizer_path)
    with _engine(cfg, log) as engine:
        return _prepare(cfg, out, loaded, engine, log)


@contextmanager
def _engine(cfg, log: Callable[[str], None]):
    """None for data.engine=local; for ray, a session on the cluster, opened before anything is written (an
    unreachable data.ray_address leaves no folder behind)."""
    if cfg.engine != "ray":
        yield None
        return
    from lit_pretrain.data.preparation import ray_engine

    with ray_engine.session(cfg, log) as session:
        yield session


def _prepare(cfg, out: Path, loaded, engine, log: Callable[[str], None]) -> Dict:
    seconds: Dict[str, float] = {}
    start = time.perf_counter()
    # The folders above `out` that this call makes: removed again (when still empty) if it fails.
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f".{out.name}.tmp-"
    tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=out.parent))
    try:
        stats = CorpusStats()
        with _timed(seconds, "read_deduplicate"):
            if engine is None:
                fingerprint, quality, decided, in_val = _first_pass(cfg, stats, tmp)
            else:
                from lit_pretrain.data.preparation import ray_engine

                fingerprint, quality, decided, in_val, groups = ray_engine.first_pass(cfg, engine, stats, log)
        dedup_report_corpus = {"invalid_utf8_documents": stats.invalid_utf8_documents,
                               "invalid_utf8_sequences": stats.invalid_utf8_sequences, "dropped_empty": stats.empty}
        stage_line(log, cfg.engine, "read and deduplicate", stats.documents, seconds["read_deduplicate"])
        _check_splits(cfg, decided.removed, in_val)
        with _timed(seconds, "tokenizer"):
            tok_info = _tokenizer_stage(cfg, loaded, decided.removed, in_val, tmp)
        with _timed(seconds, "tokenize"):
            if engine is None:
                splits, entropy, tokens_removed, ids = _tokenize_stage(cfg, tok_info, decided, in_val, tmp,
                                                                       fingerprint)
            else:
                splits, counts, tokens_removed, ids = ray_engine.tokenize_pass(
                    cfg, engine, tok_info, tmp, decided, in_val, fingerprint, groups, log)
                entropy = unigram_entropy_nats(counts)
        stage_line(log, cfg.engine, "tokenize", stats.documents, seconds["tokenize"])
        tokens_after = sum(splits[split]["tokens"] for split in SPLITS)
        dedup_report = decided.report(ids)
        # How, not what: the engine and its workers, and the seconds of each stage (deduplication.json only, never
        # the manifest's content).
        dedup_report["engine"] = {"name": cfg.engine, "workers": engine.workers if engine else
                                  decided.near_report.get("processes", 1), "ray_address": cfg.ray_address}
        dedup_report["seconds"].update(read_deduplicate=round(seconds["read_deduplicate"], 3),
                                       tokenizer=round(seconds["tokenizer"], 3), tokenize=round(seconds["tokenize"], 3))
        dedup_report["corpus"] = dedup_report_corpus
        dedup_report.update(tokens_before=tokens_after + tokens_removed, tokens_after=tokens_after)
        seconds["total"] = time.perf_counter() - start
        manifest = {
            "format_version": FORMAT_VERSION,
            "config": content_config(cfg),
            "corpus": {
                "kind": cfg.corpus,
                "paths": corpus_roots(cfg),
                "fingerprint": fingerprint,
                "document_ids": RELATIVE_IDS,
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
            "dtype": tok_info.pop("dtype"),
            "splits": splits,
            "unigram_entropy_nats": entropy,
            "seconds": {k: round(v, 3) for k, v in seconds.items()},
        }
        write_report(tmp, dedup_report)
        write_removed(tmp, decided.removals(ids))
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
        if not out.exists():
            _remove_empty(made)
    log(format_report(dedup_report))
    log(summary(manifest, out))
    return manifest


def _remove_empty(folders: List[Path]) -> None:
    """rmdir each folder (deepest first) this call made, only while empty: a refused corpus leaves nothing."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (something else wrote there meanwhile): leave it
            return


def _first_pass(cfg, stats: CorpusStats, tmp: Path):
    """Pass 1: the corpus fingerprint, the quality gate, the deduplication decisions and each document's split."""
    staging = tmp / _STAGING
    staging.mkdir()
    in_val = bytearray()  # one byte a document: 1 when it is in the validation split
    fingerprint = Fingerprint()
    with StreamingDeduplication(cfg.deduplication, staging) as stage:
        for doc in iter_documents(cfg, stats):
            fingerprint.add(doc)
            in_val.append(is_validation(doc.id, cfg.split_seed, cfg.val_fraction))
            stage.add(doc)
        # Before the near-duplicate search: a corpus that is mostly not text is refused, naming its worst files.
        quality = check_quality(stats.sources, cfg.max_invalid_fraction, f"data.paths={corpus_roots(cfg)}")
        decided = stage.finish()
    # The spill files are only needed by finish(): a staging folder this call made inside its temporary folder.
    safe_rmtree(staging, tmp, lambda folder: folder.name == _STAGING, "staging folder")
    return fingerprint.hexdigest(), quality, decided, np.frombuffer(bytes(in_val), dtype=np.uint8).astype(bool)


def _check_splits(cfg, removed: np.ndarray, in_val: np.ndarray) -> None:
    kept = ~removed
    for split, count in (("train", int((kept & ~in_val).sum())), ("val", int((kept & in_val).sum()))):
        if not count:
            raise DataError(
                f"the {split} split is empty ({int(kept.sum())} documents, data.val_fraction={cfg.val_fraction}, "
                f"data.split_seed={cfg.split_seed}): use more documents (data.max_documents, data.paths) or change "
                "data.val_fraction"
            )


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
    if not _same_corpus(cfg, manifest["corpus"]):
        raise DataError(
            f"the corpus at data.paths={corpus_roots(cfg)} changed since {out} was prepared from it (fingerprint "
            "differs): prepare into a new data.prepared_dir, or delete that folder"
        )
    log(f"reusing {out}: manifest matches data config, shards verified ({time.perf_counter() - start:.2f} s)")
    if "deduplication" in manifest:
        log(summary_line(manifest["deduplication"]))
    return manifest


def _same_corpus(cfg, recorded: Dict) -> bool:
    """Whether the corpus still fingerprints as `recorded` (a manifest's corpus entry). A manifest written before
    document ids were relative (data/preparation/corpus.py) fingerprinted absolute paths: its shards are still right for
    an unchanged corpus, so that fingerprint is checked too."""
    if corpus_fingerprint(iter_documents(cfg)) == recorded["fingerprint"]:
        return True
    return (cfg.corpus != "stdlib" and recorded.get("document_ids") != RELATIVE_IDS
            and corpus_fingerprint(iter_documents(cfg, absolute_ids=True)) == recorded["fingerprint"])


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


def _id_count(tokenizer) -> int:
    # Ids can have gaps in a loaded tokenizer: size the dtype and the entropy counts by the largest id.
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def _tokenizer_stage(cfg, loaded, removed: np.ndarray, in_val: np.ndarray, folder: Path) -> Dict:
    """The tokenizer (`loaded` from data.tokenizer_path, or trained) saved into `folder`; its manifest entry."""
    path = folder / TOKENIZER_FILE
    if loaded is not None:
        tokenizer = loaded
        shutil.copyfile(cfg.tokenizer_path, path)
        source, train_bytes = f"loaded from {cfg.tokenizer_path}", 0
    else:
        # A prefix of pass 2's read: it stops at the budget, so only the training texts are ever held.
        train_docs = (doc for i, doc in enumerate(iter_documents(cfg)) if not removed[i] and not in_val[i])
        texts = tokenizer_training_texts(train_docs, cfg.tokenizer_train_bytes)
        specials = [cfg.eos_token] + ([cfg.bos_token] if cfg.bos_token is not None else [])
        tokenizer = train_tokenizer(texts, cfg.vocab_size, specials)
        save_tokenizer(tokenizer, path)
        train_bytes = sum(len(t.encode("utf-8")) for t in texts)
        source = f"trained on {train_bytes:,} bytes of the train split"
    vocab_size = _id_count(tokenizer)
    where = cfg.tokenizer_path or "the trained tokenizer"
    info = {
        "file": TOKENIZER_FILE,
        "sha256": tokenizer_sha256(path),
        "vocab_size": vocab_size,
        "eod_id": tokenizer.token_to_id(cfg.eos_token),
        "source": source,
        "train_bytes": train_bytes,
        "eos_token": cfg.eos_token,
        "bos_token": cfg.bos_token,
        "bos_id": None if cfg.bos_token is None else tokenizer.token_to_id(cfg.bos_token),
        "dtype": token_dtype(vocab_size, cfg.token_dtype, where).name,
    }
    remember_tokenizer(str(path), tokenizer)
    return info


def _tokenize_stage(cfg, tok_info: Dict, decided: Decisions, in_val: np.ndarray, folder: Path, fingerprint: str):
    """Pass 2: every document to its split's shards in corpus order (removed ones counted only). Returns the splits'
    manifest entries, the unigram entropy of train, the removed documents' tokens and the ids the report names."""
    needed = decided.needed_ids()
    ids: Dict[int, str] = {}
    split_bytes = [0, 0]
    check = Fingerprint()

    def labelled() -> Iterator[Tuple[int, str, str]]:
        for i, doc in enumerate(iter_documents(cfg)):
            check.add(doc)
            if i in needed:
                ids[i] = doc.id
            dest = COUNT if decided.removed[i] else VAL if in_val[i] else TRAIN
            if dest != COUNT:
                split_bytes[dest] += int(decided.sizes[i])
            yield dest, doc.text, doc.id

    splits, counts, removed_tokens = write_shards(cfg, tok_info, folder, labelled())
    if check.hexdigest() != fingerprint:
        raise DataError(
            f"the corpus at data.paths={corpus_roots(cfg)} changed while it was being prepared (the second read "
            "differs from the first): prepare it again once nothing writes to it"
        )
    for split, dest in (("train", TRAIN), ("val", VAL)):
        splits[split]["bytes"] = split_bytes[dest]
    return splits, unigram_entropy_nats(counts), removed_tokens, ids


def write_shards(cfg, tok_info: Dict, folder: Path, docs: Iterable[Tuple[int, str, str]]):
    """Tokenize (destination, text, id) triples in order into `folder`'s train and val shards with `folder`'s
    tokenizer, in cfg.tokenize_workers processes. Returns the splits' entries, the train token counts by id, and
    the tokens of the documents only counted."""
    return write_encoded(cfg, tok_info, folder, encode_in_order(
        chunks(docs), str(folder / tok_info["file"]), tok_info["bos_id"], tok_info["eod_id"], tok_info["dtype"],
        cfg.tokenize_workers))


@contextmanager
def _timed(seconds: Dict[str, float], stage: str):
    start = time.perf_counter()
    yield
    seconds[stage] = time.perf_counter() - start
