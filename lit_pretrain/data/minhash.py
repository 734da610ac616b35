"""Normalization, shingles and MinHash signatures (datasketch), computed in a pool of worker processes.

A signature is one row of a `(documents, num_perm)` numpy array in the dtype of datasketch's permutation scheme
(uint32 for its default "affine32" since datasketch 2.0: 512 bytes a document at num_perm 128), never one Python
object per document. Each row depends only on its document's text, num_perm and seed, so the array is the same
for any pool size and chunking. Shingles are hashed with datasketch's default (SHA-1, first 4 bytes), so these
signatures agree with any other datasketch MinHash built with the same seed and num_perm.

This module imports neither torch nor Lightning: it is what each worker (lit_pretrain/workers.py) loads.
"""

import os
import sys
import unicodedata
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Set, Tuple

import numpy as np
from datasketch import MinHash

from lit_pretrain.workers import WorkerPool

# One update_batch call builds a (shingles, num_perm) array: 16k shingles × 128 × 4 bytes = 8 MB at most, however
# long the document.
_UPDATE_BATCH = 1 << 14
# Work is handed to the pool in chunks of about this many characters: large enough that pickling and scheduling
# are small next to hashing, small enough that 2 processes get many chunks each and the progress bar moves.
_CHUNK_CHARS = 1 << 20
# A 1 MB chunk takes well under a second; a worker silent for this long is gone.
_CHUNK_TIMEOUT_S = 600
_FIX = ("set data.deduplication.processes=1 to compute in this process, or lower it if workers run out of "
        "memory")


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
        if len(words) <= size:
            return {" ".join(words).encode("utf-8")}
        return {" ".join(gram).encode("utf-8") for gram in zip(*(words[i:] for i in range(size)))}
    if kind == "char":
        if len(text) <= size:
            return {text.encode("utf-8")}
        return {text[i : i + size].encode("utf-8") for i in range(len(text) - size + 1)}
    raise ValueError(f"shingle kind {kind!r} is not 'word' or 'char'")


def template(num_perm: int, seed: int) -> MinHash:
    """The empty MinHash every signature starts from (its permutations are drawn once per process)."""
    return MinHash(num_perm=num_perm, seed=seed)


def signature_dtype(num_perm: int, seed: int) -> np.dtype:
    return template(num_perm, seed).hashvalues.dtype


def chunk_signatures(task: Tuple[Sequence[str], str, int, int, int]) -> np.ndarray:
    """Signatures of normalized texts as a (len(texts), num_perm) array; the pool's unit of work."""
    texts, kind, size, num_perm, seed = task
    empty = template(num_perm, seed)
    out = np.empty((len(texts), num_perm), dtype=empty.hashvalues.dtype)
    for row, text in enumerate(texts):
        m = empty.copy()  # shares the permutation arrays, as MinHash.bulk does
        grams = shingles(text, kind, size)
        if len(grams) <= _UPDATE_BATCH:
            m.update_batch(grams)
        else:
            grams = list(grams)
            for start in range(0, len(grams), _UPDATE_BATCH):
                m.update_batch(grams[start : start + _UPDATE_BATCH])
        out[row] = m.hashvalues
    return out


def chunks(texts: Sequence[str], max_chars: int = _CHUNK_CHARS) -> Iterator[Tuple[int, int]]:
    """[start, end) index ranges of consecutive texts of about max_chars characters each."""
    start, size = 0, 0
    for i, text in enumerate(texts):
        size += len(text)
        if size >= max_chars:
            yield start, i + 1
            start, size = i + 1, 0
    if start < len(texts):
        yield start, len(texts)


def pool_size(processes: Optional[int], n_chunks: int) -> int:
    """Processes to use: the configured number (null: one per core), never more than there are chunks."""
    wanted = processes if processes is not None else (os.cpu_count() or 1)
    return max(1, min(wanted, n_chunks))


def compute_signatures(texts: Sequence[str], kind: str, size: int, num_perm: int, seed: int,
                       processes: Optional[int] = None, progress: bool = True,
                       ids: Optional[Sequence[str]] = None) -> Tuple[np.ndarray, int]:
    """Signatures of normalized texts (rows in input order) and the number of processes that computed them
    (this one included). `ids` name the texts in error messages (default: their index)."""
    ranges = list(chunks(texts, _CHUNK_CHARS))
    processes = pool_size(processes, len(ranges))
    out = np.empty((len(texts), num_perm), dtype=signature_dtype(num_perm, seed))
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
    so each worker's start-up (importing datasketch, and scipy with it: about a second) overlaps useful work.

    Separate processes, not forked ones: a forked child that runs OpenMP code after the parent did can deadlock
    (shared/CPU-DISTRIBUTED.md, pitfall 6). The workers never import the caller's main module, so a script that
    calls `deduplicate` needs no main guard and may even be piped to Python; a worker that cannot start, or dies
    twice on one chunk, stops the stage with one WorkerError line (lit_pretrain/workers.py).
    """
    with WorkerPool("lit_pretrain.data.minhash:chunk_signatures", workers, "MinHash signature", _FIX,
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
        self.dtype = signature_dtype(num_perm, seed)
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
            self._pool = WorkerPool("lit_pretrain.data.minhash:chunk_signatures", self._workers,
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
