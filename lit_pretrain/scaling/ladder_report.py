"""The ladder's fit, predictions and report: L(N, D) = E + A/N^alpha + B/D^beta fitted to the rungs at or below the
compute limit (Hoffmann et al. 2022 approach 3, eq. 2, through scaling/fit.py), bootstrap intervals (rungs resampled
with replacement and refitted, fit.bootstrap; percentile intervals), the compute-optimal tokens-per-parameter ratio
beside Chinchilla's 20, and the prediction of every held-out rung against its measured final validation loss.
Writes <root_dir>/report.json, report.md and ladder.png.
"""

import io
import json
import math
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from lit_pretrain.errors import RunFolderError
from lit_pretrain.scaling import fit as fit_lib
from lit_pretrain.scaling.ladder_state import LAW_PARAMETERS, read_summary, rung_complete
from lit_pretrain.scaling.laws import ParametricLaw

# Hoffmann et al. 2022, Table 3: their compute-optimal models train on about 20 tokens per parameter (1B parameters,
# 20.2B tokens; 67B, 1.5T), the ratio usually quoted as "Chinchilla's 20".
CHINCHILLA_TOKENS_PER_PARAM = 20.0
GOAL = "|relative error| <= 2% on a held-out rung at >= 10x the largest fitted compute, interval within ±5%"


def percentile_interval(values: Sequence[float], level: float) -> List[float]:
    """The central `level` percentile interval of bootstrap values (0.9: 5th and 95th percentiles)."""
    tail = 50.0 * (1.0 - level)
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100.0 - tail))]


def optimal_tokens_per_param(law: ParametricLaw, flops: float) -> Optional[float]:
    """D_opt / N_opt at compute C under C = 6ND (Hoffmann et al. eq. 4): G⁻²·(C/6)^(b − a). None where the law
    has no interior optimum (alpha or beta not positive: loss then never rises along the isoFLOP line)."""
    if not (law.alpha > 0 and law.beta > 0):
        return None
    with np.errstate(all="ignore"):
        n, d = law.compute_optimal(flops)
    ratio = d / n
    return ratio if math.isfinite(ratio) and ratio > 0 else None


def fit_ladder(n, d, loss, resamples: int, level: float, seed: int = 0) -> Dict:
    """The law fitted to all points, and its bootstrap: each resample draws the points with replacement and refits
    (fit.bootstrap); returns the law, the resampled laws and the coefficients' percentile intervals."""
    best = fit_lib.fit_parametric(n, d, loss)
    boot = fit_lib.bootstrap(n, d, loss, best, resamples, seed=seed)
    samples = [ParametricLaw.from_dict(s) for s in boot["samples"]]
    intervals = {k: percentile_interval([getattr(s, k) for s in samples], level)
                 for k in ("E", "A", "B", "alpha", "beta")} if len(samples) > 1 else {}
    return {"law": ParametricLaw.from_dict(best), "fit": best, "samples": samples, "intervals": intervals,
            "degenerate": boot["degenerate"]}


def predict(law: ParametricLaw, samples: List[ParametricLaw], n: float, d: float, level: float) -> Dict:
    """The law's loss at (N, D) and the percentile interval of the resampled laws' losses there."""
    values = [s.loss(n, d) for s in samples]
    return {"predicted_loss": law.loss(n, d), "interval": percentile_interval(values, level) if values else None}


def ratio_at(fitted: Dict, flops: float, level: float) -> Dict:
    """The compute-optimal tokens-per-parameter ratio at C and its bootstrap interval; resampled laws without an
    optimum are counted in `resamples_without_optimum`, not in the interval."""
    values = [v for v in (optimal_tokens_per_param(s, flops) for s in fitted["samples"]) if v is not None]
    return {"flops": flops, "tokens_per_param": optimal_tokens_per_param(fitted["law"], flops),
            "interval": percentile_interval(values, level) if len(values) > 1 else None,
            "resamples_without_optimum": len(fitted["samples"]) - len(values),
            "chinchilla_tokens_per_param": CHINCHILLA_TOKENS_PER_PARAM}


