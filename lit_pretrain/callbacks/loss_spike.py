"""LossSpike: detect a loss spike, act on it (log, skip the update, rewind, stop), and label its outcome.

A loss spike is a sudden, sharp rise in the training loss; divergence is the outcome when it does not come back.
PaLM (Chowdhery et al. 2022, §5.1) restarted about 100 steps before each spike and skipped 200–500 batches; OLMo-core
skips updates far above a rolling mean. This callback does either, agrees on every decision across ranks through the
strategy, watches whether the loss comes back within `recovery_steps`, and writes every event to `spikes.json`.

Rewind keeps the optimizer step count moving forward: the model and optimizer state go back to a rewind point, the
data goes on from where it is and skips `skip_batches` more global batches, and the learning-rate schedule, which
follows the step count, is not rewound (so the run still ends at trainer.max_steps, at the schedule's final rate,
and no checkpoint name is ever reused).

A stop says what it is (resume/stop.py): one after a divergence (on_divergence=stop, or max_rewinds reached while
rewinding from one) is `diverged`, and the last healthy state is that of two steps before the event's (the loss of
step k is measured on the weights after k - 1 updates, so the state after k - 2 is the newest whose own loss was
normal): checkpoints after it are set aside and `latest` names the newest one at or before it. A stop on a spike
(action=stop, or max_rewinds on a spike) is `stopped`: the spike's own update is dropped, and the checkpoint of the
stop is written.

Steps in events and messages are numbered as metrics.csv numbers them (runs/step_axis.py): the optimizer step
whose loss spiked is step k when its row says k, i.e. trainer.global_step + 1 while it runs. `rewound_to` is the
steps completed at the rewind point (the state after that step).
"""

import math
from typing import Dict, List, Optional

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lit_pretrain.callbacks.records import gather_rows, json_safe, write_json
from lit_pretrain.callbacks.rewind import RewindPoints
from lit_pretrain.callbacks.spike_stats import SpikeDetector, Verdict
from lit_pretrain.errors import ConfigError
from lit_pretrain.resume.stop import stop_diverged, stop_run

ACTIONS = ("log", "skip_step", "rewind", "stop")
DIVERGENCE_ACTIONS = ("log", "rewind", "stop")
KEY = "callbacks.loss_spike"


