"""The ladder's per-rung recipe as pure functions of the model size: learning rate, batch, AdamW beta2, warmup, and
the steps of each token budget with the step its cooldown branches from.

N in every rule is the non-embedding parameter count (OLMo-core's `model_ladder` sizes its rungs on it).
- Learning rate: lr·(N/N0)^exponent; OLMo-core's ladder uses 0.0047·(N/108M)^(-1/3)/2, i.e. exponent -1/3.
- Batch: sequences·(N/N0)^exponent sequences a step, rounded; OLMo-core: 160·(N/108M)^(2/3), exponent 2/3.
- AdamW beta2: 0.99 below 524,288 tokens a step, else 0.95 (OLMo-core's ladder; Porian et al. 2024, arXiv
  2406.19146 §4, find beta2 0.99-0.999 needed at small batches).
- Warmup: N tokens (OLMo-core's ladder; Porian et al. scale warmup with N), whole steps, at least one.
- Budgets (Hägele et al. 2024, arXiv 2405.18392 §4, "cooldowns branched from one run"): a model's budgets are
  integer multiples k·S0 of its smallest one's S0 steps; every budget is a WSD run with a final cooldown of
  cooldown_fraction = 1/m of its steps, S0 a multiple of m so each cooldown is whole steps. The budget of S steps
  leaves the constant rate after S·(1 - 1/m) steps: the largest budget's run passes every smaller budget's branch
  step (k·S0·(1 - 1/m), a multiple of S0·(1 - 1/m)) at a constant rate, so a checkpoint every S0·(1 - 1/m) steps
  of it gives every branch its start, and each branched budget is the standalone WSD run of its length exactly
  (optim/schedule.py's table test).
"""

import math
from typing import List, Tuple

BETA2_SMALL_BATCH, BETA2_LARGE_BATCH, BETA2_BATCH_TOKENS = 0.99, 0.95, 524_288


def scaled(value: float, n: float, n0: float, exponent: float) -> float:
    """value·(n/n0)^exponent."""
    return value * (n / n0) ** exponent


def sequences_per_step(n: float, sequences: float, n0: float, exponent: float) -> int:
    """The batch rule in whole sequences (at least 1)."""
    return max(1, round(scaled(sequences, n, n0, exponent)))


def beta2_for(tokens_per_step: int) -> float:
    return BETA2_SMALL_BATCH if tokens_per_step < BETA2_BATCH_TOKENS else BETA2_LARGE_BATCH


def warmup_steps_for(n: float, tokens_per_step: int, tokens_per_param: float = 1.0) -> int:
    """Whole steps of tokens_per_param·N warmup tokens (at least 1)."""
    return max(1, math.ceil(tokens_per_param * n / tokens_per_step))


def cooldown_parts(cooldown_fraction: float) -> int:
    """m with cooldown_fraction = 1/m (ValueError otherwise: a cooldown of whole steps at every budget needs it)."""
    m = round(1.0 / cooldown_fraction)
    if m < 2 or abs(m * cooldown_fraction - 1.0) > 1e-9:
        raise ValueError(f"cooldown_fraction={cooldown_fraction}: expected 1/m for an integer m >= 2 (0.1, 0.125, "
                         "0.2, 0.25, 0.5)")
    return m


def budget_steps(ratios: List[float], tokens_at_ratio_one: float, tokens_per_step: int,
                 cooldown_fraction: float) -> List[Tuple[int, int]]:
    """(steps, branch step) per budget, in the order given: S0 = the smallest ratio's steps rounded to a multiple of
    m (at least m), each budget k·S0 with k = ratio / smallest ratio an integer (ValueError otherwise), its branch
    step S·(1 - 1/m), where its cooldown starts."""
    m = cooldown_parts(cooldown_fraction)
    smallest = min(ratios)
    multiples = [r / smallest for r in ratios]
    if any(abs(k - round(k)) > 1e-9 for k in multiples):
        raise ValueError(f"tokens_per_param {ratios}: each budget must be an integer multiple of the smallest "
                         f"({smallest:g}) so that one run passes every budget's branch step")
    s0 = max(m, m * round(smallest * tokens_at_ratio_one / tokens_per_step / m))
    return [(round(k) * s0, round(k) * s0 - round(k) * s0 // m) for k in multiples]
