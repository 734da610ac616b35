"""The compute-optimal tokens per parameter of a ladder law in optimizer steps, L(N, S) = E + A/N^alpha + B/S^beta.

A law in steps has no closed-form optimum of its own: at compute C = 6·N·D a model of N parameters trains
S = D / T(N) steps, and T(N), the tokens a step, is the recipe's batch rule, which grows with N (OLMo-core's
160·(N/108M)^(2/3) sequences). So the optimum is the recipe's: the N that minimizes L(N, C / (6·N·T(N))) along the
grid's own family of model shapes, under its batch rule. Change the batch rule and the optimum moves (a law in
tokens, L(N, D), assumes the loss does not depend on the batch at all; Hoffmann et al. 2022 eq. 4 is its optimum).

Three parameter counts of one size enter: N_total for C (every parameter, as C = 6·N·D counts), the law's own N
(its convention: total, non-embedding, or non-embedding plus head) and the non-embedding N of the batch rule. They
come from the grid's sizes, interpolated in log-log between them (linearly extrapolated past the smallest and the
largest), so the search runs over a continuous family of shapes like the grid's. T(N) is the rule before its
rounding to whole sequences, so the optimum is a smooth function of C.

Pure functions; tests/scaling/test_steps_optimum.py checks them against the closed form of the same minimization where
the three counts agree and T = t0·N^gamma.
"""

import math
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

SEARCH_DECADES = 3.0  # search N_total from the smallest size / 10^3 to the largest × 10^3
SEARCH_POINTS = 3001  # points of the log grid (~400 a decade for a grid of 1.5 decades) before the refinement


def _interp_log(x: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """y(x) piecewise linear in (log x, log y) through (xs, ys), extended past both ends along the end segments."""
    lx, lxs, lys = np.log(x), np.log(xs), np.log(ys)
    if len(xs) == 1:
        return np.exp(lys[0] + (lx - lxs[0]))  # one size: the counts scale together
    out = np.interp(lx, lxs, lys)
    lo_slope = (lys[1] - lys[0]) / (lxs[1] - lxs[0])
    hi_slope = (lys[-1] - lys[-2]) / (lxs[-1] - lxs[-2])
    out = np.where(lx < lxs[0], lys[0] + lo_slope * (lx - lxs[0]), out)
    out = np.where(lx > lxs[-1], lys[-1] + hi_slope * (lx - lxs[-1]), out)
    return np.exp(out)


def size_family(sizes: Sequence[Tuple[float, float, float]]) -> Callable[[np.ndarray], Tuple[np.ndarray, np.ndarray]]:
    """From the grid's sizes as (N_total, N_law, N_non_embedding), a function N_total -> (N_law, N_non_embedding)
    along the same family of shapes (log-log interpolation; ValueError for fewer than one size or a count <= 0)."""
    rows = sorted({tuple(float(v) for v in s) for s in sizes})
    if not rows or any(v <= 0 for row in rows for v in row):
        raise ValueError(f"sizes {list(sizes)}: expected at least one (N_total, N_law, N_non_embedding), all > 0")
    total, law_n, non_embedding = (np.array(col) for col in zip(*rows))

    def along(n_total: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        return _interp_log(n_total, total, law_n), _interp_log(n_total, total, non_embedding)

    return along


def loss_along(law, flops: float, n_total: np.ndarray, family, tokens_per_step: Callable) -> np.ndarray:
    """L(N_law, S) at each N_total with D = C / (6·N_total) and S = D / T(N_non_embedding); inf where a term
    overflows."""
    n_law, n_ne = family(n_total)
    steps = flops / (6.0 * n_total) / tokens_per_step(n_ne)
    with np.errstate(all="ignore"):
        loss = law.E + law.A * n_law ** (-law.alpha) + law.B * steps ** (-law.beta)
    return np.where(np.isfinite(loss), loss, np.inf)


def optimal_tokens_per_param_in_steps(law, flops: float, sizes: Sequence[Tuple[float, float, float]],
                                      tokens_per_step: Callable) -> Optional[float]:
    """D_opt / N_opt (N every parameter, as in C = 6·N·D) at compute `flops` for a law in steps under the batch rule
    `tokens_per_step(N_non_embedding)`, along the family of `sizes` (size_family). None where the law has no
    interior optimum in the searched range (the grid's sizes 10^3 times either way): alpha or beta not positive,
    or the loss still falling at an end."""
    if not (law.alpha > 0 and law.beta > 0):
        return None
    from scipy.optimize import minimize_scalar

    family = size_family(sizes)
    lo = math.log(min(s[0] for s in sizes)) - SEARCH_DECADES * math.log(10)
    hi = math.log(max(s[0] for s in sizes)) + SEARCH_DECADES * math.log(10)
    grid = np.linspace(lo, hi, SEARCH_POINTS)
    losses = loss_along(law, flops, np.exp(grid), family, tokens_per_step)
    i = int(np.argmin(losses))
    if not math.isfinite(losses[i]) or i in (0, len(grid) - 1):
        return None
    # the log grid brackets the minimum within one step either side; refine it there
    found = minimize_scalar(lambda x: float(loss_along(law, flops, np.exp(np.array([x])), family,
                                                       tokens_per_step)[0]),
                            bounds=(grid[i - 1], grid[i + 1]), method="bounded", options={"xatol": 1e-10})
    n_opt = math.exp(found.x)
    return flops / 6.0 / n_opt / n_opt


def batch_rule_tokens(sequences: float, params: float, exponent: float, seq_len: int) -> Callable:
    """The ladder's batch rule in tokens a step before rounding: seq_len·sequences·(N/params)^exponent."""
    return lambda n: seq_len * sequences * (np.asarray(n, dtype=float) / params) ** exponent


def grid_sizes(rungs: List[dict], n_of: Callable[[dict], float]) -> List[Tuple[float, float, float]]:
    """(N_total, N_law, N_non_embedding) of each size a grid plans (rows of ladder_grid.plan_rungs; n_of gives a
    row's N under the law's convention)."""
    return sorted({(float(r["params"]), float(n_of(r)), float(r["non_embedding_params"])) for r in rungs})
