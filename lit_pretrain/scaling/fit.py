"""Fit L(N, D) = E + A/N^alpha + B/D^beta the way Hoffmann et al. 2022 did (approach 3, §3.3 and appendix D.2).

Minimize over θ = (a, b, e, alpha, beta), A = e^a, B = e^b, E = e^e, the sum over runs i of
    Huber_δ( LSE(a − alpha·log N_i, b − beta·log D_i, e) − log L_i ),  δ = 1e-3,
with L-BFGS from every point of their grid of starting points, keeping the best. The objective is tiny (~1e-3), so
it is scaled by 1/δ² before the optimizer sees it: Besiroglu et al. 2024 found Hoffmann et al.'s optimizer stopped
early for want of such a scale. The best start is then polished by scipy's L-BFGS-B to tight tolerances.
"""

import itertools
import math
from typing import Dict, List, Optional, Sequence

import numpy as np
from scipy.optimize import minimize

from lit_pretrain.errors import DataError
from lit_pretrain.planning.laws import ParametricLaw
from lit_pretrain.scaling.lbfgs import FunGrad, minimize_rows

HUBER_DELTA = 1e-3
LAW_COEFFICIENTS = 5  # E, A, B, alpha, beta
# Hoffmann et al. appendix D.2: alpha, beta in {0, 0.5, ..., 2}; e in {-1, -0.5, ..., 1}; a, b in {0, 5, ..., 25}.
CHINCHILLA_GRID = {
    "alpha": np.arange(0.0, 2.01, 0.5), "beta": np.arange(0.0, 2.01, 0.5), "e": np.arange(-1.0, 1.01, 0.5),
    "a": np.arange(0.0, 25.1, 5.0), "b": np.arange(0.0, 25.1, 5.0),
}
_LBFGS = {"ftol": 1e-15, "gtol": 1e-12, "maxiter": 5000, "maxcor": 20}
# The grid's runs stop a little earlier (scaled objective ~1e3): only the best is kept, and it is then polished.
_GRID = {"ftol": 1e-10, "gtol": 1e-6}


def huber(r: np.ndarray, delta: float) -> np.ndarray:
    small = np.abs(r) <= delta
    return np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta))


def objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, delta: float):
    """Sum of Huber losses of the log-loss residuals, and its gradient with respect to θ = (a, b, e, alpha, beta)."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])  # (3, runs)
    top = terms.max(axis=0)
    ex = np.exp(terms - top)
    total = ex.sum(axis=0)
    r = top + np.log(total) - log_l  # (runs,): LSE - log L
    w = ex / total  # d LSE / d term, (3, runs)
    g = np.clip(r, -delta, delta)  # Huber'(r)
    grad = np.array([g @ w[0], g @ w[1], g @ w[2], -(g * w[0]) @ log_n, -(g * w[1]) @ log_d])
    return float(huber(r, delta).sum()), grad


def grid_starts(grid: Dict[str, np.ndarray] = CHINCHILLA_GRID) -> np.ndarray:
    """Every starting θ = (a, b, e, alpha, beta) of the grid, (starts, 5)."""
    return np.array(list(itertools.product(grid["a"], grid["b"], grid["e"], grid["alpha"], grid["beta"])))


def _rows_objective(log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, delta: float) -> FunGrad:
    """`objective` for many θ rows at once, scaled by 1/δ² so that L-BFGS tolerances are meaningful.

    log_n, log_d, log_l: (1, runs) shared by every row, or (rows, runs) with each row's own resample.
    """
    scale = 1.0 / delta**2

    def fun_grad(theta: np.ndarray, rows: np.ndarray):
        ln, ld, ll = (v if v.shape[0] == 1 else v[rows] for v in (log_n, log_d, log_l))
        a, b, e, alpha, beta = (theta[:, i : i + 1] for i in range(5))  # each (k, 1)
        t0, t1 = a - alpha * ln, b - beta * ld  # (k, runs)
        t2 = np.broadcast_to(e, t0.shape)
        top = np.maximum(np.maximum(t0, t1), t2)
        e0, e1, e2 = np.exp(t0 - top), np.exp(t1 - top), np.exp(t2 - top)
        total = e0 + e1 + e2
        r = top + np.log(total) - ll
        w0, w1, w2 = e0 / total, e1 / total, e2 / total
        h = np.clip(r, -delta, delta)  # Huber'(r)
        f = huber(r, delta).sum(axis=1)
        grad = np.stack([(h * w0).sum(1), (h * w1).sum(1), (h * w2).sum(1), -(h * w0 * ln).sum(1),
                         -(h * w1 * ld).sum(1)], axis=1)
        return f * scale, grad * scale

    return fun_grad


def _polish(theta: np.ndarray, log_n, log_d, log_l, delta: float):
    """scipy's L-BFGS-B from the best row, to tight tolerances (the objective is scaled by 1/δ²)."""
    scale = 1.0 / delta**2

    def scaled(t):
        value, grad = objective(t, log_n, log_d, log_l, delta)
        return value * scale, grad * scale

    res = minimize(scaled, theta, jac=True, method="L-BFGS-B", options=_LBFGS)
    return (res.x, res.fun / scale) if res.fun / scale <= objective(theta, log_n, log_d, log_l, delta)[0] else (
        theta, objective(theta, log_n, log_d, log_l, delta)[0])


