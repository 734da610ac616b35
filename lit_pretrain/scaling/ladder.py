"""`lit-pretrain ladder [GRID.yaml] [--small]` / `make ladder`: train a ladder of rungs (model sizes × token budgets),
fit L(N, D) = E + A/N^alpha + B/D^beta to the rungs below a compute limit, predict the rungs above it, and report.

A grid file is data (yaml.safe_load). Each rung is a normal `lit-pretrain train` run in <root_dir>/<rung name>,
trained in order of compute, in this process, its output in <root_dir>/<rung name>/train.log; the console shows one
line a rung (scaling/ladder_rung.py). The ladder resumes rung by rung: a rung whose summary.json records all its
planned steps and its parameter count is complete (ladder_state.rung_complete) and never trained again; a rung folder
with a checkpoint continues from it (run.resume=auto); a rung folder without one (killed before its first checkpoint)
starts again. SIGINT or SIGTERM stops the whole ladder at the running rung's next checkpoint and prints the command that
continues it; a rung short of its planned steps is never fitted, predicted from or reported as measured. Before the
first held-out rung trains, the law is fitted and its predictions written to prediction.json; the file is kept while
the fitted rungs it came from are unchanged, and written again when they change. The fit, the predictions and the
picture are lit_pretrain/scaling/ladder_report.py.

Compute is C = 6·N·D throughout (N all parameters, D training tokens: Hoffmann et al. 2022 §3.3), so the compute
limit and the law's compute-optimal allocation (eq. 4) count alike; the time estimate uses each rung's
flops_per_token (6N + 12LHQT, PaLM appendix B), closer to what a step costs.
"""

import argparse
import dataclasses
import math
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import yaml

from lit_pretrain.errors import ConfigError, DataError, RunFolderError
from lit_pretrain.scaling import ladder_rules as rules
from lit_pretrain.scaling.ladder_state import (
    LAW_PARAMETERS,
    LadderStopped,
    checkpointed_step,
    duration,
    read_summary,
    rung_complete,
    rung_state,
)

DEFAULT_GRID = Path("experiments") / "ladder" / "default.yaml"
SMALL_GRID = Path("experiments") / "ladder" / "tiny.yaml"


@dataclass
class LadderModel:
    n_layers: int
    """Transformer blocks of this model size."""
    d_model: int
    """Residual stream width."""
    n_heads: int
    """Attention heads (must divide d_model)."""
    tokens_per_param: List[float]
    """This size's token budgets as tokens-per-parameter ratios (N all parameters), one rung each: D = ratio × N
    rounded to whole optimizer steps. Each an integer multiple of the smallest: one WSD run of the largest budget,
    and each smaller budget's cooldown branched from its checkpoint (ladder_rules.budget_steps)."""
    n_kv_heads: Optional[int] = None
    """Key/value heads (grouped-query attention); null: the run file's model.n_kv_heads."""
    d_ff: Optional[int] = None
    """MLP hidden width; null: the run file's model.d_ff."""


