"""L-BFGS run on many independent small problems at once (numpy), one row of θ per problem.

Hoffmann et al. 2022 run L-BFGS from each of 4,500 starting points; scipy's L-BFGS-B, one start at a time, costs
0.05-0.4 s a start here (Python overhead per evaluation dominates on 240 runs), so the grid would take minutes.
This is the same algorithm (Nocedal & Wright 2006, Algorithm 7.4 two-loop recursion, Armijo backtracking) with
every start's iterate, history and step length kept as a row, so one evaluation serves all starts.
"""

from typing import Callable, Tuple

import numpy as np

FunGrad = Callable[[np.ndarray, np.ndarray], Tuple[np.ndarray, np.ndarray]]


def minimize_rows(fun_grad: FunGrad, x0: np.ndarray, memory: int = 10, max_iter: int = 1000, gtol: float = 1e-9,
                  ftol: float = 1e-14, armijo: float = 1e-4, max_backtracks: int = 40) -> Tuple[np.ndarray, np.ndarray]:
    """Minimize each row's objective from x0 (problems, dim). fun_grad(x, rows) -> (f (len(rows),),
    grad (len(rows), dim)) for the given row indices. Returns (x, f) per row.

    A row stops when its largest gradient component is below gtol or an accepted step lowers f by less than
    ftol·max(1, |f|).
    """
    x = np.array(x0, dtype=float)
    rows_all = np.arange(len(x))
    f, g = fun_grad(x, rows_all)
    s_hist = np.zeros((len(x), memory, x.shape[1]))
    y_hist = np.zeros_like(s_hist)
    rho = np.zeros((len(x), memory))
    active = np.isfinite(f) & (np.abs(g).max(axis=1) > gtol)
    for _ in range(max_iter):
        rows = np.flatnonzero(active)
        if rows.size == 0:
            break
        p = -_two_loop(g[rows], s_hist[rows], y_hist[rows], rho[rows])
        descent = np.einsum("ij,ij->i", p, g[rows])
        bad = ~(descent < 0)
        p[bad], descent[bad] = -g[rows][bad], -np.einsum("ij,ij->i", g[rows][bad], g[rows][bad])
        step = np.ones(rows.size)
        new_x, new_f, new_g = x[rows].copy(), f[rows].copy(), g[rows].copy()
        pending = np.ones(rows.size, dtype=bool)
        for _ in range(max_backtracks):
            idx = np.flatnonzero(pending)
            if idx.size == 0:
                break
            trial = x[rows[idx]] + step[idx, None] * p[idx]
            tf, tg = fun_grad(trial, rows[idx])
            ok = np.isfinite(tf) & (tf <= f[rows[idx]] + armijo * step[idx] * descent[idx])
            new_x[idx[ok]], new_f[idx[ok]], new_g[idx[ok]] = trial[ok], tf[ok], tg[ok]
            pending[idx[ok]] = False
            step[idx[~ok]] *= 0.5
        moved = ~pending
        s, y = new_x - x[rows], new_g - g[rows]
        sy = np.einsum("ij,ij->i", s, y)
        keep = moved & (sy > 1e-12 * np.maximum(1.0, np.einsum("ij,ij->i", y, y)))
        # newest pair last; a row whose pair lacks curvature keeps its history unchanged
        k = rows[keep]
        s_hist[k] = np.roll(s_hist[k], -1, axis=1)
        y_hist[k] = np.roll(y_hist[k], -1, axis=1)
        rho[k] = np.roll(rho[k], -1, axis=1)
        s_hist[k, -1], y_hist[k, -1], rho[k, -1] = s[keep], y[keep], 1.0 / sy[keep]
        decrease = f[rows] - new_f
        x[rows], f[rows], g[rows] = new_x, new_f, new_g
        done = ~moved | (decrease <= ftol * np.maximum(1.0, np.abs(new_f))) | (np.abs(new_g).max(axis=1) <= gtol)
        active[rows[done]] = False
    return x, f


def _two_loop(g: np.ndarray, s: np.ndarray, y: np.ndarray, rho: np.ndarray) -> np.ndarray:
    """H·g for each row by the L-BFGS two-loop recursion; empty history slots (rho = 0) are no-ops."""
    q = g.copy()
    alphas = np.zeros(rho.shape)
    for j in range(rho.shape[1] - 1, -1, -1):
        alphas[:, j] = rho[:, j] * np.einsum("ij,ij->i", s[:, j], q)
        q -= alphas[:, j, None] * y[:, j]
    yy = np.einsum("ij,ij->i", y[:, -1], y[:, -1])
    gamma = np.where(rho[:, -1] > 0, 1.0 / np.where(rho[:, -1] > 0, rho[:, -1], 1.0) / np.where(yy > 0, yy, 1.0), 1.0)
    r = gamma[:, None] * q
    for j in range(rho.shape[1]):
        beta = rho[:, j] * np.einsum("ij,ij->i", y[:, j], r)
        r += (alphas[:, j] - beta)[:, None] * s[:, j]
    return r
