"""StepGuard: what one optimizer step knows between its backward pass and its update, in one object the module owns
(`pl_module.step_guard`) and the stability callbacks read: the pre-clip global gradient norm (computed once), whether
the update was dropped and why, and the clipping itself.

An update is dropped by setting every gradient to None after the backward pass and before the optimizer step:
torch optimizers (AdamW, SGD, ZeroRedundancyOptimizer's local optimizer; FSDP2's DTensor parameters alike) skip
parameters without a gradient, so neither the parameters nor the optimizer state (moments, step counts) change,
whatever the strategy shards. The optimizer step is still counted (global step, learning-rate schedule): a dropped
update spends its compute and its data, it only does not apply them.

The decisions taken every step (the non-finite guard, the spike detector) need a few values on the host: each callback
`offer`s its value as a callable of the step, and the first `host` read evaluates every offer and brings them over in
one transfer, so the step pays one device sync for all of them, not one per callback.

The norm is whatever `norm_fn(parameters)` returns: the layout decides how the squares of sharded, replicated and
pipeline-staged gradients add up to the one-process norm (each parameter counted once), so the guard takes it from
outside rather than knowing any layout. Torch only: no Lightning, no process group of its own.
"""

from typing import Callable, Dict, Iterable, List, Optional

import torch

from lit_pretrain.optim.optimizers import clip_by_global_norm, grad_norm

NormFn = Callable[[List[torch.Tensor]], torch.Tensor]


class StepGuard:
    def __init__(self, norm_fn: NormFn = grad_norm):
        """norm_fn(parameters) -> the global L2 norm of their gradients, as a tensor; the default (optim.grad_norm)
        reduces DTensor shards to the whole gradient's norm."""
        self.norm_fn = norm_fn
        self.step: Optional[int] = None
        """The optimizer step (trainer.global_step) the record below belongs to."""
        self._norm: Optional[torch.Tensor] = None
        self._dropped: Optional[str] = None
        self._offers: Dict[str, Callable[[], torch.Tensor]] = {}
        self._host: Dict[str, float] = {}

    def begin(self, step: int) -> None:
        """Enter optimizer step `step`: a new step forgets the last one's norm, drop and host values; the same step
        keeps them (every micro-batch of an accumulated step calls this)."""
        if step != self.step:
            self.step, self._norm, self._dropped = step, None, None
            self._offers, self._host = {}, {}

    def offer(self, key: str, value: Callable[[], torch.Tensor]) -> None:
        """Add `value()`, a one-element tensor of this step, to the step's host read (see `host`); the first offer of
        a key in a step stands. It is called at that read, so it may use what the rest of the step computes before
        then (every micro-batch's loss, the gradients' norm)."""
        self._offers.setdefault(key, value)

    def host(self, key: str) -> float:
        """This step's value of `key` as a Python float (float32 and bool values exactly). The first call evaluates
        every offer not read yet and reads them in one transfer; a key offered later gets a read of its own."""
        if key not in self._offers:
            raise KeyError(f"{key!r} was not offered in optimizer step {self.step}")
        if key not in self._host:
            keys = [k for k in self._offers if k not in self._host]
            values = [self._offers[k]().detach().reshape(()) for k in keys]
            device = values[0].device
            # float64 holds every float32 and bool exactly: the host sees the values a .item() of each would give.
            host = torch.stack([v.to(device=device, dtype=torch.float64) for v in values]).tolist()  # the one sync
            self._host.update(zip(keys, host))
        return self._host[key]

    @property
    def dropped(self) -> Optional[str]:
        """Why this step's update was dropped ("non_finite", "loss_spike"), or None while it will be applied."""
        return self._dropped

    def grad_norm(self, parameters: Iterable[torch.Tensor]) -> torch.Tensor:
        """This step's pre-clip global gradient norm, as a detached tensor (no host sync). The first call computes
        it, after the backward pass and before clipping; later calls in the step return the same tensor, so the
        step pays one norm reduction however many readers there are."""
        if self._norm is None:
            self._norm = self.norm_fn(list(parameters)).detach()
        return self._norm

    def drop_update(self, parameters: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer, reason: str) -> None:
        """Make this step's optimizer update a no-op (see the module docstring). Idempotent; the first reason stays.
        The pre-clip norm is taken first, for the monitors, before the gradients go."""
        parameters = list(parameters)
        self.grad_norm(parameters)
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        for p in parameters:
            p.grad = None
        self._dropped = self._dropped or reason

    def clip(self, parameters: Iterable[torch.Tensor], max_norm: float) -> Optional[torch.Tensor]:
        """Clip by this step's global norm (one factor for every gradient, optim.clip_by_global_norm) and return the
        pre-clip norm; None when the update was dropped (there is nothing to clip, and a norm of 0 would read as a
        real, tiny gradient). max_norm <= 0 only measures."""
        if self._dropped is not None:
            return None
        parameters = list(parameters)
        return clip_by_global_norm(parameters, max_norm, self.grad_norm(parameters))