@dataclass
class LadderGrid:
    run_file: str
    """Experiment file every rung starts from (data, model family, sequence length), relative to the grid file."""
    models: List[LadderModel]
    """The fitted model sizes, each with its token budgets."""
    held_out: List[LadderModel]
    """Rungs predicted before they train (each a plain WSD run of its one budget), above compute_limit_flops."""
    compute_limit_flops: float
    """Every fitted rung has C = 6·N·D (N all parameters) at or below this; development and held-out rungs above."""
    development: List[LadderModel] = field(default_factory=list)
    """Rungs trained before the prediction, never fitted: the parameter-count convention whose law predicts them
    best (smallest mean |relative error|) is the one prediction.json and the report use."""
    root_dir: str = "runs/ladder"
    """Folder of the rung run folders, prediction.json, report.json, report.md and ladder.png."""
    precision: str = "32-true"
    """trainer.precision of every rung (32-true or bf16-mixed on CPU: the fastest that trains correctly here)."""
    overrides: List[str] = field(default_factory=list)
    """More key=value overrides every rung shares, applied after the run file and before each rung's own."""
    lr_rule: Dict[str, float] = field(default_factory=lambda: {"lr": 3e-3, "params": 1e5, "exponent": -1 / 3})
    """optim.lr_peak = lr·(N/params)^exponent, N non-embedding parameters (ladder_rules; OLMo-core: -1/3)."""
    batch_rule: Dict[str, float] = field(default_factory=lambda: {"sequences": 8, "params": 1e5,
                                                                   "exponent": 2 / 3})
    """Sequences a step = sequences·(N/params)^exponent, rounded (OLMo-core: 2/3); AdamW beta2 follows the batch."""
    warmup_tokens_per_param: float = 1.0
    """Warmup of this many tokens per non-embedding parameter (OLMo-core: N tokens), the same at every budget."""
    cooldown_fraction: float = 0.2
    """Every rung is WSD with a 1-sqrt cooldown over this final fraction of its steps, 1/m (Hägele et al. 2024)."""
    seeds: List[int] = field(default_factory=list)
    """More run.seed values (initialization and data order) for the rungs of models[seeded_model]: the
    seed-to-seed spread of the loss, in the report and in the bootstrap."""
    seeded_model: int = 0
    """Index into models of the size trained with every seed."""
    micro_batch_size: Optional[int] = None
    """trainer.micro_batch_size of every rung (sequences a device a micro-step); null: the whole batch in one (one
    process). With several devices the batch rule's sequences are rounded to sequences_multiple."""
    sequences_multiple: int = 1
    """The batch rule's sequences a step are rounded to a multiple of this (at least one): micro_batch_size × devices
    on a multi-GPU grid, so each step splits evenly."""
    workers: int = 1
    """Rungs trained at the same time, each in its own process (1: one after another, in the ladder's process)."""
    held_out_threads: Optional[int] = None
    """trainer.num_threads of the held-out rungs (null: the run file's). They train alone, after every other rung
    and the prediction (ladder_pool.py), so on a CPU grid of one thread a worker they may take every worker's."""
    checkpoints_per_rung: int = 4
    """Checkpoints written over a rung without branches (an interrupted rung continues from the newest); a run with
    branches checkpoints at every branch step instead, and keeps them all."""
    min_steps: int = 10
    """Refuse a rung of fewer optimizer steps than this."""
    bootstrap: int = 200
    """Bootstrap resamples of the fitted rungs (refitted) for the intervals."""
    bootstrap_method: str = "residuals"
    """residuals: every resample keeps every fitted (N, D) and draws its losses as the fit's plus resampled log
    residuals (a fixed-design residual bootstrap: no size is ever dropped); points: the fitted points drawn with
    replacement (a resample can lose a whole size, and its refit is then unconstrained in N). Both add the seed
    spread (scaling/fit.py bootstrap)."""
    interval: float = 0.9
    """Coverage of the bootstrap percentile intervals (0.9: the 5th to the 95th percentile)."""
    flops_per_second: float = 2.0e10
    """Training FLOPs per second of one worker assumed for the time estimate until the first rung of a call has
    finished (then the measured rate of this call)."""
    gpu: str = ""
    """`--plan --mfu F`: the GPU whose dense bf16 peak the GPU-hours are of (e.g. H200; empty: H100)."""


MODEL_LISTS = ("models", "development", "held_out")
RULE_KEYS = {"lr_rule": ("lr", "params", "exponent"), "batch_rule": ("sequences", "params", "exponent")}
ROLES = {"models": "fit", "development": "dev", "held_out": "held_out"}


def _number(value, key: str, path: Path) -> float:
    # PyYAML reads 1.0e12 without an exponent sign (YAML 1.1) as a string: numbers are converted here.
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{path}: {key}={value!r} is not a number") from None


