"""Checkpoint files with a sha256 sidecar: written atomically, opened only after the sidecar agrees.

The sidecar `<name>.ckpt.json` holds the checksum, the size and the run's `lit_pretrain` metadata (step, config,
tokenizer and manifest hashes) so that choosing and checking a checkpoint to resume from reads a few hundred bytes,
not the checkpoint. `load_verified` is the one way the project opens a checkpoint. This module does not import
Lightning, so reading a checkpoint into a plain GPT (lit_pretrain/checkpoints.py) stays quick to start.
"""

import json
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from lit_pretrain.errors import DataError
from lit_pretrain.resume.atomic import HashingWriter, atomic_open, atomic_write_bytes, file_sha256

META_KEY = "lit_pretrain"  # our metadata inside a checkpoint (written by resume.checkpointing.StepCheckpoint)


def sidecar_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


def save_atomic(checkpoint: Dict[str, Any], path: str | Path) -> Dict:
    """torch.save into a temporary file, hashed on the way; rename; then write the sidecar. Returns the sidecar.

    The sidecar comes second: a crash between the two leaves a checkpoint without a sidecar, which the resolver
    treats as unverified and skips, never a sidecar describing a file that is not there.
    """
    path = Path(path)
    with atomic_open(path) as f:
        writer = HashingWriter(f)
        torch.save(checkpoint, writer)
    side = {"file": path.name, "sha256": writer.sha256.hexdigest(), "bytes": writer.bytes,
            "meta": checkpoint.get(META_KEY, {})}
    atomic_write_bytes(sidecar_path(path), (json.dumps(side, indent=1) + "\n").encode())
    return side


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
