"""Atomic file writes: a reader sees the old file or the new one, never a half-written one.

Write to a temporary name in the same folder (a rename is atomic only within one file system), fsync the file so
its bytes are on disk before the name points at them, rename over the target, then fsync the folder so the rename
itself survives a power loss (the ext4/XFS rule; see PostgreSQL's and SQLite's notes on durable renames).

Each file is fsynced once and each folder once per save: a writer that renames several files into one folder
(a checkpoint and its sidecar, a rank's files of a sharded save) passes `sync_folder=False` for all but the last,
whose folder fsync makes every rename before it durable too (fsync of a folder persists all of its entries). A crash
before that fsync can lose any of those renames, never a file's contents: the sidecar and the manifest are checked
against the file itself, so a lost rename reads as a missing file, which every reader refuses.

A large file costs about one pass over its bytes: they are hashed as they are written (HashingWriter, the hash in a
second thread while the first copies them into the page cache) and start on their way to the disk while the writer
goes on (WriteBehind), so the fsync at the end waits for the last few MiB, not for the whole file.
"""

import concurrent.futures
import hashlib
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator, Optional

from lit_pretrain.paths import safe_unlink

TMP_SUFFIX = ".tmp"
TMP_FILE = re.compile(r"\..+\.\d+\.tmp")  # temp_path's names: hidden, the writer's pid, .tmp
# Python's default 8 KiB buffer turns torch.save's many small records (zip headers, padding, pickles) into as many
# write calls; a record larger than the buffer still goes straight to the file, uncopied.
WRITE_BUFFER_BYTES = 1 << 20
WRITE_BEHIND_BYTES = 8 << 20  # how much is written between two write-back hints (WriteBehind)
PARALLEL_HASH_BYTES = 1 << 20  # a write this large is hashed in the hashing thread (HashingWriter)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    # The pid keeps two writers (a crashed run and its successor) from sharing a temporary file.
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


@contextmanager
def atomic_open(path: str | Path, sync_folder: bool = True) -> Iterator[BinaryIO]:
    """Yield a binary file; on a clean exit it replaces `path` atomically, on an error `path` is left untouched.

    sync_folder=False leaves the folder's fsync to the caller's last write into the same folder (module docstring):
    the rename is then durable only once that fsync has run."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb", buffering=WRITE_BUFFER_BYTES) as f:
            yield WriteBehind(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        safe_unlink(tmp, path.parent, TMP_FILE)
        raise
    if sync_folder:
        fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes, sync_folder: bool = True) -> None:
    with atomic_open(path, sync_folder) as f:
        f.write(data)


def atomic_link(source: str | Path, target: str | Path, sync_folder: bool = True) -> None:
    """Make `target` another name of `source` (a hard link: no copy), replacing `target` atomically; sync_folder as
    in atomic_open."""
    source, target = Path(source), Path(target)
    tmp = temp_path(target)
    safe_unlink(tmp, target.parent, TMP_FILE)  # a stale one of this pid's, from a crash between link and replace
    os.link(source, tmp)
    os.replace(tmp, target)
    if sync_folder:
        fsync_dir(target.parent)


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


class WriteBehind:
    """A binary file that asks the kernel to start writing back every WRITE_BEHIND_BYTES it is given, while the
    writer goes on: the disk then works while the rest is serialized, and the final fsync waits for the tail only.

    The hint is posix_fadvise(POSIX_FADV_DONTNEED) over the range just written: Linux starts the write-back of its
    dirty pages (mm/fadvise.c, WB_SYNC_NONE) and drops none of them (they are dirty or under write-back), the
    fallback PostgreSQL's pg_flush_data uses where sync_file_range is missing (src/backend/storage/file/fd.c).
    It promises nothing: durability is still the fsync's. Where posix_fadvise does not exist, no hint is given."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self._written = self._hinted = f.tell()

    def write(self, data) -> int:
        n = self.f.write(data)
        self._written += n
        if self._written - self._hinted >= WRITE_BEHIND_BYTES and hasattr(os, "posix_fadvise"):
            self.f.flush()  # the bytes must be in the page cache before the kernel can write them back
            os.posix_fadvise(self.f.fileno(), self._hinted, self._written - self._hinted, os.POSIX_FADV_DONTNEED)
            self._hinted = self._written
        return n

    def flush(self) -> None:
        self.f.flush()

    def tell(self) -> int:
        return self.f.tell()

    def fileno(self) -> int:
        return self.f.fileno()

    def close(self) -> None:
        self.f.close()


_HASH_POOL: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _hash_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _HASH_POOL
    if _HASH_POOL is None:
        _HASH_POOL = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sha256")
    return _HASH_POOL


def _forget_hash_pool() -> None:
    global _HASH_POOL
    _HASH_POOL = None  # a forked child has the pool object but not its thread


os.register_at_fork(after_in_child=_forget_hash_pool)


class HashingWriter:
    """A write-only file wrapper that hashes what passes through, so a file is hashed as it is written, never read
    back for it. `tell`, `fileno` and `close` make it a stream torch.distributed.checkpoint can write into;
    `fileno` flushes first, so an fsync of it covers every byte written so far."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        size = memoryview(data).nbytes  # bytes, whatever the item size of a buffer handed in
        self.bytes += size
        if size < PARALLEL_HASH_BYTES:
            self.sha256.update(data)
            return self.f.write(data)
        # hashlib and file writes release the GIL on large buffers: hash in the pool's thread while this one writes.
        # Both finish before returning, since the caller may reuse `data` (torch hands a view of its own memory).
        hashed = _hash_pool().submit(self.sha256.update, data)
        try:
            return self.f.write(data)
        finally:
            hashed.result()

    def flush(self) -> None:
        self.f.flush()

    def tell(self) -> int:
        return self.f.tell()

    def fileno(self) -> int:
        self.f.flush()
        return self.f.fileno()

    def close(self) -> None:
        self.f.close()

    def record(self) -> dict:
        """{"sha256", "bytes"} of what was written: the record sidecars and manifests keep."""
        return {"sha256": self.sha256.hexdigest(), "bytes": self.bytes}
