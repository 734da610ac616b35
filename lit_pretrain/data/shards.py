"""Token shards on disk and the manifest that describes them.

A shard is a flat file of fixed-width token ids (no header): each document's ids followed by the EOD id. uint16
holds any vocabulary of up to 65,536 tokens at 2 bytes a token; larger vocabularies use uint32. Readers map shards
with `np.memmap`, so a shard is never loaded whole.
"""

import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from lit_pretrain.data.tokenizer import tokenizer_sha256
from lit_pretrain.errors import DataError

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
PRETOKENIZED = ("megatron", "numpy", "nanogpt")  # data.corpus kinds trained on in place (data/pretokenized.py)
# DataConfig fields that decide what a prepared folder holds; num_workers and prepared_dir do not.
CONTENT_FIELDS = (
    "corpus",
    "paths",
    "text_field",
    "vocab_size",
    "tokenizer_path",
    "tokenizer_train_bytes",
    "val_fraction",
    "split_seed",
    "max_documents",
    "shard_tokens",
    "deduplication",
    "eos_token",
    "bos_token",
    "token_dtype",
)
# Content fields added after folders were prepared without them: such a manifest was made with these values.
_ADDED_FIELD_DEFAULTS = {"eos_token": "<|endoftext|>", "bos_token": None, "token_dtype": "auto"}
# data.deduplication fields that decide which documents are kept; its processes and index storage do not.
DEDUPLICATION_CONTENT_FIELDS = ("exact", "lowercase", "fold_whitespace", "near", "shingle", "shingle_size", "num_perm",
                                "threshold", "false_negative_weight", "bands", "rows", "verify", "seed")
_REPREPARE = "re-run `lit-pretrain prepare` into a new data.prepared_dir"


def content_config(cfg) -> Dict:
    """The content-determining data config as plain JSON values (cfg may be a dataclass or an OmegaConf node)."""
    out = {name: getattr(cfg, name) for name in CONTENT_FIELDS}
    out["paths"] = [str(p) for p in out["paths"]]
    out["deduplication"] = {name: getattr(cfg.deduplication, name) for name in DEDUPLICATION_CONTENT_FIELDS}
    return json.loads(json.dumps(out))


def token_dtype(vocab_size: int, chosen: str = "auto", tokenizer: str = "the tokenizer") -> np.dtype:
    """The shards' id width: `chosen` (data.token_dtype), or for auto the narrowest that holds ids 0..vocab_size-1."""
    if chosen == "auto":
        return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    dtype = np.dtype(chosen)
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise DataError(
            f"data.token_dtype={chosen} holds ids up to {np.iinfo(dtype).max:,}, but {tokenizer} has ids up to "
            f"{vocab_size - 1:,}: set data.token_dtype=uint32 (or auto)"
        )
    return dtype


class ShardWriter:
    """Writes one split's documents into `{split}_{index:05d}.bin` files, each closed after `shard_tokens` tokens at
    the next document boundary, hashing bytes as they are written (no second read)."""

    def __init__(self, folder: Path, split: str, shard_tokens: int, dtype: np.dtype, vocab_size: int):
        self.folder, self.split, self.shard_tokens, self.dtype = folder, split, shard_tokens, dtype
        self.shards: List[Dict] = []
        self.documents = 0
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self._file = None

    def write(self, doc_ids: List[np.ndarray]) -> None:
        """Append documents, each already ending in the EOD id."""
        for ids in doc_ids:
            if self._file is None or self._tokens >= self.shard_tokens:
                self._open_next()
            ids.tofile(self._file)
            self._hash.update(ids)
            self._tokens += len(ids)
            self.documents += 1
        if doc_ids:  # one bincount per batch, not per document: each call costs O(vocab_size)
            self.counts += np.bincount(np.concatenate(doc_ids), minlength=len(self.counts))

    def close(self) -> Dict:
        self._close_current()
        return {
            "documents": self.documents,
            "tokens": sum(s["tokens"] for s in self.shards),
            "shards": self.shards,
        }

    def _open_next(self) -> None:
        self._close_current()
        name = f"{self.split}_{len(self.shards):05d}.bin"
        self._file = open(self.folder / name, "xb")  # "x": never overwrite a shard (a fresh folder holds none)
        self._name, self._tokens, self._hash = name, 0, hashlib.sha256()

    def _close_current(self) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        self.shards.append({"file": self._name, "tokens": self._tokens, "sha256": self._hash.hexdigest()})