def _models(data, key: str, path: Path) -> List[LadderModel]:
    if not isinstance(data.get(key), list) or (key != "development" and not data[key]):
        raise ConfigError(f"{path}: {key} must be a{' non-empty' if key != 'development' else ''} list of "
                          "{n_layers, d_model, n_heads, tokens_per_param: [...]}")
    models = []
    for i, m in enumerate(data[key]):
        try:
            ratios = [_number(r, f"{key}[{i}].tokens_per_param", path) for r in m.get("tokens_per_param") or []]
            models.append(LadderModel(**{**m, "tokens_per_param": ratios}))
        except (TypeError, AttributeError) as err:
            raise ConfigError(f"{path}: {key}[{i}]: {err}; a model is {{n_layers, d_model, n_heads, "
                              "tokens_per_param: [ratio, ...]}}") from None
        bad = [k for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff")
               if not (k in ("n_kv_heads", "d_ff") and getattr(models[-1], k) is None)
               and (not isinstance(getattr(models[-1], k), int) or isinstance(getattr(models[-1], k), bool)
                    or getattr(models[-1], k) < 1)]
        if bad:
            raise ConfigError(f"{path}: {key}[{i}].{bad[0]}={getattr(models[-1], bad[0])!r}: expected an integer "
                              ">= 1")
        if not ratios or any(r <= 0 for r in ratios):
            raise ConfigError(f"{path}: {key}[{i}].tokens_per_param must list positive ratios, one per rung")
        if key != "models" and len(ratios) != 1:
            raise ConfigError(f"{path}: {key}[{i}].tokens_per_param: a {key} rung is one plain run: list one ratio")
    return models