def complete_rows(root: Path, rungs: List[dict]) -> List[dict]:
    """A row per rung whose summary.json records the whole rung (ladder_state.rung_complete); a rung short of its
    planned steps (stopped by a signal, or not trained yet) has none: it is never fitted, predicted from or measured."""
    rows = []
    for rung in rungs:
        s = read_summary(root / rung["name"])
        if rung_complete(s, rung):
            rows.append({**{k: rung[k] for k in ("name", "role", "shape", "params", "steps", "tokens",
                                                   "tokens_per_param", "flops")},
                         "final_val_loss": s["final_val_loss"], "train_seconds": s.get("train_seconds"),
                         "tokens_per_second": s.get("tokens_per_second")})
    return rows


def fit_rungs(grid, rungs: List[dict]) -> Dict:
    """The law fitted to the complete rungs at or below the compute limit (their summary.json), with its bootstrap;
    `excluded` names the fitted rungs left out as not complete."""
    fit = [r for r in rungs if r["role"] == "fit"]
    rows = complete_rows(Path(grid.root_dir), fit)
    excluded = [r["name"] for r in fit if r["name"] not in {row["name"] for row in rows}]
    if len(rows) < LAW_PARAMETERS + 1:
        raise RunFolderError(f"{grid.root_dir}: {len(rows)} fitted rungs are complete, and L(N, D) needs at least "
                             f"{LAW_PARAMETERS + 1}; not complete: {', '.join(excluded)}: run the ladder again to "
                             "finish them")
    n, d, loss = (np.array([r[k] for r in rows], dtype=float) for k in ("params", "tokens", "final_val_loss"))
    return {**fit_ladder(n, d, loss, grid.bootstrap, grid.interval), "rows": rows, "excluded": excluded}


def predictions_of(grid, fitted: Dict, rungs: List[dict]) -> List[dict]:
    largest_fit = max(r["flops"] for r in fitted["rows"])
    out = []
    for r in (r for r in rungs if r["role"] == "held_out"):
        p = predict(fitted["law"], fitted["samples"], r["params"], r["tokens"], grid.interval)
        lo, hi = p["interval"] or (math.nan, math.nan)
        out.append({"name": r["name"], "params": r["params"], "tokens": r["tokens"], "flops": r["flops"],
                    "compute_over_largest_fitted": r["flops"] / largest_fit, **p,
                    "interval_relative": [(lo - p["predicted_loss"]) / p["predicted_loss"],
                                          (hi - p["predicted_loss"]) / p["predicted_loss"]]})
    return out


