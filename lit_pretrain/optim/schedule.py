"""Learning-rate schedules as pure functions of the optimizer step.

Step convention: `step` counts optimizer updates already applied, so the first update uses step 0 and the last of a
run of `max_steps` uses step `max_steps - 1`. Warmup is linear: step s < warmup_steps uses
lr_peak * (s + 1) / warmup_steps, so step 0 is not wasted on a zero rate and the last warmup step uses lr_peak.
Decay starts on the step after it and ends exactly at `lr_min` on the last step, `max_steps - 1`.

- cosine: half a cosine from lr_peak to lr_min (Loshchilov & Hutter 2017, SGDR, without restarts).
- linear: a straight line from lr_peak to lr_min.
- wsd: warmup-stable-decay; lr_peak until the final `decay_fraction` of the run, then to lr_min (Hu et al. 2024,
  MiniCPM §4): linear, or with decay_shape 1-sqrt as lr_min + (lr_peak - lr_min)·(1 - sqrt(progress)), the cooldown
  Hägele et al. 2024 (arXiv 2405.18392, §3, Fig. 4) find best. Up to the decay's first step a wsd run is the
  constant-rate run of the same warmup, whatever max_steps: a run of max_steps S continued from a longer wsd run's
  checkpoint at step S - round(decay_fraction·S) is that run exactly (the ladder's branched cooldowns).
- constant: lr_peak after warmup (lr_min unused).
"""

import math

KINDS = ("cosine", "linear", "wsd", "constant")
DECAY_SHAPES = ("linear", "1-sqrt")


def lr_at(step: int, *, kind: str, lr_peak: float, lr_min: float, warmup_steps: int, max_steps: int,
          decay_fraction: float = 0.2, decay_shape: str = "linear") -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if kind not in KINDS:
        raise ValueError(f"schedule.kind={kind!r}: expected one of {KINDS}")
    if decay_shape not in DECAY_SHAPES:
        raise ValueError(f"schedule.decay_shape={decay_shape!r}: expected one of {DECAY_SHAPES}")
    if warmup_steps > 0 and step < warmup_steps:
        return lr_peak * (step + 1) / warmup_steps
    if kind == "constant":
        return lr_peak
    last = max_steps - 1
    if kind == "wsd":
        decay_start = max(warmup_steps - 1, last - round(decay_fraction * max_steps), 0)
    else:
        decay_start = max(warmup_steps - 1, 0)
    if step <= decay_start or last <= decay_start:
        return lr_peak
    progress = min(1.0, (step - decay_start) / (last - decay_start))
    if kind == "cosine":
        return lr_min + 0.5 * (lr_peak - lr_min) * (1.0 + math.cos(math.pi * progress))
    if kind == "wsd" and decay_shape == "1-sqrt":
        return lr_min + (lr_peak - lr_min) * (1.0 - math.sqrt(progress))
    return lr_peak + (lr_min - lr_peak) * progress


def lr_lambda(cfg_schedule, lr_peak: float, max_steps: int):
    """A LambdaLR multiplier (relative to lr_peak) from a `schedule` config section."""

    def factor(step: int) -> float:
        return lr_at(step, kind=cfg_schedule.kind, lr_peak=lr_peak, lr_min=cfg_schedule.lr_min,
                     warmup_steps=cfg_schedule.warmup_steps, max_steps=max_steps,
                     decay_fraction=cfg_schedule.decay_fraction, decay_shape=cfg_schedule.decay_shape) / lr_peak

    return factor


STAGE_KINDS = ("linear", "cosine", "1-sqrt", "constant")


def decay_at(step: int, *, kind: str, from_step: int, rate_from: float, rate_to: float, last_step: int) -> float:
    """A decay from `rate_from`, the rate of step `from_step` (already trained), to `rate_to` at `last_step`, by the
    shapes above: linear, cosine (half a cosine, SGDR), 1-sqrt (Hägele et al. 2024), or constant (rate_from
    throughout). The step after `from_step` is the decay's first, as the decay of `lr_at` starts on the step after
    its peak. A stage's schedule (optim/stages.py)."""
    if kind not in STAGE_KINDS:
        raise ValueError(f"schedule.stage.kind={kind!r}: expected one of {STAGE_KINDS}")
    if kind == "constant" or step <= from_step:
        return rate_from
    progress = 1.0 if last_step <= from_step else min(1.0, (step - from_step) / (last_step - from_step))
    if kind == "cosine":
        return rate_to + 0.5 * (rate_from - rate_to) * (1.0 + math.cos(math.pi * progress))
    if kind == "1-sqrt":
        return rate_to + (rate_from - rate_to) * (1.0 - math.sqrt(progress))
    return rate_from + (rate_to - rate_from) * progress
