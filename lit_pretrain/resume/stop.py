"""How a callback ends a run and says what the stop is (docs/resume.md, "Writing a callback").

`stop_run(trainer, reason, done=...)` sets `trainer.should_stop` (the run ends after the current optimizer step, at
a step boundary, with that step's checkpoint) and records what the stop is, so summary.json says it: `finished`
when the callback declares the run done (a target reached: the result is complete, `steps` may be short of
trainer.max_steps), `stopped` otherwise (ended early on purpose); `stop_reason` holds the reason either way. The
stability callbacks stop with `stop_diverged`, which also says which checkpoints hold healthy weights, so that the
weights of a diverged run never become `latest` (resume/checkpointing.py acts on it).

Like `trainer.should_stop`, the decision must be the same on every rank: agree it first with the strategy's
`reduce_boolean_decision`, then call this on every rank. The first request of a run counts (kept by the
StopRecorder among the Trainer's callbacks: StepCheckpoint); a bare
`trainer.should_stop = True` still stops the run, recorded `stopped` with a reason that says no callback gave one.
"""

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from lightning.pytorch.callbacks import Callback

from lit_pretrain.runs.state import DIVERGED, FINISHED, STOPPED


@dataclass
class StopRequest:
    outcome: str
    """finished, stopped or diverged (runs/state.py)."""
    reason: str
    healthy_step: Optional[int] = None
    """diverged only: the newest step whose state is known healthy. Checkpoints of later steps are set aside and
    `latest` names the newest one at or before it; the state at the stop is checkpointed only when it is that
    step. None: the state at the stop is not healthy, and the checkpoints already written stand (each passed the
    finite check when it was written)."""
    checkpoint_note: Optional[str] = None
    """diverged only, once the run has ended: which checkpoint run.resume=auto continues from (resume/checkpointing)."""

    def summary_reason(self) -> str:
        return self.reason if self.checkpoint_note is None else f"{self.reason}; {self.checkpoint_note}"


def stop_run(trainer, reason: str, done: bool = False) -> StopRequest:
    """End the run after the current optimizer step, recorded `finished` (done=True: the run has what it was for)
    or `stopped`, with `reason` (one line saying why, naming the callback's own setting where one decided it)."""
    return _request(trainer, StopRequest(FINISHED if done else STOPPED, reason))


def stop_diverged(trainer, reason: str, healthy_step: Optional[int]) -> StopRequest:
    """End the run as diverged (a stability callback: the loss did not come back, or values are not finite);
    `healthy_step`: see StopRequest.healthy_step."""
    return _request(trainer, StopRequest(DIVERGED, reason, healthy_step))


class StopRecorder(Callback):
    """A callback that keeps the run's stop request (`stop`, the first one counts) and acts on it at the end of
    training: resume/checkpointing.py StepCheckpoint, which train() reads it from."""

    stop: Optional[StopRequest] = None


def _request(trainer, request: StopRequest) -> StopRequest:
    trainer.should_stop = True
    for cb in trainer.callbacks:
        if isinstance(cb, StopRecorder) and cb.stop is None:
            cb.stop = request
    return request


def parameters_finite(trainer, parameters: Iterable[torch.Tensor]) -> bool:
    """Whether every parameter of every rank is finite: one pass over this rank's own (a DTensor's local shard), one
    host read, and one decision agreed by every rank (it decides what every rank does next)."""
    local = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in parameters]
    finite = bool(torch.stack(local).all()) if local else True
    return trainer.strategy.reduce_boolean_decision(finite, all=True)
