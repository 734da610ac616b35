"""GradientNormMonitor: the pre-clip global gradient norm, the clip rate, and optional per-layer norms.

The norm is the one clipping sees (Lightning calls `on_before_optimizer_step` after the backward pass and before
`configure_gradient_clipping`). It stays a tensor on the device between logging intervals: sums, maxima and clip
counts accumulate there, and the host reads them once per `log_every_n_steps` (no sync per step). Steps whose update
was dropped (non-finite, loss spike) are left out of the statistics: nothing was clipped or applied.
"""

import math
from typing import Dict, List, Optional, Tuple

import torch
from lightning.pytorch.callbacks import Callback

from lit_pretrain.optim.optimizers import full_norm

PHASES = ("warmup", "stable", "decay")


def lr_phase(step: int, kind: str, warmup_steps: int, max_steps: int, decay_fraction: float = 0.2) -> str:
    """Which part of the learning-rate schedule step `step` is in, with `schedule.lr_at`'s convention: steps below
    warmup_steps warm up; cosine and linear decay from the step after warmup; wsd holds lr_peak until its final
    decay_fraction of the run (decay starts after step last − round(decay_fraction · max_steps)); constant never
    decays."""
    if step < warmup_steps:
        return "warmup"
    if kind == "constant":
        return "stable"
    last = max_steps - 1
    start = max(warmup_steps - 1, last - round(decay_fraction * max_steps), 0) if kind == "wsd" \
        else max(warmup_steps - 1, 0)
    return "decay" if step > start and last > start else "stable"


def layer_of(name: str) -> str:
    """`model.blocks.3.attn.wq.weight` → `blocks.3`; anything outside the blocks keeps its module name."""
    parts = name.split(".")
    if parts and parts[0] == "model":
        parts = parts[1:]
    if len(parts) >= 2 and parts[0] == "blocks":
        return f"blocks.{parts[1]}"
    return parts[0] if parts else name


class GradientNormMonitor(Callback):
    def __init__(self, clip_norm: float = 0.0, log_every_n_steps: int = 10, per_layer_every_n_steps: int = 0,
                 schedule: Optional[Tuple[str, int, int, float]] = None):
        """clip_norm: optim.grad_clip_norm (0: no clipping, no clip rate). schedule: (kind, warmup_steps, max_steps,
        decay_fraction) for the clip rate by phase; None puts every step in `stable`."""
        self.clip_norm, self.log_every_n_steps = clip_norm, max(1, log_every_n_steps)
        self.per_layer_every_n_steps, self.schedule = per_layer_every_n_steps, schedule
        self.phases = {p: {"steps": 0, "clipped": 0, "norm_sum": 0.0} for p in PHASES}
        self.trend: List[List[float]] = []
        """[steps completed, mean pre-clip norm over the interval ending there], one entry per logging interval."""
        self._reset_interval()

    def _reset_interval(self) -> None:
        self._sum = self._max = None
        self._clipped: Dict[str, torch.Tensor] = {}
        self._norms: Dict[str, torch.Tensor] = {}
        self._count: Dict[str, int] = {}

    def phase(self, step: int) -> str:
        return lr_phase(step, *self.schedule) if self.schedule else "stable"

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Rows are tagged with the steps completed once this one is (lit_pretrain/runs/step_axis.py): the step numbered
        # `done`; the schedule's phase is that of the step's 0-based index, the one its learning rate comes from.
        index = trainer.global_step
        done = index + 1
        guard = pl_module.step_guard
        if guard.dropped:
            return
        if self.per_layer_every_n_steps and done % self.per_layer_every_n_steps == 0:
            self._log(trainer, {f"grad_norm/layer/{k}": v for k, v in self.layer_norms(pl_module).items()}, done)
        norm = guard.grad_norm(pl_module.parameters())
        phase = self.phase(index)
        self._sum = norm if self._sum is None else self._sum + norm
        self._max = norm if self._max is None else torch.maximum(self._max, norm)
        self._norms[phase] = norm if phase not in self._norms else self._norms[phase] + norm
        clipped = (norm > self.clip_norm).to(torch.int64) if self.clip_norm > 0 else torch.zeros((), dtype=torch.int64)
        self._clipped[phase] = clipped if phase not in self._clipped else self._clipped[phase] + clipped
        self._count[phase] = self._count.get(phase, 0) + 1
        if done % self.log_every_n_steps == 0:
            self._flush(trainer, done)

    def on_train_end(self, trainer, pl_module) -> None:
        self._flush(trainer, trainer.global_step)

    def _flush(self, trainer, step: int) -> None:
        n = sum(self._count.values())
        if not n:
            return
        # One host sync per logging interval: the interval's sums come back together.
        values = torch.stack([self._sum, self._max, *self._norms.values(), *self._clipped.values()]).double().cpu()
        mean, peak = values[0].item() / n, values[1].item()
        k = len(self._norms)
        for i, phase in enumerate(self._norms):
            self.phases[phase]["norm_sum"] += values[2 + i].item()
            self.phases[phase]["clipped"] += int(values[2 + k + i].item())
            self.phases[phase]["steps"] += self._count[phase]
        clipped = sum(int(values[2 + k + i].item()) for i in range(k))
        self.trend.append([step, mean])
        metrics = {"grad_norm/mean": mean, "grad_norm/max": peak}
        if self.clip_norm > 0:
            metrics["grad_norm/clip_rate"] = clipped / n
        self._log(trainer, metrics, step)
        self._reset_interval()

    @staticmethod
    def layer_norms(pl_module) -> Dict[str, float]:
        groups: Dict[str, list] = {}
        for name, p in pl_module.named_parameters():
            if p.grad is not None:
                groups.setdefault(layer_of(name), []).append(p.grad)
        norms = {k: full_norm(v) for k, v in groups.items()}
        host = torch.stack(list(norms.values())).double().cpu().tolist() if norms else []  # one sync
        return dict(zip(norms, host))

    @staticmethod
    def _log(trainer, metrics: Dict[str, float], step: int) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def summary(self) -> Dict:
        by_phase = {}
        for phase, s in self.phases.items():
            if s["steps"]:
                by_phase[phase] = {"steps": s["steps"], "mean_norm": s["norm_sum"] / s["steps"],
                                   "clip_rate": s["clipped"] / s["steps"] if self.clip_norm > 0 else None}
        return {"by_phase": by_phase, "trend": trend_summary(self.trend)}

    def state_dict(self) -> Dict:
        return {"phases": {p: dict(s) for p, s in self.phases.items()}, "trend": [list(t) for t in self.trend]}

    def load_state_dict(self, state: Dict) -> None:
        self.phases = {p: dict(s) for p, s in state["phases"].items()}
        self.trend = [list(t) for t in state["trend"]]


def trend_summary(trend: List[List[float]]) -> Dict:
    """First and last interval means and the least-squares slope of log(norm) per 1,000 steps over the second half
    of the run (the first half is dominated by warmup's fall of the norm)."""
    if not trend:
        return {"first": None, "last": None, "log_slope_per_1k_steps": None}
    half = [(s, v) for s, v in trend[len(trend) // 2:] if v > 0 and math.isfinite(v)]
    slope = None
    if len(half) >= 2:
        xs, ys = [s for s, _ in half], [math.log(v) for _, v in half]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else None
    return {"first": trend[0][1], "last": trend[-1][1], "log_slope_per_1k_steps": slope}