def fit_parametric(n: Sequence[float], d: Sequence[float], loss: Sequence[float], delta: float = HUBER_DELTA,
                   starts: Optional[np.ndarray] = None, name: str = "fitted") -> Dict:
    """Best L-BFGS fit over the starting points (default: Hoffmann et al.'s whole grid of 4,500).

    Returns the law's coefficients, the objective (sum of Huber losses), how many starts reached it and the
    exponents of the compute-optimal allocation (a = beta/(alpha+beta), b = alpha/(alpha+beta)).
    """
    log_n, log_d, log_l = (np.log(np.asarray(v, dtype=float))[None, :] for v in (n, d, loss))
    starts = grid_starts() if starts is None else np.atleast_2d(starts)
    x, f = minimize_rows(_rows_objective(log_n, log_d, log_l, delta), starts, **_GRID)
    f = np.where(np.isfinite(f), f, np.inf) * delta**2
    best = int(np.argmin(f))
    theta, value = _polish(x[best], log_n[0], log_d[0], log_l[0], delta)
    a, b, e, alpha, beta = theta
    if max(a, b, e) > 700:
        raise DataError(f"the fit to {log_n.shape[1]} runs ran off to A = e^{a:.0f}, B = e^{b:.0f}, E = e^{e:.0f}: "
                        "these runs do not pin down L(N, D) (e.g. loss does not fall with N or D); add runs that "
                        "span more sizes and token counts")
    law = ParametricLaw(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=float(alpha), beta=float(beta), name=name,
                        source=f"Huber (delta {delta:g}) fit of {log_n.shape[1]} runs, L-BFGS from {len(starts)} "
                               "starts")
    return {**law.to_dict(), "objective": float(value), "theta": [float(v) for v in theta], "starts": len(starts),
            # starts whose L-BFGS run ended within 1e-6 (relative) of the best objective: one basin or several
            "starts_at_best": int(np.sum(f <= f[best] * (1 + 1e-6))), "runs": int(log_n.shape[1]),
            "a": law.a, "b": law.b, "G": law.G}


BOOTSTRAP_METHODS = ("points", "residuals")


def log_law(theta: Sequence[float], log_n: np.ndarray, log_d: np.ndarray) -> np.ndarray:
    """log L(N, D) of θ = (a, b, e, alpha, beta): LSE(a − alpha·log N, b − beta·log D, e)."""
    a, b, e, alpha, beta = theta
    return np.logaddexp(np.logaddexp(a - alpha * log_n, b - beta * log_d), e)