def unigram_entropy_nats(counts: np.ndarray) -> float:
    """-sum p ln p of the token frequencies: the loss of a model that ignores context, a ceiling any trained model
    should beat."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def write_manifest(folder: Path, manifest: Dict) -> None:
    with open(folder / MANIFEST, "x") as f:  # "x": a prepared folder is written once, never overwritten
        json.dump(manifest, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def load_manifest(prepared_dir) -> Dict:
    """Read and check the structure of `prepared_dir/manifest.json`."""
    path = Path(prepared_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path} does not exist: run `lit-pretrain prepare` for this data.prepared_dir first")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}): {_REPREPARE}") from None
    where = str(path)
    if _field(manifest, "format_version", int, where) != FORMAT_VERSION:
        raise DataError(
            f"{path} has format_version {manifest['format_version']}, this code reads {FORMAT_VERSION}: {_REPREPARE}"
        )
    _field(manifest, "config", dict, where)
    _field(_field(manifest, "corpus", dict, where), "fingerprint", str, where)
    _field(manifest, "unigram_entropy_nats", float, where)
    tok = _field(manifest, "tokenizer", dict, where)
    for key, kind in (("file", str), ("sha256", str), ("vocab_size", int), ("eod_id", int)):
        _field(tok, key, kind, where)
    try:
        np.dtype(_field(manifest, "dtype", str, where))
    except TypeError:
        raise DataError(f"{path}: dtype {manifest['dtype']!r} is not a numpy dtype: {_REPREPARE}") from None
    splits = _field(manifest, "splits", dict, where)
    for split in SPLITS:
        info = _field(splits, split, dict, where)
        _field(info, "documents", int, where)
        _field(info, "tokens", int, where)
        for shard in _field(info, "shards", list, where):
            name = _field(shard, "file", str, where)
            if Path(name).name != name:
                raise DataError(f"{path}: shard name {name!r} is not a plain file name: {_REPREPARE}")
            _field(shard, "tokens", int, where)
            _field(shard, "sha256", str, where)
    return manifest


def _field(obj, key: str, kind: type, where: str):
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise DataError(f"{where}: entry {key!r} is missing or not a {kind.__name__}: {_REPREPARE}")
    return value


def check_config(manifest: Dict, cfg, prepared_dir) -> None:
    """Refuse a prepared folder made from a different content-determining data config."""
    here, there = content_config(cfg), {**_ADDED_FIELD_DEFAULTS, **manifest["config"]}
    if here != there:
        diff = ", ".join(
            f"data.{k}: {there.get(k)!r} there, {here.get(k)!r} here" for k in CONTENT_FIELDS if here[k] != there.get(k)
        )
        raise DataError(
            f"data.prepared_dir {str(prepared_dir)!r} was prepared from a different data config ({diff}): set "
            "data.prepared_dir to a new folder, or delete that folder to prepare it again"
        )


def verify_shards(prepared_dir, manifest: Dict, checksums: bool = True) -> None:
    """Check that the tokenizer and every shard are the files the manifest describes (size, and sha256 when
    `checksums`; hashing runs at ~1 GB/s, so it is cheap next to training)."""
    folder = Path(prepared_dir)
    tok_path = folder / manifest["tokenizer"]["file"]
    if not tok_path.is_file():
        raise DataError(f"{tok_path} is missing: {_REPREPARE}")
    if tokenizer_sha256(tok_path) != manifest["tokenizer"]["sha256"]:
        raise DataError(
            f"{tok_path}: the tokenizer does not match the shards (its sha256 differs from the manifest's; these are "
            f"shards from another tokenizer): {_REPREPARE}"
        )
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            path = folder / shard["file"]
            if not path.is_file():
                raise DataError(f"shard {path} is missing: {_REPREPARE}")
            size, expected = path.stat().st_size, shard["tokens"] * itemsize
            if size != expected:
                raise DataError(
                    f"shard {path} has {size} bytes, the manifest says {expected} (truncated?): {_REPREPARE}"
                )
            if checksums and _file_sha256(path) != shard["sha256"]:
                raise DataError(f"shard {path} is corrupted (sha256 differs from the manifest's): {_REPREPARE}")


def open_shard(path, dtype, offset: int = 0, tokens: Optional[int] = None, random_access: bool = False) -> np.ndarray:
    """`tokens` ids (default: to the end of the file) from byte `offset`, memory-mapped. `random_access`: the
    windows are read in shuffled order, so the kernel is told not to read ahead (MADV_RANDOM): with its default
    readahead a cold read of one 257-id window fetched 109 bytes per id, 55x the ids and 6.5x the 4 KiB pages the
    window touches (bench/data/pretokenized.py, seq_len 256, uint16)."""
    ids = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=None if tokens is None else (tokens,))
    if random_access and hasattr(mmap, "MADV_RANDOM") and ids.size:
        ids._mmap.madvise(mmap.MADV_RANDOM)  # numpy keeps the mmap it maps the file with here; no public handle
    return ids


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def pretokenized_run(data) -> bool:
    """Whether a run's tokenizer comes from data.tokenizer_path as is: its (first source's) corpus is pretokenized."""
    first = data.sources[0] if getattr(data, "sources", None) else data
    return (first.corpus or data.corpus) in PRETOKENIZED


def run_tokenizer_entry(data) -> Tuple[Path, Dict]:
    """(folder, tokenizer entry of its manifest) of a run's tokenizer, the file being folder / entry["file"]: the
    prepared folder's (tokenizer_folder), or for a pretokenized corpus (of the first source, for a mixture)
    data.tokenizer_path itself, with its data.eos_token id, as data/pretokenized.py records it."""
    if not pretokenized_run(data):
        folder = tokenizer_folder(data)
        return folder, load_manifest(folder)["tokenizer"]
    from lit_pretrain.data.tokenizer import load_tokenizer

    path = Path(data.tokenizer_path).resolve()
    return path.parent, {"file": path.name, "sha256": tokenizer_sha256(path),
                         "eod_id": load_tokenizer(path, data.eos_token).token_to_id(data.eos_token)}


def tokenizer_folder(data) -> Path:
    """The prepared folder holding a run's tokenizer and manifest: data.prepared_dir, or for a mixture its first
    source's (data.prepared_dir/<name> unless the source sets prepared_dir: datamodule.source_configs), whose
    tokenizer every source shares."""
    if getattr(data, "sources", None):
        first = data.sources[0]
        return Path(first.prepared_dir or Path(data.prepared_dir) / first.name)
    return Path(data.prepared_dir)
