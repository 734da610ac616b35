"""Normalization, shingles and MinHash signatures, computed in numpy in a pool of worker processes.

A signature is one row of a `(documents, num_perm)` uint32 array (512 bytes a document at num_perm 128), never one
Python object per document. Each row depends only on its document's text, num_perm and seed, so the array is the
same for any pool size and chunking. The rows are bit for bit those of datasketch's `MinHash(num_perm, seed)`
(>= 2.0, its default "affine32" scheme) updated with the same shingles (tests/data/test_deduplication.py compares them):
the same shingle hash (SHA-1, first 4 bytes, little-endian), the same MurmurHash3 finalizer, the same permutations
a * h + b mod 2^32 drawn from np.random.RandomState(seed) in datasketch's order. They are computed here rather than
by datasketch so that a worker imports only numpy: importing datasketch (and scipy with it) took ~2.5 s per
worker, a third of a 7 s job, and one numpy pass over many documents' shingles at once replaces one
`update_batch` call (a dozen small numpy calls) per document.

This module imports neither torch, Lightning, datasketch nor scipy: it is what each worker (data/preparation/workers.py)
loads.
"""

import hashlib
import os
import sys
import unicodedata
from functools import lru_cache
from itertools import accumulate
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Set, Tuple

import numpy as np

from lit_pretrain.data.preparation.workers import WorkerPool

SIGNATURE_DTYPE = np.dtype(np.uint32)  # datasketch's "affine32" hash values
SCHEME = "affine32"  # the datasketch scheme these values follow (LeanMinHash(scheme=...) in lsh.minhashlsh_pairs)
# One numpy pass takes the shingles of consecutive documents up to this many: a (num_perm, shingles) uint32 array of
# 128 x 8k x 4 bytes = 4 MB at most, however long the document (a longer one is taken in slices). Measured on 420k
# shingles: 0.05 s in blocks of 8k laid out (num_perm, shingles), against 0.56 s in blocks of 16k laid out
# (shingles, num_perm): each document's minimum then runs along contiguous memory, and the block stays in cache.
_UPDATE_BATCH = 1 << 13
# Work is handed to the pool in chunks of about this many characters: pickling a chunk and its rows costs ~0.5 ms
# against ~25 ms of hashing, and a worker holds at most 2 queued chunks (~50 ms) when this process runs out of
# work (the streaming SignatureSpill's tail); compute_signatures' last chunks are smaller still (`chunks`).
_CHUNK_CHARS = 1 << 18
_MIN_CHUNK_CHARS = 1 << 14  # the smallest chunk `chunks` cuts near the end of the work
# A chunk takes well under a second; a worker silent for this long is gone.
_CHUNK_TIMEOUT_S = 600
_FIX = ("set data.deduplication.processes=1 to compute in this process, or lower it if workers run out of "
        "memory")
# MurmurHash3's 32-bit finalizer (fmix32), as datasketch's _fmix: (shift, multiplier, shift, multiplier, shift).
_FMIX = (np.uint32(16), np.uint32(0x85EBCA6B), np.uint32(13), np.uint32(0xC2B2AE35), np.uint32(16))


def normalize(text: str, lowercase: bool, fold_whitespace: bool) -> str:
    """Unicode NFC, then optional lower-casing, then optional whitespace folding (runs → one space, ends stripped)."""
    text = unicodedata.normalize("NFC", text)
    if lowercase:
        text = text.lower()
    if fold_whitespace:
        # str.split() with no argument splits on runs of Unicode whitespace (str.isspace) and drops the ends; ~5x
        # faster than the equivalent regex substitution.
        text = " ".join(text.split())
    return text


def shingles(text: str, kind: str, size: int) -> Set[bytes]:
    """The set of word or character n-grams of a normalized text, UTF-8 encoded; a text shorter than n is one
    shingle (so short documents are compared whole rather than dropped)."""
    if kind == "word":
        words = text.split()
        data = " ".join(words).encode("utf-8")
        if len(words) <= size:
            return {data}
        # Shingle i is " ".join(words[i : i + size]).encode(), sliced from the text encoded once rather than joined
        # and encoded shingle by shingle: no word holds a space, and no UTF-8 sequence holds byte 0x20, so the
        # encoded words are data's pieces between spaces. ends[k]: one past the space after word k.
        ends = list(accumulate(len(w) + 1 for w in data.split(b" ")))
        return {data[a : b - 1] for a, b in zip([0, *ends], ends[size - 1 :])}
    if kind == "char":
        if len(text) <= size:
            return {text.encode("utf-8")}
        if text.isascii():  # one byte a character: slice the encoded text
            data = text.encode("ascii")
            return {data[i : i + size] for i in range(len(data) - size + 1)}
        return {text[i : i + size].encode("utf-8") for i in range(len(text) - size + 1)}
    raise ValueError(f"shingle kind {kind!r} is not 'word' or 'char'")