def residual_draws(log_fit: np.ndarray, log_l: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """(resamples, runs) log losses of a fixed-design residual bootstrap: the fitted log loss of every run plus a
    residual drawn with replacement from the fit's log residuals, centred and scaled by sqrt(runs / (runs − 5))."""
    residuals = log_l - log_fit
    spread = residuals - residuals.mean()
    runs = len(log_l)
    if runs > LAW_COEFFICIENTS:
        spread = spread * math.sqrt(runs / (runs - LAW_COEFFICIENTS))
    return log_fit[None, :] + spread[rng.integers(0, runs, (resamples, runs))]


def refit_rows(log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray, starts: np.ndarray,
               delta: float = HUBER_DELTA) -> np.ndarray:
    """θ (rows, 5) fitted to each row of log_l (rows, runs) from every start, the best start's kept. log_n, log_d:
    (1, runs) shared by every row or (rows, runs); starts (k, 5) shared, or (rows, k, 5) a row's own."""
    rows, runs = log_l.shape
    starts = np.broadcast_to(starts, (rows,) + np.shape(starts)[-2:])
    k = starts.shape[1]
    sn, sd = (v if v.shape[0] == 1 else np.repeat(v, k, axis=0) for v in (log_n, log_d))
    x, f = minimize_rows(_rows_objective(sn, sd, np.repeat(log_l, k, axis=0), delta), starts.reshape(-1, 5),
                         **_GRID)
    f = np.where(np.isfinite(f), f, np.inf).reshape(rows, k)
    return x.reshape(rows, k, 5)[np.arange(rows), np.argmin(f, axis=1)]


def bootstrap(n, d, loss, best: Dict, resamples: int, seed: int = 0, delta: float = HUBER_DELTA,
              extra_starts: int = 8, loss_noise: float = 0.0, method: str = "points",
              noise_scale: Optional[Sequence[float]] = None) -> Dict:
    """Refit on `resamples` resampled data sets; percentile intervals and standard errors of the coefficients.

    method "points": each resample draws the runs with replacement (a case bootstrap): with few points a resample
    often holds one or two model sizes only, and its refit is then unconstrained in N.
    method "residuals" (a fixed-design residual bootstrap, Efron & Tibshirani 1993 §9.5): every resample keeps every
    run's (N, D), and its log loss is the full-data fit's log loss there plus a residual drawn with replacement from
    the fit's log residuals, centred and scaled by sqrt(runs / (runs - 5)) (the 5 fitted coefficients shrink
    residuals below the noise; Davison & Hinkley 1997 §6.2.3), so no size is ever dropped from a refit.
    loss_noise: each resampled log loss also gets Normal(0, loss_noise · noise_scale[i]) drawn afresh per run and
    resample: a measured seed-to-seed spread of the loss (relative standard deviation) enters the intervals;
    noise_scale (default 1 each) is e.g. 1/sqrt(seeds) for a point that is the mean of several seeds. Under
    "residuals" this counts the seed noise a second time beside the residuals (which hold it too): the intervals
    err on the wide side.

    Each resample starts from the full-data optimum and from the `extra_starts` grid points with the lowest
    objective on the full data (the whole grid for every resample would cost resamples × 4,500 L-BFGS runs).
    """
    if method not in BOOTSTRAP_METHODS:
        raise ValueError(f"bootstrap method {method!r}: expected one of {BOOTSTRAP_METHODS}")
    rng = np.random.default_rng(seed)
    log_n, log_d, log_l = (np.log(np.asarray(v, dtype=float)) for v in (n, d, loss))
    runs = len(log_n)
    grid = grid_starts()
    initial, _ = _rows_objective(log_n[None], log_d[None], log_l[None], delta)(grid, np.arange(len(grid)))
    starts = np.vstack([best["theta"], grid[np.argsort(initial)[:extra_starts]]])  # (k, 5)
    if method == "points":
        idx = rng.integers(0, runs, (resamples, runs))
        sn, sd, sl = log_n[idx], log_d[idx], log_l[idx]
        scale = np.ones(runs)[idx] if noise_scale is None else np.asarray(noise_scale, dtype=float)[idx]
    else:
        sn, sd = log_n[None], log_d[None]
        sl = residual_draws(log_law(best["theta"], log_n, log_d), log_l, resamples, rng)
        scale = np.ones((1, runs)) if noise_scale is None else np.asarray(noise_scale, dtype=float)[None]
    if loss_noise > 0:
        sl = sl + rng.normal(0.0, loss_noise, (resamples, runs)) * scale
    chosen = refit_rows(sn, sd, sl, starts, delta)
    samples = []
    for a, b, e, alpha, beta in chosen:
        if max(a, b, e) > 700 or not np.isfinite([a, b, e, alpha, beta]).all():
            continue  # a degenerate resample (a coefficient beyond float range): counted in `degenerate`
        law = ParametricLaw(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=float(alpha), beta=float(beta))
        samples.append({"E": law.E, "A": law.A, "B": law.B, "alpha": law.alpha, "beta": law.beta, "a": law.a,
                        "b": law.b})
    summary = {}
    for key in ("E", "A", "B", "alpha", "beta", "a", "b") if len(samples) > 1 else ():
        values = np.array([s[key] for s in samples])
        with np.errstate(over="ignore"):
            spread = float(values.std(ddof=1)) if np.isfinite(values).all() else math.inf
        # a resample that sends A or B to ~1e300 makes the standard error meaningless: null, use the interval
        summary[key] = {"standard_error": spread if math.isfinite(spread) and spread < 1e100 else None,
                        "interval_90": [float(np.percentile(values, 5)), float(np.percentile(values, 95))]}
    return {"resamples": resamples, "degenerate": resamples - len(samples), "seed": seed, "method": method,
            "coefficients": summary, "samples": samples}


def isoflop_groups(c: Sequence[float], rel_tol: float = 0.1) -> List[List[int]]:
    """Indices of runs grouped by compute: sorted by C, a new group starts where C grows by more than rel_tol."""
    order = np.argsort(c)
    groups: List[List[int]] = []
    for i in order:
        if groups and c[i] <= c[groups[-1][0]] * (1 + rel_tol):
            groups[-1].append(int(i))
        else:
            groups.append([int(i)])
    return groups


def frontier(n, d, c, loss, rel_tol: float = 0.1) -> Dict:
    """Power laws of the compute frontier: L(C) = L_c·C^-gamma, N_opt(C) = k_N·C^a_N, D_opt(C) = k_D·C^a_D.

    Where at least two isoFLOP groups hold runs of 3 or more sizes, each group's minimum is the vertex of a parabola
    fitted to loss against log N (Hoffmann et al. approach 2, §3.2), with D_opt = C / (6·N_opt). Otherwise the
    frontier is the runs that reach a lower loss than every run of less compute (the lower envelope, Kaplan et al.
    2020 §6). Each power law is a least-squares line in log-log space.
    """
    n, d, c, loss = (np.asarray(v, dtype=float) for v in (n, d, c, loss))
    rows = []
    for group in isoflop_groups(c, rel_tol):
        if len({round(x) for x in n[group]}) < 3:
            continue
        x, y = np.log(n[group]), loss[group]
        k2, k1, k0 = np.polyfit(x, y, 2)
        if k2 <= 0:
            continue  # no minimum: the group does not bracket its compute-optimal size
        x_opt = -k1 / (2 * k2)
        c_group = float(np.exp(np.mean(np.log(c[group]))))
        n_opt = float(np.exp(x_opt))
        rows.append({"C": c_group, "N_opt": n_opt, "D_opt": c_group / (6 * n_opt),
                     "loss": float(k0 + k1 * x_opt + k2 * x_opt**2), "runs": len(group),
                     "bracketed": bool(x.min() <= x_opt <= x.max())})
    method = "isoflop parabolas (approach 2)"
    if len(rows) < 2:
        method, rows, best = "lower envelope", [], math.inf
        for i in np.argsort(c):
            if loss[i] < best:
                best = loss[i]
                rows.append({"C": float(c[i]), "N_opt": float(n[i]), "D_opt": float(d[i]), "loss": float(loss[i])})
    result = {"method": method, "points": rows}
    if len(rows) >= 2:
        log_c = np.log([r["C"] for r in rows])
        for key, label in (("loss", "L"), ("N_opt", "N_opt"), ("D_opt", "D_opt")):
            slope, intercept = np.polyfit(log_c, np.log([r[key] for r in rows]), 1)
            result[label] = {"coefficient": float(np.exp(intercept)), "exponent": float(slope)}
    return result