def write_prediction(grid, rungs: List[dict], log: Callable = print, fitted: Optional[Dict] = None) -> Dict:
    """<root_dir>/prediction.json: the held-out rungs' predicted losses from the complete fitted rungs, written
    before the first held-out rung trains, with the fitted losses it came from. Kept while those are the same (the
    record that the prediction came first); written again where they changed (a rung fitted earlier was partial, or
    was trained again), naming the held-out rungs already measured then. Returns the fit (`fitted`, or made here),
    which `report` reuses: the fit is seeded."""
    from lit_pretrain.resume.atomic import atomic_write_bytes

    fitted = fitted or fit_rungs(grid, rungs)
    inputs = {r["name"]: r["final_val_loss"] for r in fitted["rows"]}
    path = Path(grid.root_dir) / "prediction.json"
    old = json.loads(path.read_text()) if path.is_file() else None
    if old is not None and _same_inputs(old, inputs, predictions_of(grid, fitted, rungs)):
        return fitted
    measured = [r["name"] for r in complete_rows(Path(grid.root_dir), rungs) if r["role"] == "held_out"]
    record = {"predictions": predictions_of(grid, fitted, rungs), "fitted_val_losses": inputs,
              "held_out_measured_before": measured,
              "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write_bytes(path, (json.dumps(record, indent=2) + "\n").encode())
    if old is not None:
        log(f"{path} written again: the fitted rungs' losses differ from those it was predicted from"
            + (f" (measured already: {', '.join(measured)})" if measured else ""))
    for p in record["predictions"]:
        when = "after measuring it" if p["name"] in measured else "before training it"
        log(f"predicted {p['name']} {when}: {p['predicted_loss']:.4f} {_interval(p['interval'], '.4f')}")
    return fitted


def _same_inputs(old: Dict, inputs: Dict[str, float], predictions: List[dict]) -> bool:
    """Whether a prediction.json came from these fitted losses; one written before it recorded them, from its
    predicted losses (the fit is seeded: the same losses give the same predictions)."""
    if "fitted_val_losses" in old:
        return old["fitted_val_losses"] == inputs
    before = {p["name"]: p["predicted_loss"] for p in old.get("predictions", [])}
    return set(before) == {p["name"] for p in predictions} and all(
        math.isclose(before[p["name"]], p["predicted_loss"], rel_tol=1e-9) for p in predictions)


def report(grid, grid_path: Path, rungs: List[dict], log: Callable = print, fitted: Optional[Dict] = None) -> dict:
    """Read every rung's summary, fit (or take `fitted`, write_prediction's fit in this call), predict the held-out
    rungs; write report.json, report.md, ladder.png."""
    from lit_pretrain.resume.atomic import atomic_write_bytes

    root = Path(grid.root_dir)
    rows = complete_rows(root, rungs)  # a rung short of its planned steps is not reported as measured
    fitted = fitted or fit_rungs(grid, rungs)
    law, fit_rows = fitted["law"], fitted["rows"]
    measured = {r["name"]: r["final_val_loss"] for r in rows}
    predictions = [{**p, "measured_loss": measured.get(p["name"]),
                    "relative_error": (p["predicted_loss"] - measured[p["name"]]) / measured[p["name"]]
                    if p["name"] in measured else None}
                   for p in predictions_of(grid, fitted, rungs)]
    written = root / "prediction.json"
    predicted_at = json.loads(written.read_text()).get("written_at") if written.is_file() else None
    unfinished = [r["name"] for r in rungs if r["name"] not in measured]
    largest_held = max(p["flops"] for p in predictions)
    result = {
        "grid": str(grid_path), "compute_limit_flops": grid.compute_limit_flops, "precision": grid.precision,
        "conventions": {"N": "all parameters, embeddings included (Hoffmann et al. 2022)", "D": "training tokens",
                        "C": "6·N·D", "loss": "final validation loss, nats per token",
                        "interval": f"bootstrap percentile interval, {grid.interval:.0%} coverage, "
                                    f"{grid.bootstrap} resamples of the fitted rungs"},
        "law": {**{k: getattr(law, k) for k in ("E", "A", "B", "alpha", "beta", "a", "b")},
                "intervals": fitted["intervals"], "objective": fitted["fit"]["objective"],
                "starts_at_best": fitted["fit"]["starts_at_best"], "degenerate_resamples": fitted["degenerate"]},
        "compute_optimal": {"at_compute_limit": ratio_at(fitted, grid.compute_limit_flops, grid.interval),
                            "at_largest_held_out": ratio_at(fitted, largest_held, grid.interval)},
        "predictions": predictions, "prediction_written_at": predicted_at, "goal": GOAL, "rungs": rows,
        "unfinished_rungs": unfinished,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(root / "report.json", (json.dumps(result, indent=2) + "\n").encode())
    atomic_write_bytes(root / "report.md", markdown(result).encode())
    atomic_write_bytes(root / "ladder.png", picture(result, law, fitted["samples"], grid.interval))
    ratio = result["compute_optimal"]["at_largest_held_out"]
    log(f"L(N, D) = {law.E:.4g} + {law.A:.4g}/N^{law.alpha:.4f} + {law.B:.4g}/D^{law.beta:.4f} from "
        f"{len(fit_rows)} rungs; compute-optimal tokens_per_param {_value(ratio['tokens_per_param'], '.1f')} "
        f"{_interval(ratio['interval'], '.1f')} at C {largest_held:.3g} (Chinchilla: 20)")
    for p in predictions:
        log(f"held-out {p['name']} ({p['compute_over_largest_fitted']:.1f}x the largest fitted compute): predicted "
            f"{p['predicted_loss']:.4f} {_interval(p['interval'], '.4f')}, " + (
                f"measured {p['measured_loss']:.4f}, relative error {100 * p['relative_error']:+.2f}%"
                if p["measured_loss"] is not None else "not measured: the rung is not complete"))
    log(f"wrote {root / 'report.json'}, {root / 'report.md'}, {root / 'ladder.png'}")
    return result


def _value(value, spec: str) -> str:
    return "none (no optimum)" if value is None else f"{value:{spec}}"


def _interval(interval, spec: str) -> str:
    return f"[{interval[0]:{spec}}, {interval[1]:{spec}}]" if interval else "[no interval]"


def markdown(result: dict) -> str:
    law = result["law"]
    lines = [f"# Model ladder: {result['grid']}", "",
             f"L(N, D) = E + A/N^alpha + B/D^beta fitted to the rungs at C = 6ND <= "
             f"{result['compute_limit_flops']:.3g} FLOPs ({result['conventions']['interval']}).", "",
             "| coefficient | value | interval |", "|---|---|---|"]
    for key in ("E", "A", "B", "alpha", "beta"):
        lines.append(f"| {key} | {law[key]:.4g} | {_interval(law['intervals'].get(key), '.4g')} |")
    lines += ["", "| compute-optimal tokens per parameter | at C | value | interval | Chinchilla |",
              "|---|---|---|---|---|"]
    for label, r in result["compute_optimal"].items():
        lines.append(f"| {label.replace('_', ' ')} | {r['flops']:.3g} | {_value(r['tokens_per_param'], '.1f')} | "
                     f"{_interval(r['interval'], '.1f')} | {r['chinchilla_tokens_per_param']:.0f} |")
    lines += ["", "| held-out rung | C | C / largest fitted | predicted | interval | measured | relative error |",
              "|---|---|---|---|---|---|---|"]
    for p in result["predictions"]:
        measured, error = ("not complete", "-") if p["measured_loss"] is None else \
            (f"{p['measured_loss']:.4f}", f"{100 * p['relative_error']:+.2f}%")
        lines.append(f"| {p['name']} | {p['flops']:.3g} | {p['compute_over_largest_fitted']:.1f} | "
                     f"{p['predicted_loss']:.4f} | {_interval(p['interval'], '.4f')} | {measured} | {error} |")
    far = max(result["predictions"], key=lambda p: p["flops"])
    lo, hi = far["interval_relative"]
    error = f"relative error {100 * far['relative_error']:+.2f}%" if far["relative_error"] is not None else \
        "not measured (the rung is not complete)"
    lines += ["", f"Goal: {result['goal']}. Measured on {far['name']} ({far['compute_over_largest_fitted']:.1f}x): "
              f"{error}, interval {100 * lo:+.2f}% .. {100 * hi:+.2f}% of the prediction.", "",
              "| rung | role | N | D | tokens/param | C | val loss | train s |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rungs"]:
        seconds = f"{r['train_seconds']:.0f}" if r.get("train_seconds") is not None else "-"
        lines.append(f"| {r['name']} | {r['role']} | {r['params']:,} | {r['tokens']:,} | {r['tokens_per_param']:.3g} "
                     f"| {r['flops']:.3g} | {r['final_val_loss']:.4f} | {seconds} |")
    if result.get("unfinished_rungs"):
        lines += ["", f"Not complete (not fitted, not measured): {', '.join(result['unfinished_rungs'])}."]
    return "\n".join(lines) + "\n"


def picture(result: dict, law: ParametricLaw, samples: List[ParametricLaw], level: float) -> bytes:
    """Loss against compute per model size (dots: rungs; lines: the law at that N), the law's compute-optimal
    frontier, and each held-out rung's prediction with its interval beside the measured point. PNG bytes."""
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
        ax.plot(span, [law.loss(n, c / (6 * n)) for c in span], "-", color=color, alpha=0.5, lw=1)
    frontier = [law.loss(*law.compute_optimal(c)) for c in grid]
    ax.plot(grid, frontier, "k--", lw=1.2, label="fitted law, compute-optimal frontier")
    for j, p in enumerate(result["predictions"]):
        lo, hi = p["interval"] or (p["predicted_loss"], p["predicted_loss"])
        ax.errorbar([p["flops"]], [p["predicted_loss"]], yerr=[[p["predicted_loss"] - lo], [hi - p["predicted_loss"]]],
                    fmt="s", color="tab:red", capsize=4, mfc="none",
                    label=f"prediction, {level:.0%} bootstrap interval" if j == 0 else None)
        if p["measured_loss"] is not None:
            ax.plot([p["flops"]], [p["measured_loss"]], "*", color="tab:red", ms=12,
                    label="held-out rung, measured" if j == 0 else None)
    ax.axvline(result["compute_limit_flops"], color="grey", lw=0.8, ls=":", label="compute limit of the fit")
    ax.set(xscale="log", xlabel="training compute C = 6ND (FLOPs)", ylabel="final validation loss (nats / token)",
           title="model ladder: fitted below the limit, predicted above")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()
