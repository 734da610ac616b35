"""The ladder's fit, predictions and report: L(N, D) = E + A/N^alpha + B/D^beta fitted to the fitted rungs
(Hoffmann et al. 2022 approach 3, eq. 2, through scaling/fit.py) under each parameter-count convention, bootstrap
intervals (points resampled with replacement and refitted, each loss also jittered by the measured seed-to-seed
spread; percentile intervals), the convention chosen by its error on the development rungs, the compute-optimal
tokens-per-parameter ratio, and the prediction of every held-out rung against its measured final validation loss.
Writes <root_dir>/prediction.json (before any held-out rung trains), report.json, report.md and ladder.png (drawn by
picture.py; the conventions, variables and fit names are law.py).

Parameter counts (CONVENTIONS). With the embedding tied to the head (one V×d matrix):
- total: every parameter, the tied matrix once (Hoffmann et al. 2022; Pearce & Song 2024 recommend it);
- non_embedding: the tied matrix left out (Kaplan et al. 2020 §2.1; OLMo-core's ladder sizes);
- non_embedding_plus_head: the tied matrix counted once, as the head (OLMo's ladder counts all but the input
  embedding; nanochat's matrices plus the head): with tying this is `total`, with an untied head N - V·d.
Compute is one number everywhere (limit, ratios, prediction.json, report, picture): C = 6·N·D with N every
parameter, the head's matmul included (Porian et al. 2024), attention's 12·L·H·Q·T per token left out (Hoffmann et
al. §3.3 count). The compute-optimal allocation of a law fitted in convention X is eq. 4 with C = 6·N_X·D (that law
knows only N_X); its tokens-per-parameter ratio is per N_X.

The law's second variable (grid.law_variables): D, training tokens, or S, each rung's optimizer steps; with both,
every convention is fitted in each (fit_key: "total", "total, steps", ...) and the development rung chooses.
"""

import json
import math
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from lit_pretrain.errors import DataError, RunFolderError
from lit_pretrain.planning.laws import ParametricLaw
from lit_pretrain.scaling import fit as fit_lib
from lit_pretrain.scaling.ladder.law import (
    COMPUTE,
    CONVENTION_TEXT,
    CONVENTIONS,
    VARIABLE_TEXT,
    fit_key,
    law_failure,
    n_of,
    safe_loss,
    split_key,
    symbol,
    x_of,
)
from lit_pretrain.scaling.ladder.picture import picture
from lit_pretrain.scaling.ladder.state import LAW_PARAMETERS, read_summary, rung_complete
from lit_pretrain.scaling.steps_optimum import batch_rule_tokens, grid_sizes, optimal_tokens_per_param_in_steps

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


def fit_ladder(n, d, loss, resamples: int, level: float, seed: int = 0, noise: float = 0.0,
               method: str = "points", seeds: Optional[Sequence[int]] = None) -> Dict:
    """The law fitted to all points, and its bootstrap (fit.bootstrap): each resample draws the points with
    replacement (method points) or the fit's losses plus resampled log residuals at every point (residuals),
    multiplies each loss by exp(Normal(0, noise/sqrt(seeds))) (the seed-to-seed spread; a point averaged over k seeds
    has 1/sqrt(k) of it) and refits; returns the law, the resampled laws and the coefficients' percentile
    intervals."""
    best = fit_lib.fit_parametric(n, d, loss)
    scale = None if seeds is None else [1.0 / math.sqrt(k) for k in seeds]
    boot = fit_lib.bootstrap(n, d, loss, best, resamples, seed=seed, loss_noise=noise, method=method,
                             noise_scale=scale)
    samples = [ParametricLaw.from_dict(s) for s in boot["samples"]]
    intervals = {k: percentile_interval([getattr(s, k) for s in samples], level)
                 for k in ("E", "A", "B", "alpha", "beta")} if len(samples) > 1 else {}
    return {"law": ParametricLaw.from_dict(best), "fit": best, "samples": samples, "intervals": intervals,
            "degenerate": boot["degenerate"]}