def load_grid(path: str | Path) -> LadderGrid:
    """Read and check a grid file; every error names the file and the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"grid file {path} does not exist: pass e.g. {DEFAULT_GRID}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
    names = {f.name for f in dataclasses.fields(LadderGrid)}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of the keys {sorted(names)}")
    unknown = sorted(set(data) - names)
    missing = sorted(n for n in ("run_file", "models", "held_out", "compute_limit_flops") if n not in data)
    if unknown or missing:
        raise ConfigError(f"{path}: unknown keys {unknown} / missing keys {missing}; the keys are {sorted(names)}")
    for key in ("compute_limit_flops", "flops_per_second", "interval", "warmup_tokens_per_param",
                "cooldown_fraction"):
        if key in data:
            data[key] = _number(data[key], key, path)
    for key, fields in RULE_KEYS.items():
        if key in data:
            if not isinstance(data[key], dict) or sorted(data[key]) != sorted(fields):
                raise ConfigError(f"{path}: {key} must be a mapping of exactly {{{', '.join(fields)}}}")
            data[key] = {k: _number(v, f"{key}.{k}", path) for k, v in data[key].items()}
            if not (data[key][fields[0]] > 0 and data[key]["params"] > 0):
                raise ConfigError(f"{path}: {key}: {fields[0]} and params must be positive")
    lists = {key: _models(data, key, path) for key in MODEL_LISTS if key in data}
    grid = LadderGrid(**{**data, **lists, "run_file": str((path.parent / str(data["run_file"])).resolve()),
                         "overrides": [str(o) for o in data.get("overrides") or []],
                         "seeds": list(data.get("seeds") or [])})
    checks = (("compute_limit_flops", grid.compute_limit_flops > 0, "a positive FLOP count"),
              ("precision", grid.precision in ("32-true", "bf16-mixed", "16-mixed", "bf16-true"),
               "one of 32-true, bf16-mixed, 16-mixed, bf16-true"),
              ("warmup_tokens_per_param", grid.warmup_tokens_per_param > 0, "positive"),
              ("cooldown_fraction", 0 < grid.cooldown_fraction < 1, "1/m for an integer m >= 2"),
              ("seeds", all(isinstance(x, int) and not isinstance(x, bool) for x in grid.seeds)
               and len(set(grid.seeds)) == len(grid.seeds), "a list of distinct integers"),
              ("seeded_model", isinstance(grid.seeded_model, int) and 0 <= grid.seeded_model < len(grid.models),
               f"an index into models (0..{len(grid.models) - 1})"),
              ("workers", isinstance(grid.workers, int) and grid.workers >= 1, "an integer >= 1"),
              ("held_out_threads", grid.held_out_threads is None or isinstance(grid.held_out_threads, int)
               and grid.held_out_threads >= 1, "null or an integer >= 1"),
              ("micro_batch_size", grid.micro_batch_size is None or isinstance(grid.micro_batch_size, int)
               and grid.micro_batch_size >= 1, "null or an integer >= 1"),
              ("sequences_multiple", isinstance(grid.sequences_multiple, int) and grid.sequences_multiple >= 1,
               "an integer >= 1"),
              ("checkpoints_per_rung", isinstance(grid.checkpoints_per_rung, int) and grid.checkpoints_per_rung >= 1,
               "an integer >= 1"),
              ("min_steps", isinstance(grid.min_steps, int) and grid.min_steps >= 1, "an integer >= 1"),
              ("bootstrap", isinstance(grid.bootstrap, int) and grid.bootstrap >= 2, "an integer >= 2"),
              ("bootstrap_method", grid.bootstrap_method in ("residuals", "points"), "residuals or points"),
              ("interval", 0 < grid.interval < 1, "in (0, 1)"),
              ("flops_per_second", grid.flops_per_second > 0, "positive"))
    for key, ok, rule in checks:
        if not ok:
            raise ConfigError(f"{path}: {key}={getattr(grid, key)!r}: expected {rule}")
    try:
        rules.cooldown_parts(grid.cooldown_fraction)
    except ValueError as err:
        raise ConfigError(f"{path}: {err}") from None
    if not Path(grid.run_file).is_file():
        raise ConfigError(f"{path}: run_file={data['run_file']!r}: no such file (resolved to {grid.run_file})")
    return grid


def rung_recipe(grid: LadderGrid, non_embedding: int, seq_len: int) -> dict:
    """The rules' learning rate, batch, beta2 and warmup of a model of `non_embedding` parameters."""
    lr, batch = grid.lr_rule, grid.batch_rule
    sequences = rules.sequences_per_step(non_embedding, batch["sequences"], batch["params"], batch["exponent"])
    sequences = max(1, round(sequences / grid.sequences_multiple)) * grid.sequences_multiple
    tokens_per_step = sequences * seq_len
    return {"lr": rules.scaled(lr["lr"], non_embedding, lr["params"], lr["exponent"]), "sequences": sequences,
            "tokens_per_step": tokens_per_step, "beta2": rules.beta2_for(tokens_per_step),
            "warmup_steps": rules.warmup_steps_for(non_embedding, tokens_per_step, grid.warmup_tokens_per_param)}