class LossSpike(Callback):
    def __init__(self, window: int = 100, watch_steps: int = 100, threshold_sigmas: Optional[float] = 6.0,
                 threshold_ratio: Optional[float] = None, on_grad_norm: bool = False, action: str = "skip_step",
                 rewind_steps: int = 100, rewind_every_n_steps: int = 50, skip_batches: int = 200,
                 lr_scale: float = 1.0, lr_scale_steps: int = 0, recovery_steps: int = 50,
                 recovery_tolerance: float = 0.05, on_divergence: str = "stop", max_rewinds: int = 3,
                 filename: str = "spikes.json"):
        if action not in ACTIONS:
            raise ConfigError(f"{KEY}.action={action!r}: expected one of {ACTIONS}")
        if on_divergence not in DIVERGENCE_ACTIONS:
            raise ConfigError(f"{KEY}.on_divergence={on_divergence!r}: expected one of {DIVERGENCE_ACTIONS}")
        if threshold_sigmas is None and threshold_ratio is None:
            raise ConfigError(f"{KEY}: set threshold_sigmas, threshold_ratio or both (a spike must pass every one set)")
        for name, value, low in (("window", window, 5), ("rewind_every_n_steps", rewind_every_n_steps, 1),
                                 ("recovery_steps", recovery_steps, 1)):
            if value < low:
                raise ConfigError(f"{KEY}.{name}={value}: expected a value >= {low}")
        self.action, self.on_divergence = action, on_divergence
        self.rewind_steps, self.skip_batches, self.max_rewinds = rewind_steps, skip_batches, max_rewinds
        self.lr_scale, self.lr_scale_steps = lr_scale, lr_scale_steps
        self.recovery_steps, self.recovery_tolerance, self.filename = recovery_steps, recovery_tolerance, filename
        self.detector = SpikeDetector(window, watch_steps, threshold_sigmas, threshold_ratio, on_grad_norm)
        self.rewinds_enabled = "rewind" in (action, on_divergence)
        self.points = RewindPoints(rewind_every_n_steps, rewind_steps) if self.rewinds_enabled else None
        self.events: List[Dict] = []
        self.open_event: Optional[int] = None
        self.baseline_local = math.nan  # this rank's pre-spike loss level of the open event
        self.rewinds = 0
        self.lr_scale_until = -1
        self.stop_reason: Optional[str] = None
        self._loss_sum: Optional[torch.Tensor] = None
        self._micro_batches = 0
        self._indices: List[int] = []
        self._indices_step = -1

    # ---- Lightning hooks -------------------------------------------------------------------------------------

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.rewinds_enabled and self.skip_batches and not hasattr(self._datamodule(trainer), "skip_micro_batches"):
            raise ConfigError(f"{KEY}.skip_batches={self.skip_batches} needs a datamodule that can skip batches "
                              "(TokenShardDataModule): train through lit_pretrain.train, or set skip_batches=0")

    def on_train_start(self, trainer, pl_module) -> None:
        if self.points is not None:
            self.points.take(trainer.global_step, pl_module, trainer.optimizers, self.detector.windows())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._indices_step != trainer.global_step:
            self._indices, self._indices_step = [], trainer.global_step
        indices = getattr(self._datamodule(trainer), "batch_indices", None)
        if indices is not None:
            self._indices.extend(indices)

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        loss = loss.detach().float()  # Lightning passes the micro-batch loss divided by the accumulation count
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._micro_batches += 1
        if self._micro_batches == 1:
            # Offered once per step, computed at the step's one host read (after every micro-batch's backward), so
            # the non-finite guard's read brings the loss (and the norm the detector judges) over with its own.
            guard = pl_module.step_guard
            guard.offer("loss", lambda: self._loss_sum * (trainer.accumulate_grad_batches / self._micro_batches))
            if self.detector.on_grad_norm and (self.detector.active() or self.open_event is not None):
                guard.offer("grad_norm", lambda: guard.grad_norm(pl_module.parameters()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        step = trainer.global_step
        if step < self.lr_scale_until:
            for group in optimizer.param_groups:  # the schedule sets the rate afresh after every step
                group["lr"] *= self.lr_scale
        if self._loss_sum is None:
            return
        guard = pl_module.step_guard
        if guard.dropped:
            self._loss_sum, self._micro_batches = None, 0
            return  # dropped by the non-finite guard (an agreed decision): its loss is not evidence of a spike
        # The decision needs the values on the host: one sync per step (shared with the non-finite guard's) is
        # unavoidable for a per-step decision.
        loss = guard.host("loss")
        self._loss_sum, self._micro_batches = None, 0
        if not (self.detector.active() or self.open_event is not None):
            self.detector.commit(loss, None, accept=True)  # watching: the window needs every step's loss
            return
        grad = None
        if self.detector.on_grad_norm:
            guard.offer("grad_norm", lambda: guard.grad_norm(pl_module.parameters()))  # offered already, normally
            grad = guard.host("grad_norm")
        verdict = self.detector.check(loss, grad)
        hit = trainer.strategy.reduce_boolean_decision(verdict.hit, all=False)  # any rank flags → all act
        if self.open_event is not None:
            self._follow(trainer, pl_module, optimizer, step, loss, hit)
        elif hit:
            self._open(trainer, pl_module, optimizer, step, loss, verdict, self.action)
        self.detector.commit(loss, grad, accept=not hit and self.open_event is None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.points is not None and self.open_event is None and self.points.due(trainer.global_step):
            self.points.take(trainer.global_step, pl_module, trainer.optimizers, self.detector.windows())

    def on_train_end(self, trainer, pl_module) -> None:
        if self.open_event is not None:
            self.events[self.open_event]["outcome"] = "unresolved"  # the run ended inside the recovery window
            self.open_event = None
        self._write(trainer)

    # ---- events ----------------------------------------------------------------------------------------------

    def _open(self, trainer, pl_module, optimizer, step, loss, verdict, action, cause=None, origin=None) -> None:
        rows = gather_rows(trainer, [float(verdict.hit), loss, verdict.baseline, _finite(verdict.score),
                                 verdict.metric == "grad_norm"])
        flagged = [r for r, row in enumerate(rows) if row[0] > 0.5] or list(range(len(rows)))
        top = max(flagged, key=lambda r: rows[r][3])
        event = {"step": step + 1, "metric": "grad_norm" if rows[top][4] > 0.5 else "loss",
                 "loss": sum(row[1] for row in rows) / len(rows), "baseline": rows[top][2], "score": rows[top][3],
                 "ranks": flagged, "action": action, "outcome": None, "resolved_step": None,
                 "sample_indices": self._gather_indices(trainer), "steps_skipped": 0}
        if cause:
            event["cause"] = cause
        self.events.append(event)
        self.open_event = len(self.events) - 1
        if not math.isnan(verdict.loss_baseline):
            self.baseline_local = verdict.loss_baseline
        self._act(trainer, pl_module, optimizer, step, event, action, origin if origin is not None else step)
        self._write(trainer)

    def _follow(self, trainer, pl_module, optimizer, step, loss, hit) -> None:
        event = self.events[self.open_event]
        back = math.isfinite(loss) and loss <= self.baseline_local * (1 + self.recovery_tolerance)
        if trainer.strategy.reduce_boolean_decision(back, all=True):  # recovered on every rank
            self._close(trainer, event, "recovered", step)
        elif step + 1 - event["step"] >= self.recovery_steps:
            self._close(trainer, event, "divergence", step)
            self._diverged(trainer, pl_module, optimizer, step, loss, event)
        elif hit and event["action"] == "skip_step":
            pl_module.step_guard.drop_update(pl_module.parameters(), optimizer, "loss_spike")
            event["steps_skipped"] += 1

    def _close(self, trainer, event, outcome, step) -> None:
        event["outcome"], event["resolved_step"] = outcome, step + 1
        self.open_event = None
        self._write(trainer)

    def _diverged(self, trainer, pl_module, optimizer, step, loss, event) -> None:
        cause = f"divergence of the event at step {event['step']}"
        if self.on_divergence == "stop":
            self._stop(trainer, pl_module, optimizer, f"{cause}: the loss stayed above {event['baseline']:.4g} × "
                       f"(1 + {self.recovery_tolerance}) for {self.recovery_steps} steps",
                       healthy_step=event["step"] - 2)
        elif self.on_divergence == "rewind":
            self._open(trainer, pl_module, optimizer, step, loss,
                       Verdict(True, "loss", loss, event["baseline"], math.inf, self.baseline_local), "rewind",
                       cause=cause, origin=event["step"] - 1)

    def _act(self, trainer, pl_module, optimizer, step, event, action, origin) -> None:
        if action == "skip_step":
            pl_module.step_guard.drop_update(pl_module.parameters(), optimizer, "loss_spike")
            event["steps_skipped"] = 1
        elif action == "rewind":
            self._rewind(trainer, pl_module, optimizer, step, event, origin)
        elif action == "stop":
            self._stop(trainer, pl_module, optimizer,
                       f"a loss spike at step {step + 1} (callbacks.loss_spike.action=stop)")

    def _rewind(self, trainer, pl_module, optimizer, step, event, origin) -> None:
        if self.rewinds >= self.max_rewinds:
            event["action"] = "stop"
            # origin: the steps done before the spike that opened the event (a divergence's: its first spike's).
            self._stop(trainer, pl_module, optimizer, f"a loss spike at step {step + 1} after {self.rewinds} rewinds "
                       f"({KEY}.max_rewinds={self.max_rewinds})",
                       healthy_step=origin - 1 if "cause" in event else None)
            return
        pl_module.step_guard.drop_update(pl_module.parameters(), optimizer, "loss_spike")
        event["steps_skipped"] = 1
        point = self.points.target(origin)
        self.points.restore(point, pl_module, trainer.optimizers)
        self.detector.load_windows(point.extra)
        if self.detector.losses.ready():
            # Recovery is judged against the level of the state rewound to, which may sit above the pre-spike one.
            self.baseline_local = self.detector.losses.stats()[0]
        event["rewound_to"], event["steps_rewound"] = point.step, step - point.step
        datamodule = self._datamodule(trainer)
        micro_batches = self.skip_batches * trainer.accumulate_grad_batches
        event["skipped_batches"], event["skipped_data"] = self.skip_batches, []
        if micro_batches:
            before = len(datamodule.train_loader.dropped)
            datamodule.skip_micro_batches(micro_batches)
            event["skipped_data"] = [dict(d) for d in datamodule.train_loader.dropped[before:]]
        self.rewinds += 1
        if self.lr_scale < 1.0:
            self.lr_scale_until = step + 1 + self.lr_scale_steps

    def _stop(self, trainer, pl_module, optimizer, reason: str, healthy_step: Optional[int] = None) -> None:
        """Stop: `diverged` with the last healthy step when `healthy_step` is given, else `stopped`."""
        pl_module.step_guard.drop_update(pl_module.parameters(), optimizer, "loss_spike")
        self.stop_reason = f"loss_spike: the run stops after {reason}; events in {self.filename} of the run folder"
        if healthy_step is None:
            stop_run(trainer, self.stop_reason)
        else:
            stop_diverged(trainer, self.stop_reason, max(healthy_step, 0))
        rank_zero_warn(self.stop_reason)

    # ---- helpers ---------------------------------------------------------------------------------------------

    @staticmethod
    def _datamodule(trainer):
        return getattr(trainer, "datamodule", None)

    def _gather_indices(self, trainer) -> Optional[List[int]]:
        if self._datamodule(trainer) is None or not hasattr(self._datamodule(trainer), "batch_indices"):
            return None
        # Tensor- and pipeline-parallel ranks of one data-parallel rank read the same windows: each data-parallel
        # rank's windows are kept once (tagged with its data-parallel rank, the sampler's).
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        dp_rank = kwargs.get("rank", trainer.global_rank)
        local = torch.tensor([dp_rank, *self._indices], dtype=torch.int64, device=trainer.strategy.root_device)
        gathered = trainer.strategy.all_gather(local).reshape(-1, local.numel())
        by_dp_rank: Dict[int, List[int]] = {}
        for row in gathered.tolist():
            by_dp_rank.setdefault(row[0], row[1:])
        return sorted(i for rows in by_dp_rank.values() for i in rows)

    def _write(self, trainer) -> None:
        write_json(trainer, self.filename, self.events)

    def summary(self) -> Dict:
        outcomes = [e["outcome"] or "open" for e in self.events]
        return {"events": len(self.events), "by_outcome": {o: outcomes.count(o) for o in sorted(set(outcomes))},
                "steps_skipped": sum(e.get("steps_skipped", 0) for e in self.events),
                "steps_rewound": sum(e.get("steps_rewound", 0) for e in self.events),
                "batches_skipped": sum(e.get("skipped_batches", 0) for e in self.events),
                "rewinds": self.rewinds, "stop_reason": self.stop_reason}

    def state_dict(self) -> Dict:
        # Rewind points are not saved: a resumed run takes a fresh one at its first step.
        return {"detector": self.detector.state_dict(), "events": json_safe(self.events),
                "open_event": self.open_event, "baseline_local": self.baseline_local, "rewinds": self.rewinds,
                "lr_scale_until": self.lr_scale_until, "stop_reason": self.stop_reason}

    def load_state_dict(self, state: Dict) -> None:
        self.detector.load_state_dict(state["detector"])
        self.events = [dict(e) for e in state["events"]]
        self.open_event, self.baseline_local = state["open_event"], float(state["baseline_local"])
        self.rewinds, self.lr_scale_until = int(state["rewinds"]), int(state["lr_scale_until"])
        self.stop_reason = state["stop_reason"]


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 1e300
