"""DCP's FileSystemWriter with every file hashed as it is written, so a rank's share of a sharded checkpoint is read
once (from memory, by torch) and never read back from disk for its manifest records.

torch 2.13's FileSystemWriter opens each of its files through `self.fs.create_stream` (data files, and `.metadata`
under a temporary name it then renames through `self.fs.rename`), writes with `write`, asks `tell` for offsets and
fsyncs `fileno()` (filesystem.py `_write_files_from_queue`, `_FileSystemWriter.finish`). The stream here is
atomic.py's HashingWriter over a WriteBehind file with a large buffer: its write-back starts while it is
written, so DCP's fsync waits for the tail only; and HashingWriter's `fileno` flushes the buffer first, which DCP's
fsync of `.metadata`, right after pickling into the still-buffered file, needs to cover its last bytes.
"""

from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Generator

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from lit_pretrain.atomic import WRITE_BUFFER_BYTES, HashingWriter, WriteBehind


class _HashingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.records: Dict[str, Dict] = {}
        """{file name: {"sha256", "bytes"}} of every file written through this object, under its final name."""

    @contextmanager
    def create_stream(self, path, mode: str) -> Generator:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        with open(path, mode, buffering=WRITE_BUFFER_BYTES) as f:
            stream = HashingWriter(WriteBehind(f))
            yield stream
        self.records[path.name] = stream.record()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        record = self.records.pop(Path(path).name, None)
        if record is not None:
            self.records[Path(new_path).name] = record


class HashingFileSystemWriter(FileSystemWriter):
    """FileSystemWriter (one thread, fsync per file) that keeps `records`: the sha256 and size of each file it
    wrote, by name."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path, thread_count=1)
        self.fs = _HashingFileSystem()

    @property
    def records(self) -> Dict[str, Dict]:
        return self.fs.records