def plan_rungs(grid: LadderGrid, path: Path) -> List[dict]:
    """Every rung of the grid in training order (each run with branches before them; held-out rungs last): name,
    shape, N (all, non-embedding, head), recipe, steps, D, C = 6·N·D, flops_per_token, role, seed, branch."""
    from lit_pretrain import config as config_lib
    from lit_pretrain.model import shapes

    c = config_lib.to_object(config_lib.load(grid.run_file, grid.overrides))
    base = dataclasses.replace(c.model, vocab_size=c.model.vocab_size or c.data.vocab_size)
    rungs = []
    for key in MODEL_LISTS:
        for i, m in enumerate(getattr(grid, key)):
            cfg = dataclasses.replace(shapes.with_shape(base, m.n_layers, m.d_model, m.n_heads),
                                      **{k: getattr(m, k) for k in ("n_kv_heads", "d_ff") if getattr(m, k)})
            try:
                cfg.check()
            except ValueError as err:
                raise ConfigError(f"{path}: {key}[{i}]: {err}") from None
            n, non_embedding, fpt = shapes.params(cfg), shapes.non_embedding_params(cfg), shapes.flops_per_token(cfg)
            recipe = rung_recipe(grid, non_embedding, base.seq_len)
            try:
                budgets = rules.budget_steps(m.tokens_per_param, n, recipe["tokens_per_step"], grid.cooldown_fraction)
            except ValueError as err:
                raise ConfigError(f"{path}: {key}[{i}].{err}") from None
            longest = max(steps for steps, _ in budgets)
            first_cooldown = min(branch for _, branch in budgets)
            if recipe["warmup_steps"] > first_cooldown:
                raise ConfigError(f"{path}: {key}[{i}]: warmup of {recipe['warmup_steps']} steps "
                                  f"(warmup_tokens_per_param={grid.warmup_tokens_per_param:g} × {non_embedding:,}) "
                                  f"runs into the smallest budget's cooldown at step {first_cooldown}: raise its "
                                  "tokens_per_param or lower warmup_tokens_per_param")
            seeds = [None, *grid.seeds] if key == "models" and i == grid.seeded_model else [None]
            for seed in seeds:
                tail = "" if seed is None else f"_seed{seed}"
                stem = f"L{m.n_layers}_d{m.d_model}_tpp{max(m.tokens_per_param):g}{tail}"
                for ratio, (steps, branch_step) in zip(m.tokens_per_param, budgets):
                    name = f"L{m.n_layers}_d{m.d_model}_tpp{ratio:g}{tail}"
                    if steps < grid.min_steps:
                        raise ConfigError(f"{path}: {key}[{i}].tokens_per_param: rung {name} would train {steps} "
                                          f"steps ({recipe['tokens_per_step']:,} tokens a step), under min_steps="
                                          f"{grid.min_steps}: raise the ratio or lower min_steps")
                    d = steps * recipe["tokens_per_step"]
                    is_stem = steps == longest
                    every = budgets[[s for s, _ in budgets].index(min(s for s, _ in budgets))][1] \
                        if is_stem and len(budgets) > 1 else max(1, math.ceil(steps / grid.checkpoints_per_rung))
                    rungs.append({
                        "name": name, "shape": {"n_layers": m.n_layers, "d_model": m.d_model, "n_heads": m.n_heads,
                                                **{k: getattr(m, k) for k in ("n_kv_heads", "d_ff") if getattr(m, k)}},
                        "params": n, "non_embedding_params": non_embedding, "head_params": base.vocab_size * m.d_model,
                        "tied": bool(base.tie_embeddings), "steps": steps, "tokens": d, "tokens_per_param": d / n,
                        "flops": 6.0 * n * d, "flops_per_token": fpt, "train_flops": float(fpt * d),
                        **recipe, "checkpoint_every": every, "keep_checkpoints": 0 if is_stem and len(budgets) > 1
                        else 1, "role": ROLES[key], "seed": seed, "branch_of": None if is_stem else stem,
                        "branch_step": None if is_stem else branch_step,
                        "train_flops_own": float(fpt * (steps if is_stem else steps - branch_step)
                                                 * recipe["tokens_per_step"])})
    names = [r["name"] for r in rungs]
    twice = sorted({x for x in names if names.count(x) > 1})
    if twice:
        raise ConfigError(f"{path}: models: rungs {twice} appear twice (same shape and tokens_per_param)")
    check_fittable(rungs, grid, path)
    flops = {r["name"]: r["flops"] for r in rungs}
    # a run before its branches; the held-out rungs after every other (prediction.json is written between)
    return sorted(rungs, key=lambda r: (r["role"] == "held_out", flops[r["branch_of"] or r["name"]],
                                        r["branch_of"] is not None, r["flops"], r["name"]))


