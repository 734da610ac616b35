"""AtomicCheckpointIO: Lightning's CheckpointIO that writes checkpoints atomically with a sha256 sidecar and reads
them back only after the sidecar agrees, with `torch.load(weights_only=True)` (resume/verified.py).

Every strategy that saves through `strategy.checkpoint_io` (single, ddp, ZeRO-1, and the tensor/pipeline strategies)
gets atomic writes by passing this plugin to the Trainer, and every resume (`Trainer.fit(ckpt_path=...)`) reads
through `load_verified`.
"""

import re
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lit_pretrain.paths import safe_unlink
from lit_pretrain.resume.verified import load_verified, save_atomic, sidecar_path

CHECKPOINT_FILE = re.compile(r"[^/]+\.ckpt")
CHECKPOINT_SIDECAR = re.compile(r"[^/]+\.ckpt\.json")


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
        if Path(path).is_dir():  # a sharded folder into one process (strategies.ShardedLoad reads it in a layout)
            from lit_pretrain.resume.sharded.save import as_single_checkpoint

            return as_single_checkpoint(Path(path))
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
