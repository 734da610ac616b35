"""AtomicCheckpointIO: Lightning's CheckpointIO that writes checkpoints atomically with a sha256 sidecar and reads
them back only after the sidecar agrees, with `torch.load(weights_only=True)` (resume/verified.py).

Every strategy that saves through `strategy.checkpoint_io` (single, ddp, ZeRO-1, and the tensor/pipeline strategies)
gets atomic writes by passing this plugin to the Trainer, and every resume (`Trainer.fit(ckpt_path=...)`) reads
through `load_verified`.
"""

from pathlib import Path
from typing import Any, Dict, Optional

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lit_pretrain.resume.verified import load_verified, save_atomic, sidecar_path


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: Dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO takes no storage_options, got {storage_options!r}")
        save_atomic(checkpoint, path)

    def load_checkpoint(self, path, map_location: Optional[Any] = None, weights_only: Optional[bool] = None):
        return load_verified(path)

    def remove_checkpoint(self, path) -> None:
        Path(path).unlink(missing_ok=True)
        sidecar_path(path).unlink(missing_ok=True)