def check_fittable(rungs: List[dict], grid: LadderGrid, path: Path) -> None:
    """Refuse, before anything runs, a grid whose fitted rungs cannot determine the law or that predicts nothing."""
    fit = [r for r in rungs if r["role"] == "fit"]
    limit = f"compute_limit_flops={grid.compute_limit_flops:.3g}"
    over = [r["name"] for r in fit if r["flops"] > grid.compute_limit_flops]
    if over:
        raise ConfigError(f"{path}: {limit}: the fitted rungs {over} lie above it: lower their budgets or raise it")
    under = [r["name"] for r in rungs if r["role"] != "fit" and r["flops"] <= grid.compute_limit_flops]
    if under:
        raise ConfigError(f"{path}: {limit}: the development or held-out rungs {under} lie at or below it: nothing "
                          "would be predicted beyond the fitted compute; lower the limit or enlarge them")
    points = {(r["params"], r["tokens"]) for r in fit}
    if len(points) < LAW_PARAMETERS + 1:
        raise ConfigError(f"{path}: models: {len(points)} fitted (N, D) points, but L(N, D) has {LAW_PARAMETERS} "
                          f"free parameters and needs at least {LAW_PARAMETERS + 1}: add sizes or token budgets "
                          "(models[].tokens_per_param)")
    if len({r["params"] for r in fit}) < 2:
        raise ConfigError(f"{path}: models: the fitted rungs have one model size only; the law needs at least 2 "
                          "sizes to separate A/N^alpha from B/D^beta")
    if len({r["tokens"] for r in fit}) < 2:
        raise ConfigError(f"{path}: models[].tokens_per_param: the fitted rungs have one token count only; the law "
                          "needs at least 2")


def estimate_seconds(rungs: List[dict], flops_per_second: float, workers: int = 1) -> float:
    """Seconds to train `rungs` with `workers` at flops_per_second each: the rungs before the prediction shared
    out, then the held-out ones (at least the longest of them)."""
    own = [r["train_flops_own"] for r in rungs if r["role"] != "held_out"]
    held = [r["train_flops_own"] for r in rungs if r["role"] == "held_out"]
    return (sum(own) / workers + max(sum(held) / workers, max(held, default=0.0))) / flops_per_second


def run_ladder(grid_file: str | Path, max_rungs: Optional[int] = None, plan_only: bool = False,
               log: Callable = print, command: Optional[str] = None, mfu: Optional[float] = None) -> Optional[dict]:
    """Train every unfinished rung (at most `max_rungs` in this call), then fit, predict and write the report.
    `log(text, end="\n")` prints like print (a rung's line is begun before it trains and ended after). `command`:
    the command line that continues the ladder, printed when a signal stops it (LadderStopped is raised then)."""
    path = Path(grid_file)
    command = command or f"lit-pretrain ladder {shlex.quote(str(path))}"
    grid = load_grid(path)
    rungs = plan_rungs(grid, path)
    fitted = [r for r in rungs if r["role"] == "fit"]
    held = [r for r in rungs if r["role"] == "held_out"]
    largest = max(r["flops"] for r in fitted)
    own = sum(r["train_flops_own"] for r in rungs)
    log(f"ladder {path}: {len(rungs)} rungs ({len(fitted)} fitted at C <= {grid.compute_limit_flops:.3g} FLOPs, "
        f"{sum(r['role'] == 'dev' for r in rungs)} development, {len(held)} held out, the largest at "
        f"{max(r['flops'] for r in held) / largest:.1f}x the largest fitted compute), {own:.3g} training FLOPs "
        f"(branched cooldowns train only their own steps); estimated "
        f"{duration(estimate_seconds(rungs, grid.flops_per_second, grid.workers))} at "
        f"{grid.flops_per_second:.3g} FLOP/s a worker, {grid.workers} worker(s)")
    for r in rungs:
        branch = f"  from {r['branch_of']} at step {r['branch_step']}" if r["branch_of"] else ""
        log(f"  {r['name']:<18} {r['role']:<8} N {r['params']:>11,} (non-embedding {r['non_embedding_params']:,})  "
            f"steps {r['steps']:>6}  D {r['tokens']:>13,}  tokens_per_param {r['tokens_per_param']:>6.3g}  "
            f"C {r['flops']:.3g}  lr {r['lr']:.3g}  batch {r['sequences']}x{r['tokens_per_step'] // r['sequences']}"
            f"  beta2 {r['beta2']}  warmup {r['warmup_steps']}{branch}")
    if mfu is not None:
        log(gpu_hours_line(own, mfu, grid.gpu))
    if plan_only:
        return None
    from lit_pretrain.scaling.ladder_rung import LadderSignals  # imports Lightning: not for --plan

    log(f"each rung's output: {Path(grid.root_dir) / '<rung>' / 'train.log'}")
    signals = LadderSignals().install()
    try:
        if grid.workers > 1:
            from lit_pretrain.scaling.ladder_pool import train_parallel

            fitted = train_parallel(grid, path, rungs, max_rungs, log, signals, command)
        else:
            fitted = _train_rungs(grid, rungs, max_rungs, log, signals, command)
        if fitted is False:
            return None
        from lit_pretrain.scaling.ladder_report import report, write_prediction

        # every rung is complete now: a prediction.json from other fitted losses is written again before reporting
        fitted = write_prediction(grid, rungs, log, fitted)
        return report(grid, path, rungs, log=log, fitted=fitted)
    finally:
        signals.uninstall()