def predict(law: ParametricLaw, samples: List[ParametricLaw], n: float, d: float, level: float) -> Dict:
    """The law's loss at (N, D) and the percentile interval of the resampled laws' losses there (a resample whose
    loss there is infinite is counted in `resamples_infinite`, not in the interval)."""
    values = [safe_loss(s, n, d) for s in samples]
    finite = [v for v in values if math.isfinite(v)]
    return {"predicted_loss": safe_loss(law, n, d),
            "interval": percentile_interval(finite, level) if len(finite) > 1 else None,
            "resamples_infinite": len(values) - len(finite)}


def ratio_at(fitted: Dict, flops: float, level: float, key: str = "total", grid=None,
             rungs: Optional[List[dict]] = None) -> Dict:
    """The compute-optimal tokens-per-parameter ratio at C and its bootstrap interval; resampled laws without an
    optimum are counted in `resamples_without_optimum`, not in the interval. A law in steps has its optimum under the
    grid's batch rule, along the grid's sizes (steps_optimum.py; `under` says so); without the grid, none."""
    steps = split_key(key)[1] == "steps"
    if steps and (grid is None or not rungs):
        return {"flops": flops, "tokens_per_param": None, "interval": None, "resamples_without_optimum": None,
                "chinchilla_tokens_per_param": CHINCHILLA_TOKENS_PER_PARAM,
                "why": "not computed for a law in steps without its grid (its optimum depends on the batch rule)"}
    if steps:
        sizes = grid_sizes(rungs, lambda r: n_of(r, key))
        rule = grid.batch_rule
        tokens = batch_rule_tokens(rule["sequences"], rule["params"], rule["exponent"],
                                   rungs[0]["tokens_per_step"] // rungs[0]["sequences"])

        def optimum(law):
            return optimal_tokens_per_param_in_steps(law, flops, sizes, tokens)
    else:
        def optimum(law):
            return optimal_tokens_per_param(law, flops)
    values = [v for v in (optimum(s) for s in fitted["samples"]) if v is not None]
    result = {"flops": flops, "tokens_per_param": optimum(fitted["law"]),
              "interval": percentile_interval(values, level) if len(values) > 1 else None,
              "resamples_without_optimum": len(fitted["samples"]) - len(values),
              "chinchilla_tokens_per_param": CHINCHILLA_TOKENS_PER_PARAM}
    if steps:
        result["under"] = (f"the grid's batch rule ({rule['sequences']:g}·(N_non_embedding/{rule['params']:g})^"
                           f"{rule['exponent']:g} sequences a step, before rounding) along its sizes, in tokens "
                           "per parameter of every parameter under every convention (steps_optimum.py)")
    return result


def complete_rows(root: Path, rungs: List[dict]) -> List[dict]:
    """A row per rung whose summary.json records the whole rung (ladder_state.rung_complete); a rung short of its
    planned steps (stopped by a signal, or not trained yet) has none: it is never fitted, predicted from or measured."""
    rows = []
    for rung in rungs:
        s = read_summary(root / rung["name"])
        if rung_complete(s, rung):
            rows.append({**{k: rung.get(k) for k in ("name", "role", "shape", "params", "non_embedding_params",
                                                       "head_params", "tied", "steps", "tokens", "tokens_per_param",
                                                       "flops", "seed", "branch_of", "lr", "tokens_per_step")},
                         "final_val_loss": s["final_val_loss"], "train_seconds": s.get("train_seconds"),
                         "tokens_per_second": s.get("tokens_per_second")})
    return rows


def seed_spread(rows: List[dict]) -> Dict:
    """The seed-to-seed spread of the fitted rungs trained with several seeds: per (N, D) the losses and their
    relative standard deviation (ddof 1), and the pooled one, sqrt(mean variance) (0 without replicas)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["params"], r["tokens"]), []).append(r)
    out = []
    for (n, d), members in sorted(groups.items()):
        if len(members) > 1:
            losses = np.array([m["final_val_loss"] for m in members])
            out.append({"params": n, "tokens": d, "names": [m["name"] for m in members], "losses": losses.tolist(),
                        "relative_std": float(losses.std(ddof=1) / losses.mean()),
                        "range_relative": float((losses.max() - losses.min()) / losses.mean())})
    pooled = float(np.sqrt(np.mean([g["relative_std"] ** 2 for g in out]))) if out else 0.0
    return {"groups": out, "relative_std": pooled}


def fit_points(rows: List[dict]) -> List[dict]:
    """One point per fitted (N, D): the mean loss of its seeds."""
    groups = {}
    for r in rows:
        groups.setdefault((r["params"], r["tokens"]), []).append(r)
    return [{**members[0], "final_val_loss": float(np.mean([m["final_val_loss"] for m in members])),
             "seeds": len(members)} for _, members in sorted(groups.items())]


def fit_rungs(grid, rungs: List[dict]) -> Dict:
    """The law under each convention, fitted to the complete fitted rungs (their summary.json; seeds averaged), with
    its bootstrap jittered by the seed spread; the convention chosen by the development rungs' mean |relative error|
    (the first, total, where none is measured). The chosen fit's law, samples and intervals are at the top level.
    `excluded` names the fitted rungs left out as not complete."""
    fit = [r for r in rungs if r["role"] == "fit"]
    root = Path(grid.root_dir)
    rows = complete_rows(root, fit)
    excluded = [r["name"] for r in fit if r["name"] not in {row["name"] for row in rows}]
    points = fit_points(rows)
    if len(points) < LAW_PARAMETERS + 1:
        raise RunFolderError(f"{grid.root_dir}: {len(points)} fitted (N, D) points are complete, and L(N, D) needs at "
                             f"least {LAW_PARAMETERS + 1}; not complete: {', '.join(excluded)}: run the ladder again "
                             "to finish them")
    spread = seed_spread(rows)
    loss = np.array([p["final_val_loss"] for p in points], dtype=float)
    by_convention, failed = {}, {}
    keys = [fit_key(c, v) for v in grid.law_variables for c in CONVENTIONS]
    for convention in keys:
        n = np.array([n_of(p, convention) for p in points], dtype=float)
        d = np.array([x_of(p, convention) for p in points], dtype=float)
        try:
            by_convention[convention] = fit_ladder(n, d, loss, grid.bootstrap, grid.interval,
                                                   noise=spread["relative_std"],
                                                   method=grid.bootstrap_method,
                                                   seeds=[p["seeds"] for p in points])
        except DataError as err:  # these points do not pin the law down in this convention: reported, not chosen
            failed[convention] = str(err)
            continue
        why = law_failure(by_convention[convention]["law"], rungs, convention, rungs[0]["vocab_size"])
        if why is not None:  # outside ladder_law's bounds: a curve through noise, reported, not chosen
            failed[convention] = f"{why} ({_law_text(by_convention.pop(convention)['law'], convention)})"
    if not by_convention:  # reported as such: the rungs are still measured, nothing is predicted
        return {"law": None, "fit": None, "samples": [], "intervals": {}, "degenerate": None, "convention": None,
                "chosen_by": "none: the law failed under every convention", "by_convention": {}, "development": {},
                "failed_conventions": failed, "seed_spread": spread, "rows": rows, "points": points,
                "excluded": excluded}
    dev = complete_rows(root, [r for r in rungs if r["role"] == "dev"])
    development = {c: [{"name": r["name"], "measured_loss": r["final_val_loss"],
                        "predicted_loss": safe_loss(f["law"], n_of(r, c), x_of(r, c)),
                        "relative_error": (safe_loss(f["law"], n_of(r, c), x_of(r, c)) - r["final_val_loss"])
                        / r["final_val_loss"]} for r in dev] for c, f in by_convention.items()}
    if dev:
        chosen = min(by_convention, key=lambda c: (np.mean([abs(x["relative_error"]) for x in development[c]]),
                                                 keys.index(c)))
        chosen_by = f"smallest mean |relative error| on the development rungs {', '.join(r['name'] for r in dev)}"
    else:
        chosen = next(c for c in keys if c in by_convention)
        chosen_by = "no development rung measured: the first convention that fits"
    return {**by_convention[chosen], "convention": chosen, "chosen_by": chosen_by, "by_convention": by_convention,
            "development": development, "failed_conventions": failed, "seed_spread": spread, "rows": rows,
            "points": points, "excluded": excluded}


def predictions_of(grid, fitted: Dict, rungs: List[dict], convention: Optional[str] = None) -> List[dict]:
    """The held-out rungs' predicted losses and intervals under `convention` (default: the chosen one)."""
    if convention is None and fitted.get("law") is None:
        return []  # the law failed under every convention: nothing to predict with
    convention = convention or fitted.get("convention", "total")
    f = fitted["by_convention"][convention] if "by_convention" in fitted else fitted
    largest_fit = max(r["flops"] for r in fitted["rows"])
    out = []
    for r in (r for r in rungs if r["role"] == "held_out"):
        p = predict(f["law"], f["samples"], n_of(r, convention), x_of(r, convention), grid.interval)
        lo, hi = p["interval"] or (math.nan, math.nan)
        out.append({"name": r["name"], "params": r["params"], "tokens": r["tokens"], "flops": r["flops"],
                    "compute_over_largest_fitted": r["flops"] / largest_fit, **p,
                    "interval_relative": [(lo - p["predicted_loss"]) / p["predicted_loss"],
                                          (hi - p["predicted_loss"]) / p["predicted_loss"]]})
    return out


def write_prediction(grid, rungs: List[dict], log: Callable = print, fitted: Optional[Dict] = None) -> Dict:
    """<root_dir>/prediction.json: the held-out rungs' predicted losses from the complete fitted rungs, written
    before the first held-out rung trains, with the fitted losses it came from. Kept while those and the held-out
    rungs are the same (the record that the prediction came first); written again where they changed (a rung fitted
    earlier was partial, or was trained again; a held-out rung was added to the grid, which so gets its prediction
    before it trains), naming the held-out rungs already measured then. Returns the fit (`fitted`, or made here),
    which `report` reuses: the fit is seeded."""
    from lit_pretrain.atomic import atomic_write_bytes

    fitted = fitted or fit_rungs(grid, rungs)
    inputs = {r["name"]: r["final_val_loss"] for r in fitted["rows"]}
    path = Path(grid.root_dir) / "prediction.json"
    old = json.loads(path.read_text()) if path.is_file() else None
    if old is not None and _same_inputs(old, inputs, predictions_of(grid, fitted, rungs)):
        return fitted
    measured = [r["name"] for r in complete_rows(Path(grid.root_dir), rungs) if r["role"] == "held_out"]
    record = {"predictions": predictions_of(grid, fitted, rungs), "convention": fitted.get("convention"),
              "chosen_by": fitted.get("chosen_by"), "compute": COMPUTE,
              "by_convention": {c: predictions_of(grid, fitted, rungs, c) for c in fitted.get("by_convention", {})},
              "development": fitted.get("development"), "seed_spread": fitted.get("seed_spread"),
              "failed_conventions": fitted.get("failed_conventions", {}), "fitted_val_losses": inputs,
              "held_out_measured_before": measured,
              "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write_bytes(path, (json.dumps(record, indent=2) + "\n").encode())
    if old is not None:
        log(f"{path} written again: the fitted rungs' losses or the held-out rungs differ from those it was "
            "written for"
            + (f" (measured already: {', '.join(measured)})" if measured else ""))
    for p in record["predictions"]:
        when = "after measuring it" if p["name"] in measured else "before training it"
        log(f"predicted {p['name']} {when}: {p['predicted_loss']:.4f} {_interval(p['interval'], '.4f')}")
    if fitted["law"] is None:
        log(f"no prediction: {_failed_text(fitted)}")
    return fitted


def _law_text(law: ParametricLaw, key: str) -> str:
    x = symbol(key)
    return f"L(N, {x}) = {law.E:.4g} + {law.A:.4g}/N^{law.alpha:.4f} + {law.B:.4g}/{x}^{law.beta:.4f}"


def _failed_text(fitted: Dict) -> str:
    """Why the fit failed under every convention (fit_rungs' failed_conventions), one clause each."""
    return "the law failed under every convention: " + "; ".join(
        f"{c}: {why}" for c, why in fitted["failed_conventions"].items())


def _same_inputs(old: Dict, inputs: Dict[str, float], predictions: List[dict]) -> bool:
    """Whether a prediction.json predicted these held-out rungs from these fitted losses; one written before it
    recorded the losses, from its predicted losses (the fit is seeded: the same losses give the same predictions)."""
    before = {p["name"]: p["predicted_loss"] for p in old.get("predictions", [])}
    if set(before) != {p["name"] for p in predictions}:
        return False  # a held-out rung added to (or left out of) the grid since
    if "fitted_val_losses" in old:
        return old["fitted_val_losses"] == inputs
    return all(math.isclose(before[p["name"]], p["predicted_loss"], rel_tol=1e-9) for p in predictions)


def report(grid, grid_path: Path, rungs: List[dict], log: Callable = print, fitted: Optional[Dict] = None) -> dict:
    """Read every rung's summary, fit (or take `fitted`, write_prediction's fit in this call), predict the held-out
    rungs; write report.json, report.md, ladder.png."""
    from lit_pretrain.atomic import atomic_write_bytes

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
    largest_held = max(r["flops"] for r in rungs if r["role"] == "held_out")
    fitted.setdefault("by_convention", {})
    convention = fitted.get("convention") or "total"  # where no law was chosen: the letters of the text only
    # (law - measured) / measured under the chosen convention, for every measured rung: on a fitted rung the law's
    # residual (how closely it describes its own data), on the others its error; one definition for the column
    law_error = {r["name"]: None if law is None else (safe_loss(law, n_of(r, convention), x_of(r, convention))
                                                      - r["final_val_loss"]) / r["final_val_loss"] for r in rows}
    fit_errors = {r["name"]: law_error[r["name"]] for r in fit_rows}
    worst = None if law is None else max(fit_errors, key=lambda k: abs(fit_errors[k]))
    result = {
        "grid": str(grid_path), "compute_limit_flops": grid.compute_limit_flops, "precision": grid.precision,
        "conventions": {"N": f"{convention}: {CONVENTION_TEXT[split_key(convention)[0]]}" if law is not None
                        else "none chosen: the law failed under every convention",
                        "chosen_by": fitted.get("chosen_by"),
                        symbol(convention): VARIABLE_TEXT[split_key(convention)[1]],
                        "C": COMPUTE,
                        "loss": "final validation loss, nats per token",
                        "interval": f"bootstrap percentile interval, {grid.interval:.0%} coverage, "
                                    f"{grid.bootstrap} resamples "
                                    + ("of the fitted points' residuals (fixed design: every fitted (N, D) in "
                                       "every resample)" if grid.bootstrap_method
                                       == "residuals" else "of the fitted points (drawn with replacement)")
                                    + ", each loss jittered by the seed spread "
                                    f"({100 * fitted.get('seed_spread', {}).get('relative_std', 0):.2f}%, over "
                                    "sqrt(seeds) at a seed-averaged point)"},
        "convention": fitted.get("convention", "total"),
        "by_convention": {c: _convention_result(grid, fitted, rungs, c, measured, largest_held)
                          for c in fitted.get("by_convention", {})},
        "failed_conventions": fitted.get("failed_conventions", {}), "seed_spread": fitted.get("seed_spread"),
        "law": None if law is None else {
            **{k: getattr(law, k) for k in ("E", "A", "B", "alpha", "beta", "a", "b")},
            "intervals": fitted["intervals"], "objective": fitted["fit"]["objective"],
            "starts_at_best": fitted["fit"]["starts_at_best"], "degenerate_resamples": fitted["degenerate"],
            "fit_residuals": {"largest": {"rung": worst, "relative": fit_errors[worst]},
                              "mean_abs": float(np.mean([abs(v) for v in fit_errors.values()]))}},
        "fit_failed": _failed_text(fitted) if law is None else None,
        "compute_optimal": {} if law is None else {
            "at_compute_limit": ratio_at(fitted, grid.compute_limit_flops, grid.interval, convention, grid, rungs),
            "at_largest_held_out": ratio_at(fitted, largest_held, grid.interval, convention, grid, rungs)},
        "predictions": predictions, "prediction_written_at": predicted_at, "goal": GOAL,
        "rungs": [{**r, "law_relative_error": law_error[r["name"]]} for r in rows],
        "unfinished_rungs": unfinished,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(root / "report.json", (json.dumps(result, indent=2) + "\n").encode())
    atomic_write_bytes(root / "report.md", markdown(result).encode())
    atomic_write_bytes(root / "ladder.png", picture(result, law, fitted["samples"], grid.interval))
    if law is None:
        log(f"no law from {len(fit_rows)} rungs: {result['fit_failed']}")
    else:
        log(f"{_law_text(law, convention)} ({convention}) from {len(fit_rows)} rungs; compute-optimal tokens_per_param "
            f"{_ratio(result['compute_optimal']['at_largest_held_out'])} at C {largest_held:.3g} (Chinchilla: 20)")
    for p in predictions:
        log(f"held-out {p['name']} ({p['compute_over_largest_fitted']:.1f}x the largest fitted compute): predicted "
            f"{p['predicted_loss']:.4f} {_interval(p['interval'], '.4f')}, " + (
                f"measured {p['measured_loss']:.4f}, relative error {100 * p['relative_error']:+.2f}%"
                if p["measured_loss"] is not None else "not measured: the rung is not complete"))
    log(f"wrote {root / 'report.json'}, {root / 'report.md'}, {root / 'ladder.png'}")
    return result


def _convention_result(grid, fitted: Dict, rungs: List[dict], convention: str, measured: Dict[str, float],
                       largest_held: float) -> Dict:
    """One convention's law, intervals, development and held-out errors and optimum ratio, for the side by side."""
    f = fitted["by_convention"][convention]
    law = f["law"]
    held = [{**p, "measured_loss": measured.get(p["name"]),
             "relative_error": (p["predicted_loss"] - measured[p["name"]]) / measured[p["name"]]
             if p["name"] in measured else None} for p in predictions_of(grid, fitted, rungs, convention)]
    return {"N": CONVENTION_TEXT[split_key(convention)[0]], symbol(convention): VARIABLE_TEXT[split_key(convention)[1]],
            "law": {**{k: getattr(law, k) for k in ("E", "A", "B", "alpha", "beta", "a", "b")},
                    "intervals": f["intervals"], "objective": f["fit"]["objective"],
                    "degenerate_resamples": f["degenerate"]},
            "development": fitted["development"].get(convention, []), "held_out": held,
            "compute_optimal_tokens_per_param_at_largest_held_out": ratio_at(f, largest_held, grid.interval,
                                                                             convention, grid, rungs)}


def _value(value, spec: str) -> str:
    return "none (no optimum)" if value is None else f"{value:{spec}}"


def _ratio(r: Dict) -> str:
    """A compute-optimal ratio and its interval, or why a law has none here (ratio_at)."""
    return r["why"] if r.get("why") else f"{_value(r['tokens_per_param'], '.1f')} {_interval(r['interval'], '.1f')}"


def _interval(interval, spec: str) -> str:
    return f"[{interval[0]:{spec}}, {interval[1]:{spec}}]" if interval else "[no interval]"


def markdown(result: dict) -> str:
    law = result["law"]
    conv = result["conventions"]
    x = symbol(result.get("convention") or "total")
    lines = [f"# Model ladder: {result['grid']}", "",
             f"L(N, {x}) = E + A/N^alpha + B/{x}^beta fitted to the rungs at C <= {result['compute_limit_flops']:.3g} "
             f"FLOPs ({conv['interval']}). Compute: {conv['C']}. N: {conv['N']}; {x}: {conv[x]}; chosen by "
             f"{conv['chosen_by']}.", ""]
    if result.get("by_convention") or result.get("failed_conventions"):
        lines += ["| N convention | E | A | B | alpha | beta | development error | held-out error | "
                  "tokens/param optimum at the largest held-out C |", "|---|---|---|---|---|---|---|---|---|"]
        for name, c in result["by_convention"].items():
            law_c = c["law"]
            dev = ", ".join(f"{100 * x['relative_error']:+.2f}%" for x in c["development"]) or "-"
            held = ", ".join("-" if x["relative_error"] is None else f"{100 * x['relative_error']:+.2f}%"
                             for x in c["held_out"])
            ratio_c = c["compute_optimal_tokens_per_param_at_largest_held_out"]
            lines.append(f"| {name}{' (chosen)' if name == result.get('convention') else ''} | {law_c['E']:.4g} | "
                         f"{law_c['A']:.4g} | {law_c['B']:.4g} | {law_c['alpha']:.4f} | {law_c['beta']:.4f} | {dev} "
                         f"| {held} | {_ratio(ratio_c)} |")
        for name, why in result.get("failed_conventions", {}).items():
            lines.append(f"| {name} | fit failed: {why} | | | | | | | |")
        lines.append("")
    spread = result.get("seed_spread") or {}
    for g in spread.get("groups", []):
        lines.append(f"Seeds at N {g['params']:,}, D {g['tokens']:,}: losses "
                     f"{', '.join(f'{x:.4f}' for x in g['losses'])}, relative standard deviation "
                     f"{100 * g['relative_std']:.2f}%, range {100 * g['range_relative']:.2f}%.")
    if spread.get("groups"):
        lines += [f"Pooled seed-to-seed relative standard deviation {100 * spread['relative_std']:.2f}% (in the "
                  "bootstrap).", ""]
    if law is None:  # fit_rungs found no law within ladder_law's bounds: the rungs' table only
        lines += [f"No law, no prediction: {result['fit_failed']}.", "",
                  f"Goal: {result['goal']}. Not assessed: nothing was predicted."]
        return "\n".join(lines + ["", *_rung_table(result)]) + "\n"
    lines += [f"The chosen law ({result.get('convention', 'total')}):", "",
              "| coefficient | value | interval |", "|---|---|---|"]
    for key in ("E", "A", "B", "alpha", "beta"):
        lines.append(f"| {key} | {law[key]:.4g} | {_interval(law['intervals'].get(key), '.4g')} |")
    residuals = law.get("fit_residuals")
    if residuals:
        lines += ["", f"Against its own fitted rungs the law is off by {100 * residuals['mean_abs']:.2f}% on average "
                      f"(mean |law - measured| / measured) and by {100 * residuals['largest']['relative']:+.2f}% at "
                      f"most ({residuals['largest']['rung']}; seeds are fitted as their mean, each listed against "
                      "it)."]
    lines += ["", "| compute-optimal tokens per parameter | at C | value | interval | Chinchilla |",
              "|---|---|---|---|---|"]
    for label, r in result["compute_optimal"].items():
        value, interval = (r["why"], "-") if r.get("why") else (_value(r["tokens_per_param"], ".1f"),
                                                                 _interval(r["interval"], ".1f"))
        lines.append(f"| {label.replace('_', ' ')} | {r['flops']:.3g} | {value} | {interval} | "
                     f"{r['chinchilla_tokens_per_param']:.0f} |")
    under = next((r["under"] for r in result["compute_optimal"].values() if r.get("under")), None)
    if under:
        lines += ["", f"The law is in steps: its optimum is the recipe's, under {under}."]
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
              f"{error}, interval {100 * lo:+.2f}% .. {100 * hi:+.2f}% of the prediction.", "", *_rung_table(result)]
    return "\n".join(lines) + "\n"


def _rung_table(result: dict) -> List[str]:
    """The report's table of every measured rung, and the rungs not complete."""
    lines = ["| rung | role | N | non-embedding N | D | tokens/param | C | lr | tokens a step | cooldown from | "
              "val loss | (law - val loss) / val loss | train s from step 0 |", "|---" * 13 + "|"]
    for r in result["rungs"]:
        seconds = f"{r['train_seconds']:.0f}" if r.get("train_seconds") is not None else "-"
        error = f"{100 * r['law_relative_error']:+.2f}%" if r.get("law_relative_error") is not None else "-"
        lines.append(f"| {r['name']} | {r['role']} | {r['params']:,} | {r.get('non_embedding_params') or 0:,} | "
                     f"{r['tokens']:,} | {r['tokens_per_param']:.3g} | {r['flops']:.3g} | {r.get('lr') or 0:.3g} | "
                     f"{r.get('tokens_per_step') or 0:,} | {r.get('branch_of') or '-'} | {r['final_val_loss']:.4f} | "
                     f"{error} | {seconds} |")
    if result.get("unfinished_rungs"):
        lines += ["", f"Not complete (not fitted, not measured): {', '.join(result['unfinished_rungs'])}."]
    return lines
