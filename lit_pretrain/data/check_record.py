"""Records of the checks of a pretokenized corpus file (data/pretokenized.py), so that a start after the first does
not read the whole corpus again.

The vocabulary scan reads every id of a file once (a sequential read of the corpus), and every rank of every node
runs it when its datamodule opens the corpus: a restart after a failure (run.max_restarts, a requeued job) read the
whole corpus again on every rank before its first step. A file that passed is recorded under data.check_cache_dir,
keyed by what identifies it and the check (resolved path, size, mtime, the cheap fingerprint of its first and last
MiB and boundary file, the tokenizer's sha256, its size and EOD id, the validation cut, document masking); a start
that finds the same key takes the recorded EOD counts instead of scanning. A file changed in place gets a new mtime
(and usually size or fingerprint), so a new key: it is scanned again. Only passes are recorded: a refused file is
refused again at every start. The trust is the same as the resume check's (data/pretokenized.py `fingerprint`): a
file rewritten with the same size, mtime and first and last MiB would not be rescanned.

Ranks of one node start together: the first to take the key's lock (flock) scans and records, the others wait on the
lock and read the record, so a node reads each file once. A cache folder that cannot be written (read-only home, a
full disk) costs only the record: the file is scanned as before and training goes on. The record is JSON data, read
back only when it names the same key fields and holds two non-negative counts.
"""

import fcntl
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

from lit_pretrain.atomic import atomic_open

RECORD_VERSION = 1
Counts = Tuple[int, int]


def cache_folder(setting: Optional[str]) -> Optional[Path]:
    """data.check_cache_dir: "auto" is $XDG_CACHE_HOME/lit-pretrain/corpus-checks (~/.cache when unset, the XDG base
    directory rule), a path is that folder, null keeps no record."""
    if setting is None:
        return None
    if setting == "auto":
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "lit-pretrain" / "corpus-checks"
    return Path(setting).expanduser()


def key_of(fields: Dict) -> str:
    return hashlib.sha256(json.dumps({"version": RECORD_VERSION, **fields}, sort_keys=True).encode()).hexdigest()


def read_record(path: Path, fields: Dict) -> Optional[Counts]:
    """The counts of the record at `path` when it names exactly `fields`; None for anything else (no file, another
    key's fields, a damaged or hand-edited file): the caller then scans."""
    try:
        record = json.loads(path.read_text())
        counts = record["eod_counts"]
        if record.get("version") == RECORD_VERSION and record.get("fields") == fields and len(counts) == 2 and all(
                type(c) is int and c >= 0 for c in counts):
            return counts[0], counts[1]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def checked(folder: Optional[Path], fields: Dict, scan: Callable[[], Counts]) -> Tuple[Counts, bool]:
    """(EOD counts before and from the cut, whether they came from a record) of the file `fields` describe: the
    record's under `folder` when one matches, else `scan()` (which raises for a file that fails), then recorded."""
    if folder is None:
        return scan(), False
    key = key_of(fields)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / f"{key}.lock", "a")
    except OSError:
        return scan(), False
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        path = folder / f"{key}.json"
        counts = read_record(path, fields)
        if counts is not None:
            return counts, True
        counts = scan()
        record = {"version": RECORD_VERSION, "fields": fields, "eod_counts": list(counts),
                  "checked_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            with atomic_open(path) as f:
                f.write(json.dumps(record, indent=1).encode())
        except OSError:
            pass  # no record this time: the next start scans again
        return counts, False
