"""`lit-pretrain fit`: runs or a CSV -> (N, D, C, loss) points -> fitted law, bootstrap, frontier -> JSON, PNG."""

import json
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np

from lit_pretrain.scaling import fit as fit_lib
from lit_pretrain.scaling.points import load_points


def fit_sources(sources: List[str], out: Optional[Path] = None, plots_dir: Optional[Path] = None,
                bootstrap: int = 200, drop_highest: int = 0, seed: int = 0, log: Callable = print,
                starts: Optional[np.ndarray] = None) -> dict:
    """Fit the approach-3 law and the frontier power laws to the runs in `sources`; write law.json and plots.

    drop_highest: leave out this many highest-loss points first (Besiroglu et al. 2024 drop 5 of Hoffmann et al.'s
    extracted points as outliers). starts: L-BFGS starting points (default: Hoffmann et al.'s grid).
    """
    points = load_points(sources)
    if drop_highest:
        points = sorted(points, key=lambda p: p["loss"])[: len(points) - drop_highest]
    n, d, c, loss = (np.array([p[k] for p in points]) for k in ("N", "D", "C", "loss"))
    law = fit_lib.fit_parametric(n, d, loss, starts=starts)
    boot = fit_lib.bootstrap(n, d, loss, law, bootstrap, seed=seed) if bootstrap > 1 else None
    if boot:
        law["bootstrap"] = {k: v for k, v in boot.items() if k != "samples"}
        law["bootstrap_samples"] = boot["samples"]
    frontier = fit_lib.frontier(n, d, c, loss)
    result = {
        "chinchilla": law,
        "frontier": frontier,
        "conventions": {"N": "all parameters, embeddings included (Hoffmann et al. 2022)", "D": "training tokens",
                        "C": "training FLOPs (runs: flops_per_token × tokens; CSV: its column, or 6·N·D)",
                        "loss": "final validation loss, nats per token"},
        "points": points,
    }
    _print(result, log)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {out}")
    if plots_dir is not None:
        from lit_pretrain.scaling import plots

        for path in plots.plot_all(result, Path(plots_dir)):
            log(f"wrote {path}")
    return result


def _print(result: dict, log: Callable) -> None:
    law, boot = result["chinchilla"], result["chinchilla"].get("bootstrap")
    log(f"L(N, D) = E + A/N^alpha + B/D^beta fitted to {law['runs']} runs (Huber delta 1e-3 on log loss, "
        f"L-BFGS from {law['starts']} starts, {law['starts_at_best']} reached the best objective "
        f"{law['objective']:.6g})")
    for key in ("E", "A", "B", "alpha", "beta", "a", "b"):
        extra = ""
        if boot:
            ci = boot["coefficients"][key]
            se = "n/a" if ci["standard_error"] is None else f"{ci['standard_error']:.4g}"
            extra = (f"  (bootstrap s.e. {se}, 90% interval {ci['interval_90'][0]:.4g} .. "
                     f"{ci['interval_90'][1]:.4g})")
        log(f"  {key:<6} {law[key]:.4g}{extra}")
    fr = result["frontier"]
    if "N_opt" in fr:
        log(f"compute frontier ({fr['method']}, {len(fr['points'])} points): "
            f"L(C) = {fr['L']['coefficient']:.4g}·C^{fr['L']['exponent']:.4f}, "
            f"N_opt(C) = {fr['N_opt']['coefficient']:.4g}·C^{fr['N_opt']['exponent']:.4f}, "
            f"D_opt(C) = {fr['D_opt']['coefficient']:.4g}·C^{fr['D_opt']['exponent']:.4f}")
    outside = [p for p in fr["points"] if p.get("bracketed") is False]
    if outside:
        log(f"note: {len(outside)} of {len(fr['points'])} isoFLOP minima lie outside their group's model sizes "
            "(extrapolated parabola vertices): the runs do not bracket the compute-optimal size there")
