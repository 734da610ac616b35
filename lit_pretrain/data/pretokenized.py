"""Corpora tokenized by other pipelines, trained on as they are (data.corpus: megatron, numpy, nanogpt).

Each file is memory-mapped where it lies, never copied or rewritten; a file becomes one or two of the windowing's
"shards" (a byte offset and a token count into it, datamodule.ShardWindows), so GlobalOrderSampler, the mixtures,
exact resume and document masking work on them unchanged.

Formats (little-endian, as their writers produce on every machine they run on):
  megatron  Megatron-LM's indexed dataset, PREFIX.bin + PREFIX.idx (megatron/core/datasets/indexed_dataset.py,
            _IndexWriter): .idx = b"MMIDIDX\\x00\\x00", version <Q (1), dtype code <B (1 uint8, 2 int8, 3 int16,
            4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), sequence count <Q, document-index count <Q, then
            int32 sequence lengths, int64 sequence byte pointers into .bin, int64 document indices (a leading 0,
            then the sequence index one past each document's last). .bin = the sequences' tokens back to back.
  numpy     OLMo-core / Dolma's token arrays: a flat file of uint16 or uint32 ids with no header (named .npy), with
            an optional NAME.csv.gz beside it whose lines start with `start,end` token offsets of each document
            (olmo_core/data/utils.py, write_document_indices). A real .npy (np.save's header) is read too.
  nanogpt   nanoGPT's data/*/prepare.py output: raw uint16 ids (no header); or llm.c's dev/data format
            (data_common.write_datafile): 256 int32 header, [0] magic 20240520 with [1] version 1 (GPT-2, uint16
            ids) or magic 20240801 with version 7 (Llama 3, uint32 ids), [2] the token count, then the ids.

Checks before training, each naming the file: the header and sizes agree; the ids fit the tokenizer named by
data.tokenizer_path (a chunked min/max over the memmap: one sequential read of the corpus at the first setup, the only
read of a token that is not a training read; an id >= the vocabulary is refused with its file and offset; a file that
passed is recorded under data.check_cache_dir, so later starts and restarts skip the read: data/check_record.py); with
data.document_masking, every document the format delimits ends in data.eos_token's id (documents are told apart by
that id in the window, datamodule's contract), or the stream holds that id at all where the format has no
boundaries.

Validation: data.val_paths when given, else the last data.val_fraction of each file's tokens, cut at a document
boundary where the format has them (Megatron's own splits are contiguous document ranges too).
"""

import functools
import glob
import gzip
import hashlib
import json
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from lit_pretrain.data.check_record import cache_folder, checked
from lit_pretrain.data.shards import FORMAT_VERSION, PRETOKENIZED, token_dtype
from lit_pretrain.data.tokenizer import load_tokenizer, tokenizer_sha256
from lit_pretrain.errors import DataError

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                   8: np.uint16}
LLMC_HEADER_INTS = 256
LLMC_FORMATS = {20240520: (1, np.uint16), 20240801: (7, np.uint32)}  # magic: (version, id dtype)
SCAN_TOKENS = 1 << 24  # ids per chunk of the vocabulary scan: 32-64 MB, so the scan's memory stays bounded
_FINGERPRINT_BYTES = 1 << 20


def is_pretokenized(cfg) -> bool:
    return cfg.corpus in PRETOKENIZED


@dataclass
class TokenFile:
    """One memory-mappable file of ids: `tokens` ids of `dtype` from byte `offset` of `path`."""

    path: str
    dtype: np.dtype
    offset: int
    tokens: int
    doc_ends: Optional[np.ndarray]
    """Token index one past each document's last token, increasing; None where the format has no boundaries."""
    index: Optional[str] = None
    """The file holding the boundaries (.idx, .csv.gz), part of the fingerprint."""

    def ids(self) -> np.ndarray:
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.tokens,))


