"""The ladder's figure, ladder.png: loss against compute per model size with the chosen law, its compute-optimal
frontier (a law in tokens), the development rung, and each held-out rung's prediction and interval beside its
measured loss. matplotlib's Figure without pyplot: no display and no global state on a training machine.
"""

import io
import math
from typing import List, Optional

import numpy as np

from lit_pretrain.planning.laws import ParametricLaw
from lit_pretrain.scaling.ladder.law import n_of, safe_loss, split_key


def picture(result: dict, law: Optional[ParametricLaw], samples: List[ParametricLaw], level: float) -> bytes:
    """Loss against compute per model size (dots: rungs; lines: the law at that N), the law's compute-optimal
    frontier, and each held-out rung's prediction with its interval beside the measured point; the rungs alone where
    the fit failed (law None). PNG bytes."""
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no display and no global state on training machines

    rows = result["rungs"]
    sizes = sorted({r["params"] for r in rows})
    c_all = np.array([r["flops"] for r in rows])
    grid = np.logspace(np.log10(c_all.min()) - 0.2, np.log10(c_all.max()) + 0.2, 120)
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    cmap = matplotlib.colormaps["viridis"]
    for i, n in enumerate(sizes):
        color = cmap(0.9 * i / max(1, len(sizes) - 1))
        mine = sorted((r for r in rows if r["params"] == n), key=lambda r: r["flops"])
        fit_pts = [r for r in mine if r["role"] == "fit"]
        if fit_pts:
            ax.plot([r["flops"] for r in fit_pts], [r["final_val_loss"] for r in fit_pts], "o", color=color,
                    label=f"N = {n:,}")
        span = grid[(grid >= min(r["flops"] for r in mine) / 2) & (grid <= max(r["flops"] for r in mine) * 2)]
        key = result.get("convention") or "total"
        n_law = n_of(mine[0], key) if "non_embedding_params" in mine[0] else n
        # the law's second variable at compute c for this size: D = c / 6N tokens, or those over its tokens a step
        per = 1.0 / mine[0]["tokens_per_step"] if split_key(key)[1] == "steps" else 1.0
        if law is not None:
            ax.plot(span, [safe_loss(law, n_law, c / (6 * n) * per) for c in span], "-", color=color, alpha=0.5,
                    lw=1)
        others = [r for r in mine if r["role"] == "dev"]
        if others:
            ax.plot([r["flops"] for r in others], [r["final_val_loss"] for r in others], "D", color=color, mfc="none",
                    label=f"development rung, N = {n:,}")
    if law is not None and law.alpha > 0 and law.beta > 0 and (result.get("convention", "total") == "total" or all(
            r.get("tied") for r in rows) and result.get("convention") == "non_embedding_plus_head"):
        # eq. 4's closed form counts C = 6·N_X·D: the x axis's compute only where N_X is every parameter
        frontier = [safe_loss(law, *law.compute_optimal(c)) for c in grid]
        ax.plot(grid, frontier, "k--", lw=1.2, label="fitted law, compute-optimal frontier")
    for j, p in enumerate(result["predictions"]):
        lo, hi = p["interval"] or (p["predicted_loss"], p["predicted_loss"])
        # the interval as a bar of its own: a percentile interval need not hold the full-data fit's prediction
        ax.plot([p["flops"]] * 2, [lo, hi], "_-", color="tab:red", ms=10, lw=1.2,
                label=f"{level:.0%} bootstrap interval" if j == 0 else None)
        ax.plot([p["flops"]], [p["predicted_loss"]], "s", color="tab:red", mfc="none",
                label="prediction (written before it trained)" if j == 0 else None)
        if p["measured_loss"] is not None:
            ax.plot([p["flops"]], [p["measured_loss"]], "*", color="tab:red", ms=12,
                    label="held-out rung, measured" if j == 0 else None)
    # the axis spans the measured and predicted losses: an interval reaching far beyond them (a bootstrap whose
    # resamples lost a size) is cut at the edge, and its end written there
    shown = [r["final_val_loss"] for r in rows] + [p["predicted_loss"] for p in result["predictions"]
                                                   if math.isfinite(p["predicted_loss"])]
    top, bottom = 1.1 * max(shown), 0.9 * min(shown)
    ax.set_ylim(bottom, top)
    for p in result["predictions"]:
        if p["interval"] and not bottom <= p["interval"][1] <= top:
            ax.annotate(f"interval to {p['interval'][1]:.4g}", (p["flops"], top), textcoords="offset points",
                        xytext=(-10, -12), ha="right", fontsize=7, color="tab:red")
    ax.axvline(result["compute_limit_flops"], color="grey", lw=0.8, ls=":", label="compute limit of the fit")
    ax.set(xscale="log", xlabel="training compute C = 6ND (FLOPs)", ylabel="final validation loss (nats / token)",
           title="model ladder: fitted below the limit, predicted above" if law is not None else
           "model ladder: no law (the fit failed: report.md says why)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()
