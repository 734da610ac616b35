"""Robust rolling statistics for loss-spike detection, as pure functions and a small stateful window.

The baseline is the median of the last `window` values and the spread is the median absolute deviation scaled by
1.4826, which makes it a consistent estimator of the standard deviation for normal data (1 / Φ⁻¹(3/4) = 1.4826;
Rousseeuw & Croux 1993, JASA 88(424), §1). Median and MAD ignore the few extreme values a mean and a standard
deviation would chase, so one spike does not raise the bar for the next. The score of a value is its distance above
the median in these robust standard deviations. OLMo-core's `SkipStepOptimizer` (allenai/OLMo-core,
`olmo_core/optim/skip_step_optimizer.py`) skips a step whose loss or gradient norm is more than a number of
(non-robust) standard deviations above a rolling mean.
"""

import math
from collections import deque
from typing import Dict, Iterable, List, Optional, Tuple

MAD_TO_STD = 1.4826
MIN_SAMPLES = 5
"""Fewer values than this give no usable spread: the detector only watches until the window holds this many."""


def median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of no values")
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def robust_std(values: Iterable[float]) -> float:
    """1.4826 × median absolute deviation from the median."""
    values = list(values)
    m = median(values)
    return MAD_TO_STD * median(abs(v - m) for v in values)


def spike_score(value: float, baseline: float, spread: float) -> float:
    """(value − baseline) / spread; a non-finite value scores +inf; a zero spread scores ±inf for any change.

    The spread gets a floor of 1e-12 × max(1, |baseline|) so that a window of identical values (MAD 0) still
    scores a rise as infinite, not as a division error."""
    if not math.isfinite(value):
        return math.inf
    floor = 1e-12 * max(1.0, abs(baseline))
    return (value - baseline) / max(spread, floor)


def is_spike(value: float, baseline: float, spread: float, sigmas: Optional[float], ratio: Optional[float]) -> bool:
    """Every criterion that is set must hold: score > sigmas, and value > ratio × baseline."""
    if sigmas is None and ratio is None:
        raise ValueError("set at least one of sigmas and ratio")
    if not math.isfinite(value):
        return True
    hit = True
    if sigmas is not None:
        hit = hit and spike_score(value, baseline, spread) > sigmas
    if ratio is not None:
        hit = hit and value > ratio * baseline
    return hit


class RollingWindow:
    """The last `size` accepted values of one signal (the step loss, or the gradient norm)."""

    def __init__(self, size: int):
        if size < MIN_SAMPLES:
            raise ValueError(f"a window of {size} values is too small for robust statistics (need >= {MIN_SAMPLES})")
        self.size = size
        self.values: deque = deque(maxlen=size)

    def ready(self) -> bool:
        return len(self.values) >= MIN_SAMPLES

    def stats(self) -> Tuple[float, float]:
        """(baseline, spread): median and 1.4826 × MAD of the window."""
        return median(self.values), robust_std(self.values)

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.values.append(float(value))

    def state_dict(self) -> Dict:
        return {"size": self.size, "values": list(self.values)}

    def load_state_dict(self, state: Dict) -> None:
        self.size = int(state["size"])
        self.values = deque((float(v) for v in state["values"]), maxlen=self.size)

    def copy_values(self) -> List[float]:
        return list(self.values)


class Verdict:
    """What the detector concluded about one step on this rank."""

    def __init__(self, hit=False, metric="loss", value=math.nan, baseline=math.nan, score=-math.inf,
                 loss_baseline=math.nan):
        self.hit, self.metric, self.value, self.baseline, self.score = hit, metric, value, baseline, score
        self.loss_baseline = loss_baseline
        """The loss window's median, the level a recovered loss returns to (whatever metric flagged the step)."""


class SpikeDetector:
    """Rolling windows of the step loss (and optionally the pre-clip gradient norm) and the spike rule.

    `check` decides without changing state; `commit` then records the step. Only values of steps that were not
    flagged (on any rank) enter the windows, so a spike never inflates the spread that judges the next one, and the
    windows of all ranks hold the same number of values.
    """

    def __init__(self, window: int, watch_steps: int, sigmas: Optional[float], ratio: Optional[float],
                 on_grad_norm: bool = False):
        if sigmas is None and ratio is None:
            raise ValueError("set at least one of threshold_sigmas and threshold_ratio")
        self.watch_steps, self.sigmas, self.ratio, self.on_grad_norm = watch_steps, sigmas, ratio, on_grad_norm
        self.losses, self.grad_norms = RollingWindow(window), RollingWindow(window)
        self.steps_seen = 0

    def active(self) -> bool:
        """Past the watch-only period with enough values for a spread."""
        return self.steps_seen >= self.watch_steps and self.losses.ready()

    def check(self, loss: float, grad_norm: Optional[float] = None) -> Verdict:
        if not self.active():
            return Verdict()
        baseline, spread = self.losses.stats()
        verdict = Verdict(is_spike(loss, baseline, spread, self.sigmas, self.ratio), "loss", loss, baseline,
                          spike_score(loss, baseline, spread), baseline)
        if self.on_grad_norm and grad_norm is not None and self.grad_norms.ready():
            g_base, g_spread = self.grad_norms.stats()
            g_hit = is_spike(grad_norm, g_base, g_spread, self.sigmas, self.ratio)
            g_score = spike_score(grad_norm, g_base, g_spread)
            if g_hit and (not verdict.hit or g_score > verdict.score):
                verdict = Verdict(True, "grad_norm", grad_norm, g_base, g_score, baseline)
        return verdict

    def commit(self, loss: float, grad_norm: Optional[float], accept: bool) -> None:
        self.steps_seen += 1
        if accept:
            self.losses.add(loss)
            if grad_norm is not None:
                self.grad_norms.add(grad_norm)

    def windows(self) -> Dict:
        return {"losses": self.losses.state_dict(), "grad_norms": self.grad_norms.state_dict()}

    def load_windows(self, state: Dict) -> None:
        self.losses.load_state_dict(state["losses"])
        self.grad_norms.load_state_dict(state["grad_norms"])

    def state_dict(self) -> Dict:
        return {**self.windows(), "steps_seen": self.steps_seen}

    def load_state_dict(self, state: Dict) -> None:
        self.load_windows(state)
        self.steps_seen = int(state["steps_seen"])
