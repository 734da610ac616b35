"""What the stability callbacks share within one optimizer step: the pre-clip gradient norm (computed once) and
whether the step's update was dropped, and why.

An update is dropped by setting every gradient to None after the backward pass and before the optimizer step:
torch optimizers (AdamW, SGD, ZeroRedundancyOptimizer's local optimizer; FSDP2's DTensor parameters alike) skip
parameters without a gradient, so neither the parameters nor the optimizer state (moments, step counts) change,
whatever the strategy shards. The optimizer step is still counted (global step, learning-rate schedule): a dropped
update spends its compute and its data, it only does not apply them.
"""

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class StepRecord:
    step: int
    grad_norm: Optional[torch.Tensor] = None
    dropped: Optional[str] = None


_ATTR = "_lit_pretrain_step_record"


def current(trainer) -> StepRecord:
    """The record of the optimizer step in progress (a fresh one when the step has moved on)."""
    record = getattr(trainer, _ATTR, None)
    if record is None or record.step != trainer.global_step:
        record = StepRecord(trainer.global_step)
        setattr(trainer, _ATTR, record)
    return record


def full_norm(grads) -> torch.Tensor:
    """Global L2 norm of a list of gradients; sharded DTensor gradients (FSDP2, tensor parallelism) are reduced to
    the norm of the whole gradient, as `torch.nn.utils.clip_grad_norm_` does."""
    norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True) if grads else torch.zeros(())
    if hasattr(norm, "full_tensor"):  # a DTensor with a partial placement: one all-reduce
        norm = norm.full_tensor()
    return norm


def grad_norm(trainer, pl_module) -> torch.Tensor:
    """Pre-clip global gradient norm of this step, as a tensor (no host sync). Valid in `on_before_optimizer_step`,
    which Lightning calls after the backward pass and before gradient clipping."""
    record = current(trainer)
    if record.grad_norm is None:
        parallel = getattr(pl_module, "parallel", None)  # tensor/pipeline/FSDP: over all shards and stages
        record.grad_norm = (parallel.grad_norm() if parallel is not None else
                            full_norm([p.grad for p in pl_module.parameters() if p.grad is not None])).detach()
    return record.grad_norm


def drop_update(trainer, pl_module, optimizer, reason: str) -> None:
    """Make this step's optimizer update a no-op (see the module docstring). Idempotent; the first reason stays."""
    record = current(trainer)
    grad_norm(trainer, pl_module)  # keep the pre-clip norm for the monitors before the gradients go
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
    for p in pl_module.parameters():
        p.grad = None
    record.dropped = record.dropped or reason


def dropped(trainer) -> Optional[str]:
    return current(trainer).dropped
