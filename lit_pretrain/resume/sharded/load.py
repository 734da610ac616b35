"""Resuming a Lightning run from a sharded checkpoint folder (resume/sharded/save.py), under any strategy.

`ShardedLoad` goes first in a strategy's bases: a folder is verified (rank 0 hashes every file against the
manifest, the others wait for its answer), `trainer_state.pt` becomes the checkpoint dict Lightning restores loops,
callbacks and schedulers from, and the model and optimizer are read by DCP into this rank's share of the current
layout, whatever layout wrote them. A one-file checkpoint goes to the strategy's own load as before.

When: strategies that restore after setup (ModelParallelStrategy and ours built on it) have their optimizer by
`load_checkpoint`, so both are read there; DDP (and ZeRO-1) restores the model before setup and the optimizer after,
through the two hooks Lightning calls then. One process reads a folder through AtomicCheckpointIO
(`as_single_checkpoint`), as Lightning's single-device strategy reads any checkpoint.
"""

from pathlib import Path
from typing import Any, Dict, Optional

from lit_pretrain.errors import DataError
from lit_pretrain.resume.sharded import save as sharded


def verify_everywhere(strategy, folder: Path) -> None:
    """The folder's manifest and every file's sha256 checked once (rank 0), its verdict shared by every rank."""
    from lit_pretrain.resume.sharded.manifest import verify_sharded

    error = None
    if strategy.is_global_zero:
        try:
            verify_sharded(folder)
        except DataError as err:
            error = str(err)
    error = strategy.broadcast(error)
    if error:
        raise DataError(error)


class ShardedLoad:
    """Mixin for a Lightning strategy: load_checkpoint and the model/optimizer hooks accept a sharded folder."""

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if not path.is_dir():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        verify_everywhere(self, path)
        checkpoint = sharded.read_trainer_state(path)
        checkpoint[sharded.SHARDED_KEY] = str(path)
        checkpoint["state_dict"] = {}
        if self.restore_checkpoint_after_setup:
            self._load_sharded(checkpoint, model=True, optimizer=True)
        return checkpoint

    def _load_sharded(self, checkpoint: Dict[str, Any], model: bool, optimizer: bool) -> None:
        module = self.lightning_module
        # Sizes only here: rank 0 hashed every file in load_checkpoint (verify_everywhere).
        storage = sharded.reader(Path(checkpoint[sharded.SHARDED_KEY]), check_sha256=False)
        if model:
            sharded.load_model(storage, module.model, module.parallel)
        if optimizer and self.optimizers:
            sharded.load_optimizer(storage, module.model, module.parallel, self.optimizers[0], checkpoint)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if sharded.SHARDED_KEY not in checkpoint:
            return super().load_model_state_dict(checkpoint, strict=strict)
        if not self.restore_checkpoint_after_setup:
            self._load_sharded(checkpoint, model=True, optimizer=False)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if sharded.SHARDED_KEY not in checkpoint:
            return super().load_optimizer_state_dict(checkpoint)
        if not self.restore_checkpoint_after_setup:
            self._load_sharded(checkpoint, model=False, optimizer=True)
