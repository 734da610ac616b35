"""A ladder's grid file and its rungs: the grid (data: yaml.safe_load, each key checked with an error naming it),
the rules' recipe of each rung (rules.py), every rung planned before anything runs (shape, N, budgets and
branch steps, C = 6·N·D, role), a grid that cannot fit refused, and the time estimate. No training here: `lit-pretrain
ladder --plan` and worker.py read it, run.py trains what it plans.
"""

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from lit_pretrain.errors import ConfigError
from lit_pretrain.scaling.ladder import rules
from lit_pretrain.scaling.ladder.state import LAW_PARAMETERS

DEFAULT_GRID = Path("experiments") / "ladder" / "long_steps.yaml"
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
    and the prediction (pool.py), so on a CPU grid of one thread a worker they may take every worker's."""
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
    law_variables: List[str] = field(default_factory=lambda: ["tokens"])
    """What the law's second variable counts: tokens (D, the anchors' L(N, D)) and/or steps (optimizer steps S of
    each rung, L(N, S) = E + A/N^alpha + B/S^beta). With both, each N convention is fitted in each, side by side, and
    the development rung chooses among them all. Tokens a step grow with N by the batch rule, so a law in steps is
    a law in tokens whose D term grows with N (docs/performance.md, the fourth grid)."""
    interval: float = 0.9
    """Coverage of the bootstrap percentile intervals (0.9: the 5th to the 95th percentile)."""
    flops_per_second: float = 2.0e10
    """Training FLOPs per second of one worker assumed for the time estimate until the first rung of a call has
    finished (then the measured rate of this call)."""
    gpu: str = ""
    """`--plan --mfu F`: the GPU whose dense bf16 peak the GPU-hours are of (e.g. H200; empty: H100)."""


MODEL_LISTS = ("models", "development", "held_out")
LAW_VARIABLES = ("tokens", "steps")
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
              ("law_variables", isinstance(grid.law_variables, list) and grid.law_variables
               and all(v in LAW_VARIABLES for v in grid.law_variables)
               and len(set(grid.law_variables)) == len(grid.law_variables),
               f"a list of distinct names from {list(LAW_VARIABLES)}"),
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

    c = config_lib.load(grid.run_file, grid.overrides)
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
                        "vocab_size": base.vocab_size,
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


def estimate_seconds(rungs: List[dict], flops_per_second: float, workers: int = 1, held_out_threads: int = 1) -> float:
    """Seconds to train `rungs` with `workers` at flops_per_second each: the rungs before the prediction shared
    out, then the held-out ones one after another, each alone (pool.py), on `held_out_threads` threads counted
    at that many one-thread workers' rate (the fourth CPU grid's held-out rung: 1.1e11 FLOP/s on two threads, the
    workers 5.5e10 on one each)."""
    own = [r["train_flops_own"] for r in rungs if r["role"] != "held_out"]
    held = [r["train_flops_own"] for r in rungs if r["role"] == "held_out"]
    return (sum(own) / workers + sum(held) / held_out_threads) / flops_per_second
