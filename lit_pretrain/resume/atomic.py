"""Atomic file writes: a reader sees the old file or the new one, never a half-written one.

Write to a temporary name in the same folder (a rename is atomic only within one file system), fsync the file so
its bytes are on disk before the name points at them, rename over the target, then fsync the folder so the rename
itself survives a power loss (the ext4/XFS rule; see PostgreSQL's and SQLite's notes on durable renames).
"""

import hashlib
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from lit_pretrain.paths import safe_unlink

TMP_SUFFIX = ".tmp"
TMP_FILE = re.compile(r"\..+\.\d+\.tmp")  # temp_path's names: hidden, the writer's pid, .tmp


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
def atomic_open(path: str | Path) -> Iterator[BinaryIO]:
    """Yield a binary file; on a clean exit it replaces `path` atomically, on an error `path` is left untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        safe_unlink(tmp, path.parent, TMP_FILE)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path) as f:
        f.write(data)


def atomic_link(source: str | Path, target: str | Path) -> None:
    """Make `target` another name of `source` (a hard link: no copy), replacing `target` atomically."""
    source, target = Path(source), Path(target)
    tmp = temp_path(target)
    safe_unlink(tmp, target.parent, TMP_FILE)  # a stale one of this pid's, from a crash between link and replace
    os.link(source, tmp)
    os.replace(tmp, target)
    fsync_dir(target.parent)


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


class HashingWriter:
    """A write-only file wrapper that hashes what passes through, so a checkpoint is hashed without a re-read."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.bytes += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()