def read_megatron(prefix: str) -> TokenFile:
    """PREFIX.bin + PREFIX.idx (module docstring), checked against each other."""
    bin_path, idx_path = Path(prefix + ".bin"), Path(prefix + ".idx")
    for p in (bin_path, idx_path):
        if not p.is_file():
            raise DataError(f"{p} does not exist: data.paths names Megatron prefixes (PREFIX.bin + PREFIX.idx)")
    size = idx_path.stat().st_size
    with open(idx_path, "rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != MEGATRON_MAGIC:
        raise DataError(f"{idx_path} is not a Megatron index (no MMIDIDX header): check data.corpus and data.paths")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise DataError(f"{idx_path}: Megatron index version {version}; this reads version 1")
    if code not in MEGATRON_DTYPES or np.dtype(MEGATRON_DTYPES[code]).kind == "f":
        raise DataError(f"{idx_path}: dtype code {code} is not an integer token dtype (1-5, 8)")
    dtype = np.dtype(MEGATRON_DTYPES[code])
    need = 34 + 12 * n_seq + 8 * n_doc
    if size < need:  # a multimodal index carries one more int8 per sequence after these: read, not needed
        raise DataError(f"{idx_path} has {size} bytes, its header promises {need} (truncated?)")
    lengths = np.memmap(idx_path, dtype="<i4", mode="r", offset=34, shape=(n_seq,)) if n_seq else np.zeros(0, "<i4")
    pointers = (np.memmap(idx_path, dtype="<i8", mode="r", offset=34 + 4 * n_seq, shape=(n_seq,)) if n_seq
                else np.zeros(0, "<i8"))
    documents = np.memmap(idx_path, dtype="<i8", mode="r", offset=34 + 12 * n_seq, shape=(n_doc,)) if n_doc else None
    ends = np.cumsum(lengths, dtype=np.int64)  # token index one past each sequence
    starts_bytes = np.concatenate([[0], ends[:-1]]) * dtype.itemsize
    if (lengths < 0).any() or not np.array_equal(pointers, starts_bytes):
        raise DataError(f"{idx_path}: the sequences are not stored back to back in {bin_path.name} (pointers differ "
                        "from the running sum of the lengths); this reads contiguous .bin files only")
    tokens = int(ends[-1]) if n_seq else 0
    if bin_path.stat().st_size != tokens * dtype.itemsize:
        raise DataError(f"{bin_path} has {bin_path.stat().st_size} bytes, {idx_path.name} describes "
                        f"{tokens * dtype.itemsize} ({tokens} {dtype} ids): truncated, or not this index's data")
    if documents is None or documents[0] != 0 or (np.diff(documents) < 0).any() or documents[-1] != n_seq:
        raise DataError(f"{idx_path}: the document indices do not run from 0 to the sequence count {n_seq}")
    doc_ends = ends[np.asarray(documents[1:]) - 1] if n_seq else np.zeros(0, np.int64)
    doc_ends = doc_ends[np.concatenate([[True], np.diff(doc_ends) > 0])] if len(doc_ends) else doc_ends
    return TokenFile(str(bin_path), dtype, 0, tokens, doc_ends, str(idx_path))


def numpy_metadata_path(path: Path) -> Path:
    """OLMo-core's document metadata beside a token file: NAME.csv.gz for NAME.npy."""
    name = path.name[:-4] if path.name.endswith(".npy") else path.name
    return path.with_name(name + ".csv.gz")


def read_numpy(path: str, dtype: np.dtype) -> TokenFile:
    """A flat id file (module docstring) with its .csv.gz boundaries when present."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p} does not exist: fix data.paths")
    offset, size = 0, p.stat().st_size
    with open(p, "rb") as f:
        magic = f.read(6)
    if magic == b"\x93NUMPY":  # np.save's header: its dtype and shape rule
        try:
            arr = np.load(p, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise DataError(f"{p} has a .npy header numpy cannot read ({e})") from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise DataError(f"{p} holds a {arr.dtype} array of shape {arr.shape}: expected 1-D integer token ids")
        dtype, offset, size = arr.dtype, arr.offset, arr.nbytes
    elif size % dtype.itemsize:
        raise DataError(f"{p} has {size} bytes, not a whole number of {dtype} ids: set data.token_dtype to the "
                        "dtype it was written with")
    tokens = size // dtype.itemsize
    meta = numpy_metadata_path(p)
    doc_ends = None
    if meta.is_file():
        rows = []
        with gzip.open(meta, "rt") as f:
            for line_no, line in enumerate(f, start=1):
                fields = line.split(",")
                try:
                    rows.append((int(fields[0]), int(fields[1])))
                except (ValueError, IndexError):
                    raise DataError(f"{meta}:{line_no} is not `start,end`: fix or remove the file") from None
        bounds = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
        if len(bounds) and (bounds[0, 0] != 0 or bounds[-1, 1] != tokens or (bounds[1:, 0] != bounds[:-1, 1]).any()
                            or (bounds[:, 1] <= bounds[:, 0]).any()):
            raise DataError(f"{meta}: the documents do not tile {p.name}'s {tokens} ids (each start the previous "
                            "end, from 0 to the last id)")
        doc_ends = bounds[:, 1]
    return TokenFile(str(p), np.dtype(dtype), offset, tokens, doc_ends, str(meta) if doc_ends is not None else None)


def read_nanogpt(path: str) -> TokenFile:
    """nanoGPT's raw uint16 file or llm.c's headed one (module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p} does not exist: fix data.paths")
    size = p.stat().st_size
    header = np.fromfile(p, dtype="<i4", count=LLMC_HEADER_INTS) if size >= 4 * LLMC_HEADER_INTS else None
    if header is not None and int(header[0]) in LLMC_FORMATS:
        version, dtype = LLMC_FORMATS[int(header[0])]
        dtype = np.dtype(dtype)
        if int(header[1]) != version:
            raise DataError(f"{p}: llm.c magic {header[0]} with version {header[1]}; that magic has version {version}")
        tokens = int(header[2])
        if size != 4 * LLMC_HEADER_INTS + tokens * dtype.itemsize:
            raise DataError(f"{p} has {size} bytes, its llm.c header promises {tokens} {dtype} ids after 1024 bytes "
                            "(truncated?)")
        return TokenFile(str(p), dtype, 4 * LLMC_HEADER_INTS, tokens, None)
    if size % 2:
        raise DataError(f"{p} has an odd number of bytes: not nanoGPT's uint16 ids, nor an llm.c file (magic "
                        f"{'/'.join(map(str, LLMC_FORMATS))})")
    return TokenFile(str(p), np.dtype(np.uint16), 0, size // 2, None)


_SUFFIX = {"megatron": ".idx", "numpy": ".npy", "nanogpt": ".bin"}


def expand(corpus: str, entries: List[str]) -> List[str]:
    """data.paths entries as files (Megatron: prefixes), in the order given: a folder contributes its files of the
    format's suffix (.idx, .npy, .bin) beneath it, a glob pattern its matches, each sorted; a Megatron entry may
    name the prefix or either of its files."""
    out: Dict[str, None] = {}  # insertion-ordered, each file once
    for entry in map(str, entries):
        if Path(entry).is_dir():
            found = sorted(str(p) for p in Path(entry).rglob(f"*{_SUFFIX[corpus]}"))
        elif glob.has_magic(entry):
            found = sorted(glob.glob(entry))
        else:
            found = [entry]
        if not found:
            raise DataError(f"data.paths entry {entry!r} matches no {_SUFFIX[corpus]} file: fix data.paths")
        if corpus == "megatron":
            found = [f[:-4] if f.endswith((".bin", ".idx")) else f for f in found]
        out.update(dict.fromkeys(found))
    return list(out)


def token_files(cfg, paths: List[str], dtype: np.dtype) -> List[TokenFile]:
    read = {"megatron": read_megatron, "numpy": lambda p: read_numpy(p, dtype), "nanogpt": read_nanogpt}[cfg.corpus]
    return [read(path) for path in expand(cfg.corpus, paths)]


def check_ids(tf: TokenFile, vocab_size: int, eod: int, tokenizer: str, cut: int) -> tuple:
    """A DataError naming the file and offset of the first id outside [0, vocab_size); else the counts of `eod` ids
    before and from token `cut`. One chunked pass over the memmap: at most SCAN_TOKENS ids in memory."""
    ids, eods = tf.ids() if tf.tokens else np.zeros(0, tf.dtype), [0, 0]
    for start in range(0, tf.tokens, SCAN_TOKENS):
        chunk = ids[start: start + SCAN_TOKENS]
        lo, hi = chunk.min(), chunk.max()
        if hi >= vocab_size or lo < 0:
            at = start + int(np.argmax((chunk >= vocab_size) | (chunk < 0)))
            raise DataError(f"{tf.path}: id {ids[at]} at token offset {at} (byte {tf.offset + at * tf.dtype.itemsize})"
                            f" is outside the vocabulary of {tokenizer} ({vocab_size} ids): set data.tokenizer_path "
                            "to the tokenizer this corpus was made with")
        is_eod = chunk == eod
        before = min(max(cut - start, 0), len(chunk))
        eods[0] += int(np.count_nonzero(is_eod[:before]))
        eods[1] += int(np.count_nonzero(is_eod[before:]))
    return tuple(eods)


def _split(tf: TokenFile, val_fraction: Optional[float]):
    """(train, val) token spans [start, end) of a file: everything for train when val_fraction is None."""
    if val_fraction is None:
        return (0, tf.tokens), None
    cut = int(round(tf.tokens * (1.0 - val_fraction)))
    if tf.doc_ends is not None and len(tf.doc_ends) > 1:
        k = int(np.searchsorted(tf.doc_ends[:-1], cut))  # the first document end at or after the cut, not the last
        cut = int(tf.doc_ends[min(k, len(tf.doc_ends) - 2)])
    return (0, cut), (cut, tf.tokens)


def _documents(tf: TokenFile, span, eods: int) -> int:
    """Documents ending inside `span`: by the format's boundaries, else by the EOD ids counted there."""
    if tf.doc_ends is None:
        return eods
    return int(np.count_nonzero((tf.doc_ends > span[0]) & (tf.doc_ends <= span[1])))


def fingerprint(tf: TokenFile) -> str:
    """A sha256 of what identifies the file cheaply: its size, first and last MiB, and its whole boundary file (the
    resume check's manifest hash covers it; a full hash of a multi-terabyte corpus would read it all again)."""
    h = hashlib.sha256(f"{Path(tf.path).name}:{tf.dtype}:{tf.offset}:{tf.tokens}".encode())
    with open(tf.path, "rb") as f:
        h.update(f.read(_FINGERPRINT_BYTES))
        f.seek(max(0, Path(tf.path).stat().st_size - _FINGERPRINT_BYTES))
        h.update(f.read())
    if tf.index is not None:
        h.update(Path(tf.index).read_bytes())
    return h.hexdigest()


def check_documents(tf: TokenFile, eod: int, eods: int, eos_token: str) -> None:
    """data.document_masking: documents must be told apart by the EOD id (module docstring)."""
    if tf.doc_ends is not None and len(tf.doc_ends):
        last = tf.ids()[tf.doc_ends - 1]
        bad = np.flatnonzero(last != eod)
        if len(bad):
            raise DataError(
                f"{tf.path}: document {bad[0]} (of {len(tf.doc_ends)}) ends at token offset {tf.doc_ends[bad[0]] - 1} "
                f"with id {last[bad[0]]}, not data.eos_token={eos_token!r} (id {eod}); document masking tells "
                "documents apart by that id: tokenize with it appended (Megatron: --append-eod), set data.eos_token "
                "to the token that ends them, or set data.document_masking=false")
    elif eods == 0:
        raise DataError(f"{tf.path} holds no data.eos_token={eos_token!r} (id {eod}) and no document boundaries, so "
                        "document masking would see one document: set data.eos_token, or data.document_masking=false")


def _scan(tf: TokenFile, vocab_size: int, eod: int, cut: int, cfg) -> tuple:
    """The checks that read the file's ids: the vocabulary scan, then document masking's; the EOD counts."""
    eods = check_ids(tf, vocab_size, eod, cfg.tokenizer_path, cut)
    if cfg.document_masking:
        check_documents(tf, eod, sum(eods), cfg.eos_token)
    return eods


_OPENED: Dict[str, Dict] = {}


def open_corpus(cfg, log: Callable[[str], None] = print) -> Dict:
    """Check cfg's pretokenized corpus (module docstring) and return it as a manifest: what TokenShardDataModule
    and train() read of a prepared folder's, each shard a span of a file in place. Once per process per corpus."""
    if not cfg.tokenizer_path:
        raise DataError(f"data.corpus={cfg.corpus} holds ids of another pipeline's tokenizer: set data.tokenizer_path "
                        "to that tokenizer.json (the vocabulary the ids are checked against)")
    if not cfg.paths:
        raise DataError(f"data.corpus={cfg.corpus}: data.paths is empty: list the corpus files")
    stats = [(str(p), Path(p).stat().st_mtime_ns if Path(p).exists() else None) for p in [*cfg.paths, *cfg.val_paths]]
    cache_key = json.dumps([cfg.corpus, stats, str(cfg.tokenizer_path), cfg.eos_token, cfg.token_dtype,
                            cfg.val_fraction, cfg.document_masking], default=str)
    if cache_key in _OPENED:
        return _OPENED[cache_key]
    started = time.perf_counter()
    tokenizer = load_tokenizer(cfg.tokenizer_path, cfg.eos_token)
    vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    eod = tokenizer.token_to_id(cfg.eos_token)
    dtype = token_dtype(vocab_size, cfg.token_dtype, cfg.tokenizer_path)  # numpy's files, which carry no dtype
    groups = {"train": token_files(cfg, list(cfg.paths), dtype), "val": token_files(cfg, list(cfg.val_paths), dtype)}
    tokenizer_sha, records, from_records = tokenizer_sha256(cfg.tokenizer_path), cache_folder(cfg.check_cache_dir), 0
    splits = {"train": {"documents": 0, "tokens": 0, "shards": []}, "val": {"documents": 0, "tokens": 0, "shards": []}}
    for group, files in groups.items():
        for tf in files:
            if np.iinfo(tf.dtype).max < vocab_size - 1:
                raise DataError(f"{tf.path} stores {tf.dtype} ids, which cannot hold {cfg.tokenizer_path}'s "
                                f"{vocab_size} ids: set data.tokenizer_path to the tokenizer the corpus was made with")
            train_span, val_span = ((None, (0, tf.tokens)) if group == "val" else
                                    _split(tf, None if groups["val"] else cfg.val_fraction))
            cut = train_span[1] if train_span else 0
            sha = fingerprint(tf)
            stat = Path(tf.path).stat()
            fields = {"file": str(Path(tf.path).resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                      "sha256": sha, "dtype": str(tf.dtype), "offset": tf.offset, "tokens": tf.tokens,
                      "tokenizer_sha256": tokenizer_sha, "vocab_size": vocab_size, "eod_id": eod, "cut": cut,
                      "document_masking": cfg.document_masking}
            eods, recorded = checked(records, fields, functools.partial(_scan, tf, vocab_size, eod, cut, cfg))
            from_records += recorded
            for split, span, count in (("train", train_span, eods[0]), ("val", val_span, eods[1])):
                if span is None or span[1] <= span[0]:
                    continue
                splits[split]["documents"] += _documents(tf, span, count)
                splits[split]["tokens"] += span[1] - span[0]
                splits[split]["shards"].append({
                    "file": str(Path(tf.path).resolve()), "tokens": span[1] - span[0], "sha256": sha,
                    "offset": tf.offset + span[0] * tf.dtype.itemsize, "dtype": str(tf.dtype)})
    seconds = time.perf_counter() - started
    tokens = sum(s["tokens"] for s in splits.values())
    files = len(groups['train']) + len(groups['val'])
    earlier = f" ({from_records} of {files} files as recorded in {records})" if from_records else ""
    log(f"{cfg.corpus} corpus: {files} files, {tokens:,} tokens, ids checked against {Path(cfg.tokenizer_path).name} "
        f"({vocab_size} ids) in {seconds:.2f} s{earlier}")
    manifest = {
        "format_version": FORMAT_VERSION, "pretokenized": cfg.corpus,
        "corpus": {"kind": cfg.corpus, "paths": [str(p) for p in cfg.paths], "val_paths": [str(p) for p in
                                                                                         cfg.val_paths]},
        "tokenizer": {"file": str(Path(cfg.tokenizer_path).resolve()), "sha256": tokenizer_sha,
                      "vocab_size": vocab_size, "eod_id": eod},
        "dtype": str(groups["train"][0].dtype), "splits": splits, "unigram_entropy_nats": None, "deduplication": None,
        "seconds": {"check": round(seconds, 3)},
    }
    _OPENED[cache_key] = manifest
    return manifest