@lru_cache(maxsize=8)
def permutations(num_perm: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """(a, b) of the num_perm affine permutations h -> a * h + b mod 2^32, drawn as datasketch's MinHash draws them
    (`_init_permutations`, scheme affine32): from np.random.RandomState(seed), all a first (odd: 2k + 1 with k
    uniform below 2^31, so each map is a bijection), then all b (uniform below 2^32)."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    b = gen.randint(0, 1 << 32, num_perm, dtype=np.uint32)
    a.flags.writeable = b.flags.writeable = False  # shared by every call through the cache
    return a, b


def signature_dtype(num_perm: int, seed: int) -> np.dtype:
    return SIGNATURE_DTYPE


def shingle_hashes(grams) -> np.ndarray:
    """datasketch's sha1_hash32 of each shingle (the first 4 bytes of its SHA-1, little-endian), as uint32."""
    sha1 = hashlib.sha1
    return _as_hashes([sha1(g).digest()[:4] for g in grams])


def _as_hashes(digests: List[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(digests), dtype="<u4").astype(np.uint32)  # a writable native-order copy


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's finalizer, in place on a fresh uint32 array (products wrap mod 2^32, as in datasketch)."""
    s1, m1, s2, m2, s3 = _FMIX
    h ^= h >> s1
    h *= m1
    h ^= h >> s2
    h *= m2
    h ^= h >> s3
    return h


def _shingle_blocks(texts: Sequence[str], kind: str, size: int) -> Iterator[Tuple[int, int, np.ndarray, List[int]]]:
    """(first, end, hashes, starts): the shingle hashes of documents [first, end) and where each document's begin,
    at most _UPDATE_BATCH hashes a block; a document with more comes alone, in slices of a block each."""
    sha1 = hashlib.sha1
    digests: List[bytes] = []
    starts: List[int] = []
    first = 0
    for row, text in enumerate(texts):
        grams = shingles(text, kind, size)  # never empty: a text shorter than `size` is one shingle
        if digests and len(digests) + len(grams) > _UPDATE_BATCH:
            yield first, row, _as_hashes(digests), starts
            digests, starts = [], []
        if not digests:
            first = row
        if len(grams) > _UPDATE_BATCH:
            grams = list(grams)
            for i in range(0, len(grams), _UPDATE_BATCH):
                yield row, row + 1, shingle_hashes(grams[i : i + _UPDATE_BATCH]), [0]
            continue
        starts.append(len(digests))
        digests += [sha1(g).digest()[:4] for g in grams]
    if digests:
        yield first, len(texts), _as_hashes(digests), starts


def chunk_signatures(task: Tuple[Sequence[str], str, int, int, int]) -> np.ndarray:
    """Signatures of normalized texts as a (len(texts), num_perm) array; the pool's unit of work."""
    texts, kind, size, num_perm, seed = task
    a, b = permutations(num_perm, seed)
    # datasketch's empty MinHash holds 2^32 - 1 everywhere; each block lowers its documents' rows.
    out = np.full((len(texts), num_perm), np.iinfo(np.uint32).max, dtype=SIGNATURE_DTYPE)
    for first, end, hashes, starts in _shingle_blocks(texts, kind, size):
        # One pass over the block: every shingle's mixed hash under every permutation, then each document's minimum.
        phv = np.multiply.outer(a, _fmix32(hashes))
        phv += b[:, None]
        np.minimum(out[first:end], np.minimum.reduceat(phv, starts, axis=1).T, out=out[first:end])
    return out


def chunks(texts: Sequence[str], max_chars: int = _CHUNK_CHARS, parts: int = 1) -> List[Tuple[int, int]]:
    """[start, end) index ranges of consecutive texts of about max_chars characters each: a chunk ends at the first
    text that brings it to its size. For `parts` processes, the chunks shrink near the end (at most 1/(4 * parts) of
    the characters left, down to _MIN_CHUNK_CHARS): a worker holds up to 2 queued chunks when this process runs out
    of work, so small last chunks let every process finish at about the same time (guided scheduling).

    One numpy pass over the lengths, then a binary search a chunk: it runs before any worker has work, so a Python
    loop over 100k texts here (~50 ms) was a serial share of the 2-process stage."""
    ends = np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)))
    total = int(ends[-1]) if len(texts) else 0
    ranges, start = [], 0
    while start < len(texts):
        done = int(ends[start - 1]) if start else 0
        size = min(max_chars, max(_MIN_CHUNK_CHARS, (total - done) // (4 * parts))) if parts > 1 else max_chars
        end = start + int(np.searchsorted(ends[start:], done + size)) + 1  # the first text reaching `size`, kept
        ranges.append((start, min(end, len(texts))))
        start = ranges[-1][1]
    return ranges


def pool_size(processes: Optional[int], n_chunks: int) -> int:
    """Processes to use: the configured number (null: one per core), never more than there are chunks."""
    wanted = processes if processes is not None else (os.cpu_count() or 1)
    return max(1, min(wanted, n_chunks))


def compute_signatures(texts: Sequence[str], kind: str, size: int, num_perm: int, seed: int,
                       processes: Optional[int] = None, progress: bool = True,
                       ids: Optional[Sequence[str]] = None) -> Tuple[np.ndarray, int]:
    """Signatures of normalized texts (rows in input order) and the number of processes that computed them
    (this one included). `ids` name the texts in error messages (default: their index)."""
    ranges = chunks(texts, _CHUNK_CHARS)
    processes = pool_size(processes, len(ranges))
    if processes > 1:
        ranges = chunks(texts, _CHUNK_CHARS, processes)
    out = np.empty((len(texts), num_perm), dtype=SIGNATURE_DTYPE)
    bar = _progress(len(texts), progress)
    try:
        if processes == 1:
            for a, b in ranges:
                out[a:b] = chunk_signatures((texts[a:b], kind, size, num_perm, seed))
                bar.update(b - a)
        else:
            label = (lambda i: repr(ids[i])) if ids is not None else (lambda i: f"#{i}")
            _share_work(texts, ranges, out, bar, processes - 1, (kind, size, num_perm, seed), label)
    finally:
        bar.close()
    return out, processes


def _share_work(texts, ranges, out: np.ndarray, bar, workers: int, params: tuple, label) -> None:
    """Chunks go to `workers` worker processes, up to 2 queued per worker, and this process computes the others:
    so each worker's start-up (a fresh interpreter importing numpy: a fraction of a second) overlaps useful work.

    Separate processes, not forked ones: a forked child that runs OpenMP code after the parent did can deadlock
    (docs/cpu.md, pitfall 6). The workers never import the caller's main module, so a script that
    calls `deduplicate` needs no main guard and may even be piped to Python; a worker that cannot start, or dies
    twice on one chunk, stops the stage with one WorkerError line (lit_pretrain/data/preparation/workers.py).
    """
    with WorkerPool("lit_pretrain.data.preparation.minhash:chunk_signatures", workers, "MinHash signature", _FIX,
                    timeout_s=_CHUNK_TIMEOUT_S) as pool:
        for a, b in ranges:
            task = (list(texts[a:b]), *params)
            if pool.pending < 2 * workers:
                pool.submit((a, b), task, label(a))
            else:
                out[a:b] = chunk_signatures(task)
                bar.update(b - a)
            for (ra, rb), value in pool.ready():
                out[ra:rb] = value
                bar.update(rb - ra)
        for (ra, rb), value in pool.drain():
            out[ra:rb] = value
            bar.update(rb - ra)


class SignatureSpill:
    """Signatures of normalized texts added one at a time (prepare's streaming pass), computed a chunk at a time in
    this process and `processes` - 1 workers, and written as rows of the file `path` at their input position, so
    chunks may finish in any order. `finish()` returns the rows as a read-only `np.memmap`: the (documents, num_perm)
    array is never held in memory. Rows are the same as compute_signatures' for any pool size and chunking."""

    def __init__(self, path: Path, kind: str, size: int, num_perm: int, seed: int, processes: Optional[int] = None,
                 progress: bool = True):
        self.path, self.params = Path(path), (kind, size, num_perm, seed)
        self.dtype = SIGNATURE_DTYPE
        self.num_perm = num_perm
        self.wanted = processes if processes is not None else (os.cpu_count() or 1)
        self.rows, self.chunks = 0, 0
        self._file = open(self.path, "x+b")  # "x": a file of the staging folder this prepare made, never reused
        self._texts: List[str] = []
        self._chars, self._label = 0, ""
        # The first chunk waits for a second: a corpus of one chunk is computed here without starting workers.
        self._held: Optional[Tuple[int, List[str], str]] = None
        self._pool: Optional[WorkerPool] = None
        self._workers = 0
        self._bar = _progress(None, progress)

    def add(self, text: str, label: str) -> None:
        """Queue one text; `label` names it in error messages (a document id)."""
        if not self._texts:
            self._label = label
        self._texts.append(text)
        self._chars += len(text)
        if self._chars >= _CHUNK_CHARS:
            self._flush()

    def finish(self) -> np.ndarray:
        """All rows, in input order; stops the workers."""
        if self._texts:
            self._flush()
        if self._held is not None:  # one chunk in all
            self._compute_here(*self._held)
            self._held = None
        if self._pool is not None:
            for start, value in self._pool.drain():
                self._write(start, value)
        self.close()
        if self.rows == 0:
            return np.empty((0, self.num_perm), dtype=self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.rows, self.num_perm))

    @property
    def processes(self) -> int:
        """Processes that computed signatures, this one included (as compute_signatures reports it)."""
        return max(1, min(self.wanted, self.chunks))

    def close(self, kill: bool = False) -> None:
        if self._pool is not None:
            self._pool.close(kill)
            self._pool = None
        if not self._file.closed:
            self._file.flush()
            self._file.close()
        self._bar.close()

    def _flush(self) -> None:
        chunk = (self.rows, self._texts, self._label)
        self.rows += len(self._texts)
        self.chunks += 1
        self._texts, self._chars = [], 0
        if self.wanted == 1:
            self._compute_here(*chunk)
            return
        if self._pool is None:
            if self._held is None:
                self._held = chunk
                return
            self._workers = self.wanted - 1
            self._pool = WorkerPool("lit_pretrain.data.preparation.minhash:chunk_signatures", self._workers,
                                    "MinHash signature", _FIX, timeout_s=_CHUNK_TIMEOUT_S)
            held, self._held = self._held, None
            self._share(held)
        self._share(chunk)

    def _share(self, chunk: Tuple[int, List[str], str]) -> None:
        # As _share_work: up to 2 chunks queued per worker, this process computes the others.
        start, texts, label = chunk
        if self._pool.pending < 2 * self._workers:
            self._pool.submit(start, (texts, *self.params), repr(label))
        else:
            self._compute_here(start, texts, label)
        for key, value in self._pool.ready():
            self._write(key, value)

    def _compute_here(self, start: int, texts: List[str], label: str) -> None:
        self._write(start, chunk_signatures((texts, *self.params)))

    def _write(self, start: int, rows: np.ndarray) -> None:
        self._file.seek(start * self.num_perm * self.dtype.itemsize)
        self._file.write(np.ascontiguousarray(rows, dtype=self.dtype).tobytes())
        self._bar.update(len(rows))


def estimated_jaccard(signatures: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Share of equal signature values of each pair (left[k], right[k]): MinHash's estimate of their Jaccard
    similarity (Broder 1997), the same number as datasketch's MinHash.jaccard."""
    out = np.empty(len(left), dtype=np.float64)
    step = 1 << 16  # bounds the temporary (pairs, num_perm) boolean array
    for start in range(0, len(left), step):
        sl = slice(start, start + step)
        out[sl] = (signatures[left[sl]] == signatures[right[sl]]).mean(axis=1)
    return out


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: Optional[int], enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    # disable=None: shown on a terminal, silent in logs and CI.
    return tqdm(total=total, desc="MinHash signatures", unit="doc", file=sys.stderr, disable=None, leave=False)