def _train_rungs(grid: LadderGrid, rungs: List[dict], max_rungs: Optional[int], log: Callable, signals,
                 command: str):
    """The loop of run_ladder: the fit write_prediction made in this call (or None), or False where --max-rungs
    stopped it; LadderStopped where a signal did."""
    from lit_pretrain.scaling.ladder_rung import RungOutput, train_rung

    root = Path(grid.root_dir)
    started, trained, done_flops, fitted = time.perf_counter(), 0, 0.0, None

    def stop(where: str):
        log(f"ladder stopped by {signals.name} {where}; continue with: {command}")
        raise LadderStopped(signals.signum)

    for k, rung in enumerate(rungs, start=1):
        folder = root / rung["name"]
        state = rung_state(folder, rung)
        head = f"rung {k} of {len(rungs)} {rung['name']} ({rung['role']}, C {rung['flops']:.3g})"
        if state == "finished":
            log(f"{head}: finished earlier, val loss {read_summary(folder)['final_val_loss']:.4f}, not trained again")
            continue
        if signals.signum is not None:
            stop(f"before rung {k} of {len(rungs)} {rung['name']}")
        if max_rungs is not None and trained >= max_rungs:
            log(f"stopping after {trained} rungs (--max-rungs {max_rungs}): run the same command again to continue")
            return False
        if rung["role"] == "held_out":
            from lit_pretrain.scaling.ladder_report import write_prediction

            # every fitted rung is complete (rungs run in order of compute): predict before training this one
            fitted = write_prediction(grid, rungs, log, fitted)
        resumed = f"resumed from step {checkpointed_step(folder)}, " if state == "partial" else ""
        log(f"{head}: ", end="")
        rung_started = time.perf_counter()
        output = RungOutput(root, folder)
        try:
            summary = train_rung(grid, rung, signals, output)
        except BaseException as err:
            # A signal during the rung's start or final validation (Lightning's own SIGTERM handling raises
            # SIGTERMException there): the rung's checkpoints stand, the next call continues from them.
            if signals.signum is not None and not isinstance(err, KeyboardInterrupt):
                log(f"stopped by {signals.name} before its next checkpoint (log {folder / 'train.log'})")
                stop(f"in rung {k} of {len(rungs)} {rung['name']}")
            log(f"failed: {type(err).__name__} (its output: {'below' if output.unplaced else folder / 'train.log'})")
            if output.unplaced:  # refused before its folder was made: no log holds these lines
                log(output.unplaced.rstrip("\n"))
            raise
        trained += 1
        if not rung_complete(summary, rung):
            log(f"stopped by {signals.name} with its checkpoint of step {checkpointed_step(folder)} of "
                f"{rung['steps']}; not fitted or reported until it is complete")
            stop(f"in rung {k} of {len(rungs)} {rung['name']}")
        # a resumed rung trained only its remaining part in this call
        share = summary["session_train_seconds"] / summary["train_seconds"] if summary.get("train_seconds") else 1.0
        done_flops += rung["train_flops_own"] * min(1.0, share)
        elapsed = time.perf_counter() - started
        rate = done_flops / elapsed if done_flops > 0 else grid.flops_per_second
        left = [r for r in rungs[k:] if rung_state(root / r["name"], r) != "finished"]
        log(f"{resumed}val loss {summary['final_val_loss']:.4f} in {duration(time.perf_counter() - rung_started)}; "
            f"elapsed {duration(elapsed)}, estimated time left {duration(estimate_seconds(left, rate))} "
            f"({rate:.3g} FLOP/s so far)")
        if signals.signum is not None:  # it reached the rung as its last step was done
            stop(f"after rung {k} of {len(rungs)} {rung['name']}")
    return fitted


