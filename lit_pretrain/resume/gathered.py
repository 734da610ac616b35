"""The one-file checkpoint of the strategies built on Lightning's ModelParallelStrategy (plain ZeRO-2/3, and our mesh
for tensor, pipeline, context and expert parallelism and HSDP): written by rank 0 through `checkpoint_io` after the
whole state is gathered onto it by single-process name (parallel/mesh.py ParallelModel.full_state and
full_optimizer_state), the optimizer state keyed by name (optim/named_state.py); read by every rank into its share
of the current layout, by name, whichever layout or process count wrote the file (files numbered by position before
this format included: optim/named_state.py read_named).

Why not Lightning's own: it numbers the optimizer state of its file by `model.parameters()` and reads any file by
that numbering (FSDP.rekey_optim_state_dict), so a one-process file, numbered by position in the groups, put its
moments on the wrong tensors (or failed on their shapes).
"""

from pathlib import Path
from typing import Any, Dict, Optional

from lit_pretrain.optim.named_state import load_group_settings, read_named, single_process_names
from lit_pretrain.resume.verified import load_verified, sidecar_path

MODULE_PREFIX = "model."  # PretrainModule holds the GPT as `self.model`


class GatheredOneFile:
    """Mixin for a ModelParallelStrategy subclass, after ShardedLoad in its bases (a sharded folder goes there)."""

    def _names(self):
        module = self.lightning_module
        return single_process_names(module.model_cfg, module.optim_cfg)

    def lightning_module_state_dict(self) -> Dict[str, Any]:
        module = self.lightning_module
        full = module.parallel.full_state()  # a collective: every rank calls it; None except on rank 0
        if full is None:
            return {}
        rest = {k: v for k, v in module.state_dict().items() if not k.startswith(MODULE_PREFIX)}
        return {**{MODULE_PREFIX + k: v for k, v in full.items()}, **rest}

    def optimizer_state(self, optimizer) -> Dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        by_name = self.lightning_module.parallel.full_optimizer_state(optimizer)  # a collective, as above
        if by_name is None:
            return {}
        groups = self._names().groups
        unplaced = set(by_name) - {n for names in groups for n in names}
        assert not unplaced, f"optimizer state of {sorted(unplaced)} outside the model's groups"
        # The group list depends on the config alone (optim.param_groups), so rank 0's groups are every rank's.
        return {"state": {n: by_name[n] for names in groups for n in names if n in by_name},
                "param_groups": [{**{k: v for k, v in group.items() if k != "params"}, "params": list(names)}
                                 for names, group in zip(groups, optimizer.param_groups)]}

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        # Checked against its sha256 sidecar on every rank, then loaded weights-only, whatever the checkpoint_io; a
        # file without one (a plain Lightning Trainer writes none) as checkpoint_io reads it: a run's
        # AtomicCheckpointIO refuses it, Lightning's own loads it weights-only (as load_from_checkpoint does).
        checkpoint = load_verified(path) if sidecar_path(path).exists() else \
            self.checkpoint_io.load_checkpoint(path, weights_only=True)
        module = self.lightning_module
        module.parallel.load_full_state({k[len(MODULE_PREFIX):]: v for k, v in checkpoint["state_dict"].items()
                                         if k.startswith(MODULE_PREFIX)})
        states = checkpoint.get("optimizer_states") or []
        if states and self.optimizers:
            optimizer = getattr(self.optimizers[0], "_optimizer", self.optimizers[0])
            names = self._names()
            named = read_named(states[0], names, path)
            module.parallel.load_full_optimizer_state(optimizer, named["state"])
            load_group_settings(optimizer, named, names.groups, path)
        return checkpoint
