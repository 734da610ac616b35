"""PNG plots of a fitted law (matplotlib, Agg backend): loss against compute with the frontier, isoFLOP curves,
residuals."""

from pathlib import Path
from typing import List

import numpy as np

from lit_pretrain.planning.laws import ParametricLaw
from lit_pretrain.scaling.fit import isoflop_groups


def plot_all(result: dict, folder: Path) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    pts = result["points"]
    n, d, c, loss = (np.array([p[k] for p in pts]) for k in ("N", "D", "C", "loss"))
    law = ParametricLaw.from_dict(result["chinchilla"])
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    sc = ax.scatter(c, loss, c=np.log10(n), cmap="viridis", s=18, label="runs")
    fig.colorbar(sc, ax=ax, label="log10 parameters")
    grid = np.logspace(np.log10(c.min()) - 0.3, np.log10(c.max()) + 0.5, 100)
    ax.plot(grid, [law.loss(*law.compute_optimal(x)) for x in grid], "k-",
            label="fitted L(N, D), compute-optimal with C = 6ND")
    fr = result["frontier"]
    if "L" in fr:
        ax.plot(grid, fr["L"]["coefficient"] * grid ** fr["L"]["exponent"], "r--", label=f"frontier ({fr['method']})")
        ax.scatter([p["C"] for p in fr["points"]], [p["loss"] for p in fr["points"]], marker="*", c="r", s=80)
    ax.set(xscale="log", xlabel="training FLOPs C", ylabel="final loss (nats / token)", title="loss against compute")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    paths.append(_save(fig, folder / "loss_vs_compute.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = [g for g in isoflop_groups(c) if len(g) >= 2]
    colors = plt.cm.plasma(np.linspace(0, 0.85, max(1, len(groups))))
    for group, color in zip(groups, colors):
        order = sorted(group, key=lambda i: n[i])
        budget = float(np.exp(np.mean(np.log(c[order]))))
        ax.plot(n[order], loss[order], "o", color=color, label=f"C ≈ {budget:.2g}")
        # the law at each run's own (N, D): a run's D is C / flops_per_token, not C / 6N, for small models
        ax.plot(n[order], [law.loss(n[i], d[i]) for i in order], "-", color=color, alpha=0.7)
    ax.set(xscale="log", xlabel="parameters N", ylabel="final loss (nats / token)",
           title="isoFLOP groups (dots: runs; lines: fitted law at the runs' N, D)")
    ax.grid(alpha=0.3, which="both")
    if 0 < len(groups) <= 12:  # a legend of more budgets hides the curves
        ax.legend(fontsize=7, ncol=2)
    paths.append(_save(fig, folder / "isoflop.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4.0))
    predicted = np.array([law.loss(a, b) for a, b in zip(n, d)])
    sc = ax.scatter(c, 100 * (predicted - loss) / loss, c=np.log10(n), cmap="viridis", s=18)
    fig.colorbar(sc, ax=ax, label="log10 parameters")
    ax.axhline(0, color="k", lw=0.8)
    ax.set(xscale="log", xlabel="training FLOPs C", ylabel="(fitted − measured) / measured, %",
           title="residuals of the fitted law")
    ax.grid(alpha=0.3, which="both")
    paths.append(_save(fig, folder / "residuals.png", plt))
    return paths


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
