"""NanGuard: a non-finite loss or gradient never reaches the optimizer.

Each optimizer step, before the update: if any micro-batch loss or the global gradient norm is NaN or ±Inf on any
rank, the update is dropped (`pl_module.step_guard`: lit_pretrain/optim/step_guard.py), counted, and listed. After
`max_consecutive` such steps in a row the run stops, `diverged` (resume/stop.py), with a message saying which
steps, what the parameters and the checkpoint hold, and what to do. A dropped update leaves parameters and optimizer
state as they were; but an update that was applied can itself make them non-finite (a finite gradient times an
overflowing learning rate), and only the losses after it show that. So at the stop the guard looks: finite
parameters are checkpointed at the stop (every update since they last were finite was dropped); others never are,
and `latest` stays at the newest checkpoint written (each one is checked finite as it is written).
A finite gradient whose norm overflows to Inf is treated the same as a non-finite one: clipping it would turn it
into zeros or NaN.
"""

import math
from typing import Dict, List, Optional

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lit_pretrain.errors import ConfigError
from lit_pretrain.resume.stop import parameters_finite, stop_diverged


class NanGuard(Callback):
    def __init__(self, max_consecutive: int = 5, check_gradients: bool = True):
        if max_consecutive < 1:
            raise ConfigError(f"callbacks.nan_guard.max_consecutive={max_consecutive}: expected a value >= 1")
        self.max_consecutive, self.check_gradients = max_consecutive, check_gradients
        self.consecutive = 0
        self.skipped_steps: List[int] = []
        self.stop_reason: Optional[str] = None
        self._bad: Optional[torch.Tensor] = None

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach())  # stays on the device: no sync per micro-batch
        self._bad = bad if self._bad is None else self._bad | bad

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        guard = pl_module.step_guard
        bad, self._bad = self._bad, None
        if bad is not None:
            guard.offer("loss_non_finite", lambda: bad)
        if self.check_gradients:
            # A NaN or Inf in any gradient makes the global norm non-finite, so one reduction covers them all; the
            # norm itself goes to the host (what the spike detector and the monitors read too), its test is there.
            guard.offer("grad_norm", lambda: guard.grad_norm(pl_module.parameters()))
        # The decision must be known before the update: the step's one host read (StepGuard.host), shared with the
        # spike detector's values.
        local = (bad is not None and guard.host("loss_non_finite") > 0) or \
            (self.check_gradients and not math.isfinite(guard.host("grad_norm")))
        nonfinite = trainer.strategy.reduce_boolean_decision(local, all=False)
        if not nonfinite:
            self.consecutive = 0
            return
        pl_module.step_guard.drop_update(pl_module.parameters(), optimizer, "non_finite")
        self.consecutive += 1
        step = trainer.global_step + 1  # numbered as metrics.csv numbers it: the steps completed with this one
        self.skipped_steps.append(step)
        if self.consecutive >= self.max_consecutive:
            self._stop(trainer, pl_module, step)

    def _stop(self, trainer, pl_module, step: int) -> None:
        first = step - self.consecutive + 1
        # Looked at once, at the stop: whether an applied update made the parameters non-finite before these steps.
        finite = parameters_finite(trainer, pl_module.parameters())
        if finite:
            holds = ("every one of their updates was dropped, so the parameters are finite, and the checkpoint "
                     f"written at this stop (step {step}) holds them")
            fix = "check the data of these steps, lower optim.lr_peak or raise schedule.warmup_steps"
        else:
            holds = (f"the parameters are not finite: an update applied before step {first} made them so (their "
                     "updates were dropped, that one was not), so no checkpoint is written at this stop")
            fix = "lower optim.lr_peak or raise schedule.warmup_steps"
        self.stop_reason = (
            f"nan_guard: {self.consecutive} optimizer steps in a row (steps {first}..{step}) had a non-finite loss "
            f"or gradient (callbacks.nan_guard.max_consecutive={self.max_consecutive}); {holds}. The run stops: "
            f"{fix}, or use bf16/fp32 precision if this ran in fp16"
        )
        stop_diverged(trainer, self.stop_reason, healthy_step=step if finite else None)
        rank_zero_warn(self.stop_reason)

    def summary(self) -> Dict:
        return {"steps_skipped": len(self.skipped_steps), "skipped_steps": list(self.skipped_steps),
                "stop_reason": self.stop_reason}

    def state_dict(self) -> Dict:
        return {"consecutive": self.consecutive, "skipped_steps": list(self.skipped_steps),
                "stop_reason": self.stop_reason}

    def load_state_dict(self, state: Dict) -> None:
        self.consecutive = int(state["consecutive"])
        self.skipped_steps = [int(s) for s in state["skipped_steps"]]
        self.stop_reason = state["stop_reason"]