def gpu_hours_line(train_flops: float, mfu: float, gpu: str) -> str:
    """The grid's GPU-hours at `mfu` of the GPU's dense bf16 peak (scaling/gpu_hours.py)."""
    from lit_pretrain.callbacks.throughput import GPU_PEAK_FLOPS
    from lit_pretrain.scaling.gpu_hours import format_gpu_hours, gpu_hours

    gpu = gpu or "H100"
    peak = next((peaks["half"] for name, peaks in GPU_PEAK_FLOPS if name.lower() in gpu.lower()), None)
    if peak is None:
        raise ConfigError(f"gpu={gpu}: no datasheet peak for it; one of {', '.join(n for n, _ in GPU_PEAK_FLOPS)}")
    return (f"{train_flops:.3g} training FLOPs (6N + attention, PaLM appendix B; branched cooldowns once):"
            + format_gpu_hours(gpu_hours(train_flops, mfu, peak), mfu, gpu, peak, "--mfu").removeprefix(" "))


def _print(text: str = "", end: str = "\n") -> None:
    print(text, end=end, flush=True)


def ladder_parser() -> argparse.ArgumentParser:
    """`lit-pretrain ladder`'s arguments (tests/test_docs.py parses the documented commands with it)."""
    parser = argparse.ArgumentParser(prog="lit-pretrain ladder", description=__doc__.split("\n\n")[0])
    parser.add_argument("grid", nargs="?", help=f"grid file (default {DEFAULT_GRID}; --small: {SMALL_GRID})")
    parser.add_argument("--small", action="store_true", help=f"the small grid of seconds-long rungs ({SMALL_GRID})")
    parser.add_argument("--max-rungs", type=int, help="train at most this many rungs in this call, then stop")
    parser.add_argument("--plan", action="store_true", help="print the rungs and the time estimate; train nothing")
    parser.add_argument("--mfu", type=float, help="with --plan: print the grid's GPU-hours at this model FLOPs "
                        "utilization (e.g. 0.4) of the grid's gpu (its dense bf16 peak)")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ladder_parser().parse_args(argv)
    if args.mfu is not None and not args.plan:
        print("lit-pretrain ladder: error: --mfu goes with --plan (it prints the grid's GPU-hours)", file=sys.stderr)
        return 2
    grid = args.grid or (SMALL_GRID if args.small else DEFAULT_GRID)
    command = " ".join(["lit-pretrain", "ladder", *map(shlex.quote, argv)])
    try:
        run_ladder(grid, max_rungs=args.max_rungs, plan_only=args.plan, log=_print, command=command, mfu=args.mfu)
    except (ConfigError, DataError, RunFolderError) as err:
        print(f"lit-pretrain ladder: error: {err}", file=sys.stderr)
        return 2
    except LadderStopped as stopped:
        # 128 + the signal, as a shell reports a process ended by it (130 for Ctrl-C); SIGTERM's where the run's own
        # handler took the signal
        return 128 + (stopped.signum or signal.SIGTERM)
    except KeyboardInterrupt:
        print(f"\nlit-pretrain ladder: stopped at once by a second Ctrl-C; continue with: {command}", flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
