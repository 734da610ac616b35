"""AtomicCheckpointIO: Lightning's CheckpointIO that writes checkpoints atomically with a sha256 sidecar and reads
them back only after the sidecar agrees, with `torch.load(weights_only=True)`.

Every strategy that saves through `strategy.checkpoint_io` (single, ddp, ZeRO-1, and the tensor/pipeline strategies)
gets atomic writes by passing this plugin to the Trainer. The sidecar `<name>.ckpt.json` holds the checksum, the
size and the run's `lit_pretrain` metadata (step, config, tokenizer and manifest hashes) so that choosing and
checking a checkpoint to resume from reads a few hundred bytes, not the checkpoint.
"""

import json
import re
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lit_pretrain.errors import DataError
from lit_pretrain.paths import safe_unlink
from lit_pretrain.resume.atomic import HashingWriter, atomic_open, atomic_write_bytes, file_sha256

META_KEY = "lit_pretrain"  # our metadata inside a checkpoint (written by resume.checkpointing.StepCheckpoint)
CHECKPOINT_FILE = re.compile(r"[^/]+\.ckpt")
CHECKPOINT_SIDECAR = re.compile(r"[^/]+\.ckpt\.json")


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


def verify(path: str | Path, check_sha256: bool = True) -> Dict:
    """The sidecar of a checkpoint whose size (and sha256) match it; otherwise a DataError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"checkpoint {path} does not exist: check run.resume, or use run.resume=auto")
    side = read_sidecar(path)
    if not isinstance(side, dict) or not isinstance(side.get("bytes"), int) or not isinstance(side.get("sha256"), str):
        raise DataError(f"checkpoint {path} has no readable checksum file {sidecar_path(path).name}: it was not "
                        "written completely by this project; choose another checkpoint (run.resume=auto skips it)")
    size = path.stat().st_size
    if size != side["bytes"]:
        raise DataError(f"checkpoint {path} is truncated or overwritten: {size} bytes, its checksum file says "
                        f"{side['bytes']}; choose another checkpoint (run.resume=auto picks the newest valid one)")
    if check_sha256 and file_sha256(path) != side["sha256"]:
        raise DataError(f"checkpoint {path} is corrupted: its sha256 differs from {sidecar_path(path).name}; choose "
                        "another checkpoint (run.resume=auto picks the newest valid one)")
    return side


def load_verified(path: str | Path) -> Dict[str, Any]:
    verify(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a file whose checksum matches but torch cannot read: say which one
        raise DataError(f"checkpoint {path} cannot be read as a weights-only checkpoint ({err})") from None


class AtomicCheckpointIO(TorchCheckpointIO):
    def __init__(self, root: Optional[str | Path] = None):
        super().__init__()
        self.root = root
        """The run folder: remove_checkpoint deletes only inside it (None: only beside the file, by name)."""

    def save_checkpoint(self, checkpoint: Dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        save_atomic(checkpoint, path)

    def load_checkpoint(self, path, map_location: Optional[Any] = None, weights_only: Optional[bool] = None):
        return load_verified(path)

    def remove_checkpoint(self, path) -> None:
        # Lightning's ModelCheckpoint (a user's, with save_top_k) calls this: a `.ckpt` file and its sidecar, inside
        # the run folder only. Anything else is kept with a warning rather than stopping the run.
        root = self.root if self.root is not None else Path(path).parent
        if not safe_unlink(path, root, CHECKPOINT_FILE):
            warnings.warn(f"kept {path}: lit-pretrain deletes only *.ckpt files inside the run folder {root}",
                          stacklevel=2)
            return
        safe_unlink(sidecar_path(path), root, CHECKPOINT_SIDECAR)
