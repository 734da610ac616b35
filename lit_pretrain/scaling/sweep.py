"""`make sweep`: train an isoFLOP grid, fit the scaling law, write down its prediction for a larger held-out run,
train that run, and report the prediction error.

Runs are resumable: a run whose summary.json exists with the planned steps and shape is reused, never retrained or
overwritten; a run folder without a summary (an interrupted run) is trained again from the start.
"""

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import yaml

from lit_pretrain.errors import ConfigError
from lit_pretrain.model import shapes
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.runs.state import is_finished


@dataclass
class ModelShape:
    n_layers: int
    """Transformer blocks."""
    d_model: int
    """Residual stream width."""
    n_heads: int
    """Attention heads (must divide d_model)."""


@dataclass
class HeldOut(ModelShape):
    flops: float = 0.0
    """Training FLOPs of the held-out run (larger than every grid budget)."""


@dataclass
class SweepConfig:
    run_file: str
    """Experiment file every run starts from (data, optimizer, batch, sequence length)."""
    root_dir: str
    """Folder of the sweep's run folders, law.json, plots and report.json."""
    budgets_flops: List[float]
    """Compute budgets of the isoFLOP grid, in training FLOPs (flops_per_token × tokens)."""
    models: List[ModelShape]
    """The ladder of model shapes tried at each budget."""
    held_out: HeldOut
    """The run predicted from the fitted law and trained afterwards."""
    min_steps: int = 40
    """Skip a (budget, model) pair that would train for fewer optimizer steps than this."""
    max_tokens_per_param: float = 300.0
    """Skip a (budget, model) pair whose tokens-per-parameter ratio would exceed this."""
    warmup_fraction: float = 0.1
    """Learning rate warmup as a fraction of each run's steps (the cosine decay fills the rest)."""
    bootstrap: int = 200
    """Bootstrap resamples for the confidence intervals of the fitted law."""
    runs: List[dict] = field(default_factory=list, init=False)


def load_sweep(path: str | Path) -> SweepConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file {path} does not exist: pass e.g. experiments/sweep/cpu/sweep.yaml")
    data = yaml.safe_load(path.read_text()) or {}
    names = {f.name for f in dataclasses.fields(SweepConfig) if f.init}
    unknown = sorted(set(data) - names)
    missing = sorted(n for n in ("run_file", "root_dir", "budgets_flops", "models", "held_out") if n not in data)
    if unknown or missing:
        raise ConfigError(f"{path}: unknown keys {unknown} / missing keys {missing}; the keys are {sorted(names)}")
    try:
        # PyYAML reads 3.0e11 (no exponent sign, YAML 1.1) as a string: numbers are converted here.
        data["budgets_flops"] = [float(b) for b in data["budgets_flops"]]
        data["held_out"] = {**data["held_out"], "flops": float(data["held_out"].get("flops", 0))}
        data["models"] = [ModelShape(**m) for m in data["models"]]
        data["held_out"] = HeldOut(**data["held_out"])
        cfg = SweepConfig(**data)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{path}: {err}; a model is {{n_layers, d_model, n_heads}}, held_out adds flops") from None
    if not cfg.budgets_flops or any(b <= 0 for b in cfg.budgets_flops):
        raise ConfigError(f"{path}: budgets_flops must be a non-empty list of positive FLOP counts")
    if cfg.held_out.flops <= max(cfg.budgets_flops):
        raise ConfigError(f"{path}: held_out.flops={cfg.held_out.flops:.3g} must exceed every grid budget "
                          f"(largest {max(cfg.budgets_flops):.3g}) so the prediction extrapolates")
    return cfg


def _base_model(sweep: SweepConfig, overrides=()) -> tuple:
    from lit_pretrain import config as config_lib

    c = config_lib.load(sweep.run_file, list(overrides))
    tokens_per_step = c.trainer.tokens_per_step or c.trainer.micro_batch_size * c.model.seq_len
    vocab = c.model.vocab_size or c.data.vocab_size  # the sweep's tokenizer is trained to exactly data.vocab_size
    return dataclasses.replace(c.model, vocab_size=vocab), tokens_per_step


def plan_run(model: GPTConfig, shape: ModelShape, flops: float, tokens_per_step: int, warmup_fraction: float,
             prefix: str) -> dict:
    cfg = shapes.with_shape(model, shape.n_layers, shape.d_model, shape.n_heads)
    cfg.check()
    fpt = shapes.flops_per_token(cfg)
    steps = max(1, round(flops / (fpt * tokens_per_step)))
    n = shapes.params(cfg)
    return {"name": f"{prefix}_L{shape.n_layers}_d{shape.d_model}", "shape": dataclasses.asdict(shape),
            "budget_flops": flops, "params": n, "flops_per_token": fpt, "steps": steps,
            "tokens": steps * tokens_per_step, "tokens_per_param": steps * tokens_per_step / n,
            "warmup_steps": max(1, round(warmup_fraction * steps))}


def plan_grid(sweep: SweepConfig, model: GPTConfig, tokens_per_step: int) -> List[dict]:
    grid = []
    for budget in sweep.budgets_flops:
        for shape in sweep.models:
            run = plan_run(model, shape, budget, tokens_per_step, sweep.warmup_fraction, _budget_tag(budget))
            if run["steps"] >= sweep.min_steps and run["tokens_per_param"] <= sweep.max_tokens_per_param:
                grid.append(run)
    return grid


