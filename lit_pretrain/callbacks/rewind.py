"""In-memory rewind points for the loss-spike callback: each rank's own module and optimizer state dicts.

Strategy-agnostic by holding only what each rank holds locally: `LightningModule.state_dict()` gives a DDP rank its
full replica and an FSDP2 rank its DTensor shards; a `ZeroRedundancyOptimizer` (ZeRO stage 1) contributes the state
of its local optimizer, not a consolidated copy (consolidating would be a collective on rank 0). Restoring copies
values into the live tensors, so the optimizer keeps referring to the same parameters.

Plain tensors are copied to host memory (a rewind point costs no accelerator memory); DTensors are cloned where they
live, because moving them would separate them from their device mesh. Each point costs the parameters plus the
optimizer state (3× the parameters for AdamW) on each rank.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from lit_pretrain.optim.optimizers import local_optimizer


def clone_tree(obj: Any, to_host: bool = True, reuse: Any = None) -> Any:
    """A deep copy of nested dicts/lists/tuples whose tensors share no storage with the originals.

    `reuse`: an earlier copy of the same structure that nothing references any more (a pruned rewind point); a
    plain tensor of it with the same shape and dtype, on the host, is overwritten in place instead of allocated
    anew, so a point taken every few steps does not map and fault in fresh memory for the whole state each time."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "full_tensor") or not to_host:  # DTensor: keep it on its mesh
            return obj.detach().clone()
        if isinstance(reuse, torch.Tensor) and not hasattr(reuse, "full_tensor") and reuse.device.type == "cpu" \
                and reuse.shape == obj.shape and reuse.dtype == obj.dtype:
            return reuse.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        reuse = reuse if isinstance(reuse, dict) else {}
        return {k: clone_tree(v, to_host, reuse.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        reuse = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        return type(obj)(clone_tree(v, to_host, r) for v, r in zip(obj, reuse))
    return obj


@dataclass
class RewindPoint:
    step: int
    """Optimizer updates applied when it was taken: the state step `step` trains from."""
    module: Dict[str, Any]
    optimizers: List[Dict[str, Any]]
    extra: Dict[str, Any] = field(default_factory=dict)
    """The owner's own state at that step (the detector's windows)."""


class RewindPoints:
    """Rewind points every `every_n_steps`, keeping just enough to reach `back_steps` before any later step."""

    def __init__(self, every_n_steps: int, back_steps: int):
        self.every_n_steps, self.back_steps = every_n_steps, back_steps
        self.points: List[RewindPoint] = []

    def due(self, step: int) -> bool:
        return (not self.points or self.points[-1].step < step) and step % self.every_n_steps == 0

    def take(self, step: int, pl_module, optimizers, extra: Optional[Dict] = None) -> None:
        # The points this one makes unneeded go first, and the newest of them is written over (clone_tree's reuse).
        spare = self.prune(step)
        spare = spare[-1] if spare else RewindPoint(step, {}, [])
        reused = spare.optimizers + [None] * (len(optimizers) - len(spare.optimizers))
        self.points.append(RewindPoint(step, clone_tree(pl_module.state_dict(), reuse=spare.module),
                                       [clone_tree(local_optimizer(o).state_dict(), reuse=r)
                                        for o, r in zip(optimizers, reused)],
                                       clone_tree(extra or {})))
        self.prune(step)

    def prune(self, step: int) -> List[RewindPoint]:
        """Keep the newest point at least back_steps before `step` and every newer one; return the others."""
        reach = [i for i, p in enumerate(self.points) if p.step <= step - self.back_steps]
        dropped = self.points[: reach[-1]] if reach else []
        del self.points[: len(dropped)]
        return dropped

    def target(self, spike_step: int) -> Optional[RewindPoint]:
        """The newest point at least back_steps before the spike; the oldest one if none reaches that far."""
        if not self.points:
            return None
        reach = [p for p in self.points if p.step <= spike_step - self.back_steps]
        return reach[-1] if reach else self.points[0]

    def restore(self, point: RewindPoint, pl_module, optimizers) -> None:
        pl_module.load_state_dict(point.module, strict=True)  # copies into the live parameters
        for optimizer, state in zip(optimizers, point.optimizers):
            # A fresh copy: load_state_dict keeps tensors that already have the right device and dtype, and the
            # next update would then write into the rewind point itself.
            local_optimizer(optimizer).load_state_dict(clone_tree(state, to_host=False))
        # Points taken after this one belong to the abandoned trajectory.
        self.points = [p for p in self.points if p.step <= point.step]
