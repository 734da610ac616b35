"""Checkpoint files with a sha256 sidecar: written atomically, opened only after the sidecar agrees.

The sidecar `<name>.ckpt.json` holds the checksum, the size and the run's `lit_pretrain` metadata (step, config,
tokenizer and manifest hashes) so that choosing and checking a checkpoint to resume from reads a few hundred bytes,
not the checkpoint. `load_verified` is the one way the project opens a checkpoint. This module does not import
Lightning, so reading a checkpoint into a plain GPT (lit_pretrain/resume/weights.py) stays quick to start.
"""

import contextlib
import errno
import json
import re
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from lit_pretrain.atomic import HashingWriter, atomic_open, atomic_write_bytes, file_sha256
from lit_pretrain.errors import DataError
from lit_pretrain.internals import write_records, zip_file_writer
from lit_pretrain.paths import safe_unlink

META_KEY = "lit_pretrain"  # our metadata inside a checkpoint (written by resume.checkpointing.StepCheckpoint)


def sidecar_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


def zip_writer(f):
    """torch.save's zip writer over the binary file `f`, without the CRC-32 of each entry: torch.load never checks it
    (a flipped byte in a torch.save file loads silently), and the sha256 sidecar or manifest checked before every
    load here covers every byte, so computing it would be a second checksum pass over the checkpoint for nothing
    (it took a third of torch.save's time here). Zip tools (`unzip -t`, zipfile.testzip) report its entries as
    bad CRCs. torch 2.13's own writer, as torch.save builds it (serialization._open_zipfile_writer_buffer)."""
    return zip_file_writer(f)


def torch_save(obj: Any, f) -> None:
    """torch.save(obj, f) (default pickle module and protocol) through `zip_writer`: a file torch.load reads back the
    same."""
    zip_file = zip_writer(f)
    try:
        write_records(obj, zip_file)
    except BaseException:
        # A write failed (a full disk): end the writer here, where its errors are Python exceptions. Left unended,
        # its destructor writes the end of the file into a closed file and aborts the process (std::terminate;
        # pytorch#87997 marks it ended even when ending fails, so it is tried once, here).
        with contextlib.suppress(Exception):
            zip_file.write_end_of_file()
        raise
    zip_file.write_end_of_file()


def save_atomic(checkpoint: Dict[str, Any], path: str | Path) -> Dict:
    """torch.save into a temporary file (`torch_save`), hashed on the way (one pass: the bytes are never read back,
    atomic.py); fsync; rename; then the sidecar, whose folder fsync makes both renames durable (one fsync per
    file, one for the folder). Returns the sidecar.

    The sidecar is renamed second: a crash between the two renames leaves a checkpoint without a sidecar, which the
    resolver treats as unverified and skips. A crash before the folder's fsync may keep either rename without the
    other; a sidecar whose checkpoint is missing (or is another file) fails `verify` as well, so no reader ever opens
    a checkpoint its sidecar does not describe.
    """
    path = Path(path)
    try:
        with atomic_open(path, sync_folder=False) as f:
            writer = HashingWriter(f)
            torch_save(checkpoint, writer)
        side = {"file": path.name, **writer.record(), "meta": checkpoint.get(META_KEY, {})}
        try:
            atomic_write_bytes(sidecar_path(path), (json.dumps(side, indent=1) + "\n").encode())
        except OSError:
            # Without its sidecar the file can never be verified, so never loaded: no such file is left behind.
            safe_unlink(path, path.parent, re.compile(re.escape(path.name)))
            raise
    except OSError as err:
        if err.errno in DISK_FULL:  # what the file needs, for the one-line report (checkpointing.disk_full_error)
            err.filename, err.needed_bytes = str(path), tensor_bytes(checkpoint)
        raise
    return side


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) checkpoint: what its file needs, less the pickled structure's few KiB."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def read_sidecar(path: str | Path) -> Optional[Dict]:
    try:
        return json.loads(sidecar_path(path).read_text())
    except (OSError, ValueError):
        return None


def _refuse(path: Path, reason: str, message: str) -> DataError:
    err = DataError(f"checkpoint {path} {message}")
    err.reason = reason  # a few words, for the resolver's line about a checkpoint it skipped
    return err


def verify(path: str | Path, check_sha256: bool = True) -> Dict:
    """The sidecar of a checkpoint whose size (and sha256) match it; otherwise a DataError naming the file."""
    path = Path(path)
    side_name = sidecar_path(path).name
    if not path.is_file():
        raise _refuse(path, "it does not exist", "does not exist: give the path of a run's checkpoints/*.ckpt, "
                      "or resume with run.resume=auto")
    if not sidecar_path(path).exists():
        # Copied without its sidecar, written by another program, or a crash between the file and its sidecar.
        raise _refuse(path, f"no checksum file {side_name}", f"has no checksum file {side_name} beside it: copy the "
                      f"{side_name} written with it into {path.parent} (every checkpoint is checked against its "
                      "sha256 before it is loaded), or choose another checkpoint")
    side = read_sidecar(path)
    if not isinstance(side, dict) or not isinstance(side.get("bytes"), int) or not isinstance(side.get("sha256"), str):
        raise _refuse(path, f"{side_name} is unreadable", f"has no readable checksum file {side_name}: it was not "
                      "written completely by this project; choose another checkpoint (run.resume=auto skips it)")
    size = path.stat().st_size
    if size != side["bytes"]:
        raise _refuse(path, f"{size} bytes, its sidecar says {side['bytes']}", f"is truncated or overwritten: "
                      f"{size} bytes, its checksum file says {side['bytes']}; choose another checkpoint "
                      "(run.resume=auto picks the newest valid one)")
    if check_sha256 and file_sha256(path) != side["sha256"]:
        raise _refuse(path, "sha256 differs from its sidecar", f"is corrupted: its sha256 differs from {side_name}; "
                      "choose another checkpoint (run.resume=auto picks the newest valid one)")
    return side


def load_verified(path: str | Path) -> Dict[str, Any]:
    """The one way this project opens a checkpoint: its size and sha256 checked against its sidecar first, then
    `torch.load(weights_only=True)` (tensors and plain containers only: no pickled code runs). load_gpt,
    load_optimizer_state, the resume (AtomicCheckpointIO) and the bench read through it;
    PretrainModule.load_from_checkpoint runs `verify` before Lightning's own weights-only load."""
    verify(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a file whose checksum matches but torch cannot read: say which one
        raise DataError(f"checkpoint {path} cannot be read as a weights-only checkpoint ({err})") from None