def _budget_tag(flops: float) -> str:
    mantissa, exponent = f"{flops:.1e}".split("e")
    return f"c{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def train_run(sweep: SweepConfig, run: dict, log: Callable = print) -> dict:
    """Train one planned run (or reuse its finished summary); return the summary."""
    folder = Path(sweep.root_dir) / run["name"]
    summary_path = folder / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    if summary is not None and not is_finished(summary):
        raise ConfigError(f"{folder} holds a run that is {summary.get('status')} at step {summary.get('steps')} of "
                          f"{summary.get('max_steps')} (summary.json): finish it with `lit-pretrain train "
                          f"{folder / 'config.yaml'} run.resume=auto`, or move the folder away; a sweep never "
                          "fits a partial run")
    if summary is not None:
        if summary.get("steps") == run["steps"] and summary.get("params") == run["params"]:
            log(f"reuse {run['name']}: val loss {summary['final_val_loss']:.4f}")
            return summary
        raise ConfigError(f"{folder} holds a finished run with other steps or shape than the sweep plans: move it "
                          f"away or change root_dir in the sweep file (it is never overwritten)")
    from lit_pretrain import config as config_lib
    from lit_pretrain.train import train

    shape = run["shape"]
    overrides = [f"run.name={run['name']}", f"run.root_dir={sweep.root_dir}", f"trainer.max_steps={run['steps']}",
                 f"schedule.warmup_steps={run['warmup_steps']}", f"model.n_layers={shape['n_layers']}",
                 f"model.d_model={shape['d_model']}", f"model.n_heads={shape['n_heads']}",
                 # an interrupted run (folder without summary.json) starts again from scratch
                 f"run.overwrite={str(folder.exists()).lower()}"]
    log(f"train {run['name']}: {run['params']:,} params, {run['steps']} steps, {run['tokens']:,} tokens, "
        f"tokens_per_param {run['tokens_per_param']:.1f}")
    return train(config_lib.load(sweep.run_file, overrides))


def run_sweep(sweep_file: str, stage: str = "all", log: Callable = print) -> Optional[dict]:
    """stage: "plan" (print the grid), "grid" (train the grid only) or "all" (grid, fit, predict, held-out)."""
    sweep = load_sweep(sweep_file)
    model, tokens_per_step = _base_model(sweep)
    grid = plan_grid(sweep, model, tokens_per_step)
    held = plan_run(model, sweep.held_out, sweep.held_out.flops, tokens_per_step, sweep.warmup_fraction, "heldout")
    total = sum(r["budget_flops"] for r in grid)
    log(f"{len(grid)} grid runs, {total:.3g} FLOPs; held-out {held['name']} {held['params']:,} params, "
        f"{held['steps']} steps, {sweep.held_out.flops:.3g} FLOPs")
    for run in grid:
        log(f"  {run['name']:<22} params {run['params']:>9,}  steps {run['steps']:>5}  "
            f"tokens_per_param {run['tokens_per_param']:>6.1f}")
    if stage == "plan":
        return None
    root = Path(sweep.root_dir)
    started = time.perf_counter()
    for run in grid:
        train_run(sweep, run, log)
    if stage == "grid":
        return None

    from lit_pretrain.scaling.fit_runs import fit_sources

    grid_dirs = [root / r["name"] for r in grid]
    law = fit_sources([str(d) for d in grid_dirs], out=root / "law.json", plots_dir=root / "plots",
                              bootstrap=sweep.bootstrap, log=log)
    prediction = _predict(law, held)
    prediction_path = root / "prediction.json"
    if prediction_path.is_file():  # keep the first prediction: it was written before the held-out run was trained
        prediction = json.loads(prediction_path.read_text())
    else:
        prediction_path.write_text(json.dumps(prediction, indent=2) + "\n")
    log(f"predicted validation loss of {held['name']}: {prediction['predicted_loss']:.4f} "
        f"(bootstrap 90% interval {prediction['predicted_loss_interval']})")
    summary = train_run(sweep, held, log)
    actual = summary["final_val_loss"]
    error = (prediction["predicted_loss"] - actual) / actual
    report = {"held_out": held, "predicted_loss": prediction["predicted_loss"],
              "predicted_loss_interval": prediction["predicted_loss_interval"], "actual_loss": actual,
              "relative_error": error, "goal": "|relative_error| <= 0.03",
              "law": {k: v for k, v in law["chinchilla"].items() if k != "bootstrap_samples"},
              "grid_runs": len(grid), "grid_flops": total, "wall_seconds_this_call": time.perf_counter() - started}
    (root / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"held-out {held['name']}: predicted {prediction['predicted_loss']:.4f}, measured {actual:.4f}, "
        f"relative error {100 * error:+.2f}% (goal within ±3%); report in {root / 'report.json'}")
    return report


def _predict(law: dict, held: dict) -> dict:
    """The held-out run's loss from the fitted law and its bootstrap 90% interval (ladder_report.predict, the
    ladder's own prediction, so both tools report the same interval)."""
    from lit_pretrain.planning.laws import ParametricLaw
    from lit_pretrain.scaling.ladder.report import predict

    samples = [ParametricLaw.from_dict(s) for s in law["chinchilla"].get("bootstrap_samples") or []]
    p = predict(ParametricLaw.from_dict(law["chinchilla"]), samples, held["params"], held["tokens"], 0.9)
    return {"run": held["name"], "params": held["params"], "tokens": held["tokens"],
            "predicted_loss": p["predicted_loss"], "predicted_loss_interval": p["interval"],
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_pretrain.scaling.sweep", description=__doc__)
    parser.add_argument("sweep_file", nargs="?", default="experiments/sweep/cpu/sweep.yaml")
    parser.add_argument("--stage", choices=["plan", "grid", "all"], default="all")
    args = parser.parse_args(argv)
    run_sweep(args.sweep_file, args.stage)


if __name__ == "__main__":
    main()
