"""`lit-pretrain fit | plan | memory`: parse, call one function, print a table or JSON."""

import argparse
import json
import sys
from pathlib import Path

from lit_pretrain.errors import ConfigError, DataError
from lit_pretrain.model.shapes import VARIANT_KEYS, VARIANT_TYPES
from lit_pretrain.planning.laws import PUBLISHED
from lit_pretrain.planning.memory import CHECKPOINTING, PRECISIONS

COMMANDS = ("fit", "plan", "memory")
_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def count(text: str) -> float:
    """'7e9', '7B', '1.4T', '500M' -> a number."""
    raw = text.strip().upper()
    scale = _SUFFIX.get(raw[-1:], None)
    try:
        return float(raw[:-1]) * scale if scale else float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count: write e.g. 7e9, 7B, 1.4T") from None


VARIANT_HELP = (f"a model variant key of the architecture table ({', '.join(VARIANT_KEYS)}), e.g. n_kv_heads=2; "
                "repeatable. With --params the searched shapes keep n_kv_heads key/value heads")


def variant(pairs) -> "GPTConfig":  # noqa: F821
    """The GPTConfig of `--model KEY=VALUE` pairs (shape fields left at their defaults, replaced by the caller)."""
    import dataclasses

    import yaml

    from lit_pretrain.model.config import GPTConfig

    values = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or key not in VARIANT_KEYS:
            raise ConfigError(f"--model {pair!r}: expected KEY=VALUE with KEY one of {', '.join(VARIANT_KEYS)}")
        value = yaml.safe_load(raw)
        types, nullable = VARIANT_TYPES[key]
        bad_type = isinstance(value, bool) and types is not bool
        if (value is None and not nullable) or (value is not None and (bad_type or not isinstance(value, types))):
            raise ConfigError(f"--model {pair!r}: {key} takes a value of type "
                              f"{getattr(types, '__name__', 'number')}{' or null' if nullable else ''}")
        values[key] = value
    for f in dataclasses.fields(GPTConfig):
        value, meta = values.get(f.name), f.metadata
        if value is None:
            continue
        if "choices" in meta and value not in meta["choices"]:
            raise ConfigError(f"--model {f.name}={value!r}: expected one of {meta['choices']}")
        if ("ge" in meta and value < meta["ge"]) or ("gt" in meta and value <= meta["gt"]):
            raise ConfigError(f"--model {f.name}={value!r}: expected a value "
                              f"{'>= ' + str(meta['ge']) if 'ge' in meta else '> ' + str(meta['gt'])}")
    try:
        return GPTConfig(**values)
    except TypeError as err:  # a model.moe mapping with a key MoEConfig lacks
        raise ConfigError(f"--model moe=...: {err}; keys: see model.moe in lit_pretrain/model/config.py") from None


def _dense_search(template, params) -> None:
    if params is not None and template.moe is not None:
        raise ConfigError("--params searches dense shapes (parameters linear in depth): with --model moe=... give "
                          "--layers, --hidden and --heads")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lit-pretrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    fit = sub.add_parser("fit", help="fit L(N, D) and the compute frontier to runs or a CSV",
                         description="Fit L(N, D) = E + A/N^alpha + B/D^beta (Hoffmann et al. 2022, approach 3) "
                                     "and power laws of the compute frontier; write the law as JSON and plots.")
    fit.add_argument("sources", nargs="+", help="run folders (runs/<name>), folders of runs, or CSV files with "
                                                "columns N (or params, Model Size), D or C, loss")
    fit.add_argument("--out", default="law.json", help="law file to write (default law.json)")
    fit.add_argument("--plots", default=None, help="folder for the PNG plots (default: plots/ beside --out)")
    fit.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for intervals (0: none)")
    fit.add_argument("--drop-highest", type=int, default=0, help="leave out this many highest-loss points")
    fit.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resamples")

    plan = sub.add_parser("plan", help="compute-optimal parameters and tokens for a budget",
                          description="Compute-optimal plan from exactly one of --flops, --params, --tokens.")
    group = plan.add_mutually_exclusive_group(required=True)
    group.add_argument("--flops", type=count, help="training compute C in FLOPs (C = 6·N·D)")
    group.add_argument("--params", type=count, help="parameter count N (the law's convention)")
    group.add_argument("--tokens", type=count, help="training tokens D")
    group.add_argument("--run", metavar="RUN_FILE", help="an experiment: its parameters, tokens and FLOPs beside the "
                                                         "law's optimum for that compute, and its memory fit")
    plan.add_argument("overrides", nargs="*", help="with --run: key=value or group=name, as for train")
    plan.add_argument("--law", default="chinchilla", help=f"{', '.join(PUBLISHED)}, or a law.json from fit")
    plan.add_argument("--vocab", type=int, default=32000, help="vocabulary size of the shape (default 32000)")
    plan.add_argument("--seq-len", type=int, default=2048, help="sequence length of the shape (default 2048)")
    plan.add_argument("--head-dim", type=int, default=64, help="head dimension of the shape (default 64)")
    plan.add_argument("--aspect-ratio", type=float, default=64.0, help="d_model / n_layers of the shape (default 64)")
    plan.add_argument("--tokens-per-step", type=count, default=2**20, help="global batch in tokens (default 2^20)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.add_argument("--mfu", type=float, default=None, help="with --run: GPU-hours at this model FLOPs utilization "
                      "(e.g. 0.4); default: the one `make bench-gpu` measured, when --bench exists")
    plan.add_argument("--gpu", default=None, help="with --mfu: the GPU whose dense bf16 peak it is of (default H100; "
                      "a bench result's own GPU otherwise)")
    plan.add_argument("--bench", default="runs/bench/results-gpu.json",
                      help="with --run: the `make bench-gpu` results read for the measured MFU (default %(default)s)")
    plan.add_argument("--model", action="append", default=[], metavar="KEY=VALUE", help=VARIANT_HELP)

    mem = sub.add_parser("memory", help="per-device memory of a training configuration",
                         description="Per-device bytes: model states (Rajbhandari et al. 2019) and activations "
                                     "(our block's saved tensors; with recomputation, Korthikanti et al. "
                                     "2022, Table 2).")
    mem.add_argument("--run", metavar="RUN_FILE", help="an experiment: its model, layout, precision, micro-batch, "
                                                       "checkpointing and trainer.device_memory_gb (no other option)")
    mem.add_argument("overrides", nargs="*", help="with --run: key=value or group=name, as for train")
    mem.add_argument("--params", type=count, help="parameter count: picks a shape of our family near it")
    mem.add_argument("--layers", type=int, help="transformer layers")
    mem.add_argument("--hidden", type=int, help="hidden size d_model")
    mem.add_argument("--heads", type=int, help="attention heads")
    mem.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    mem.add_argument("--seq-len", type=int, default=2048, help="sequence length (default 2048)")
    mem.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    mem.add_argument("--untied", action="store_true", help="separate output head (default: tied embeddings)")
    mem.add_argument("--data-parallel", type=int, default=1)
    mem.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    mem.add_argument("--tensor-parallel", type=int, default=1)
    mem.add_argument("--pipeline-parallel", type=int, default=1)
    mem.add_argument("--expert-parallel", type=int, default=1,
                     help="model.moe: ranks splitting the routed experts (strategy.expert_parallel)")
    mem.add_argument("--sequence-parallel", action="store_true")
    mem.add_argument("--activation-checkpointing", default="none", choices=CHECKPOINTING)
    mem.add_argument("--activation-checkpointing-k", type=int, default=2, help="every_k: one block in k checkpointed")
    mem.add_argument("--activation-checkpointing-save-matmuls", default="all", choices=["all", "every_other"],
                     help="selective: keep every matmul's output, or every other one's")
    mem.add_argument("--precision", default="zero-mixed-adam", choices=list(PRECISIONS),
                     help="zero-mixed-adam: the ZeRO paper's 2 + 2 + 12 bytes/param; 32-true, bf16-mixed, "
                          "16-mixed, bf16-true: what our runs hold under that Lightning precision; "
                          "bf16-mixed-policy: bf16-mixed under ZeRO-2/3 with FSDP2's mixed-precision policy, what "
                          "such a run holds by default without tensor, pipeline or expert parallelism "
                          "(strategy.mixed_precision_policy)")
    mem.add_argument("--exact", action="store_true", help="sum FSDP2's padded per-tensor shards (data parallel only)")
    mem.add_argument("--device-memory", default=None, help="device memory, e.g. 80GB or 141GiB: adds `fits`")
    mem.add_argument("--json", action="store_true", help="print JSON instead of a table")
    mem.add_argument("--model", action="append", default=[], metavar="KEY=VALUE", help=VARIANT_HELP)
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "fit":
            from lit_pretrain.scaling.fit_runs import fit_sources

            out = Path(args.out)
            plots = Path(args.plots) if args.plots else out.parent / "plots"
            fit_sources(args.sources, out=out, plots_dir=plots, bootstrap=args.bootstrap,
                        drop_highest=args.drop_highest, seed=args.seed)
        elif args.command == "plan" and args.run:
            from lit_pretrain.planning.compute_optimal import load_law
            from lit_pretrain.planning.run_plan import format_run_plan, run_plan

            run_config = _run_config(args)
            result = run_plan(run_config, run_config.plan, load_law(args.law))
            hours = _gpu_hours(args, run_config, result)
            if hours is not None:
                result["gpu_hours"] = hours
            print(json.dumps(result, indent=2) if args.json else format_run_plan(result) + (
                "\n" + hours["line"] if hours is not None else ""))
        elif args.command == "plan":
            from lit_pretrain.planning.compute_optimal import format_plan, load_law, plan

            _no_overrides(args)
            template = variant(args.model)
            _dense_search(template, 0)  # plan always searches a shape
            result = plan(load_law(args.law), flops=args.flops, params=args.params, tokens=args.tokens,
                          vocab_size=args.vocab, seq_len=args.seq_len, tokens_per_step=int(args.tokens_per_step),
                          head_dim=args.head_dim, aspect_ratio=args.aspect_ratio, template=template)
            print(json.dumps(result, indent=2) if args.json else format_plan(result))
        else:
            result = _memory(args)
            print(json.dumps(result, indent=2) if args.json else format_memory(result))
    except (ConfigError, DataError) as err:
        print(f"lit-pretrain {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


def _gpu_hours(args, run_config, result):
    """GPU-hours of `plan --run` (scaling/gpu_hours.py) at --mfu, else at the MFU of args.bench when it exists; None
    when neither is there."""
    from lit_pretrain.model import shapes
    from lit_pretrain.planning.plan import sized_model
    from lit_pretrain.scaling.gpu_hours import bench_case_for, format_gpu_hours, gpu_hours, measured_mfu

    model = sized_model(run_config)
    if args.mfu is not None:
        mfu, gpu, source = args.mfu, args.gpu or "H100", "--mfu"
    elif Path(args.bench).is_file():
        results = json.loads(Path(args.bench).read_text())
        case_for = bench_case_for(run_config.trainer.float8, run_config.strategy.activation_checkpointing)
        found = measured_mfu(results, shapes.flops_per_token(model), case_for)
        if found is None:
            raise DataError(f"{args.bench} holds no MFU case of `make bench-gpu`: rerun it, or give --mfu")
        (mfu, case), gpu = found, args.gpu or results["machine"]["gpu"]
        source = f"measured: {case} in {args.bench}"
    else:
        return None
    from lit_pretrain.gpu_peaks import bf16_peak_flops

    peak = bf16_peak_flops(gpu, f"--gpu {gpu}")
    hours = gpu_hours(result["flops"], mfu, peak)
    return {"hours": hours, "mfu": mfu, "gpu": gpu, "peak_flops": peak, "source": source,
            "line": format_gpu_hours(hours, mfu, gpu, peak, source)}


def _run_config(args):
    """The config of --run with its overrides and its plan (config.Loaded), trainer.device_memory_gb left unchecked:
    these commands report it."""
    from lit_pretrain import config

    return config.load(args.run, args.overrides, check_memory=False)


def _no_overrides(args) -> None:
    if args.overrides:
        raise ConfigError(f"{' '.join(args.overrides)}: overrides need --run RUN_FILE")


def _memory(args) -> dict:
    from dataclasses import asdict, replace

    from lit_pretrain.model import shapes
    from lit_pretrain.planning.memory import memory_plan, parse_bytes
    from lit_pretrain.planning.plan import ParallelPlan

    if args.run:
        given = [f"--{k.replace('_', '-')}" for k in ("params", "layers", "hidden", "heads", "device_memory")
                 if getattr(args, k) is not None]
        if given:
            raise ConfigError(f"--run RUN_FILE takes the shape and layout from the experiment: drop {', '.join(given)}"
                              " (override a key instead, e.g. trainer.device_memory_gb=80)")
        from lit_pretrain.planning.run_plan import run_memory

        run_config = _run_config(args)
        return run_memory(run_config, run_config.plan)
    _no_overrides(args)
    shape_args = (args.layers, args.hidden, args.heads)
    if (args.params is None) == all(v is None for v in shape_args) or (
            args.params is None and any(v is None for v in shape_args)):
        raise ConfigError("give either --params, or all of --layers, --hidden and --heads")
    template = variant(args.model)
    _dense_search(template, args.params)
    n_kv_heads = template.n_kv_heads
    if args.params is not None:
        s = shapes.shape_near(args.params, args.vocab, args.seq_len, tie_embeddings=not args.untied,
                              template=template)
        shape_args = (s.n_layers, s.d_model, s.n_heads)
        n_kv_heads = s.n_kv_heads
    cfg = replace(template, vocab_size=args.vocab, n_layers=shape_args[0], d_model=shape_args[1],
                  n_heads=shape_args[2], n_kv_heads=n_kv_heads, seq_len=args.seq_len, tie_embeddings=not args.untied)
    try:
        cfg.check()
    except ValueError as err:
        raise ConfigError(str(err).replace("model.d_model", "--hidden").replace("model.n_heads", "--heads")
                          .replace("model.n_kv_heads", "--model n_kv_heads")) from None
    device = parse_bytes(args.device_memory) if args.device_memory else None
    layout = ParallelPlan(data_parallel_shard=args.data_parallel, zero_stage=args.zero_stage,
                          tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel,
                          sequence_parallel=args.sequence_parallel, expert_parallel=args.expert_parallel,
                          activation_checkpointing=args.activation_checkpointing,
                          activation_checkpointing_k=args.activation_checkpointing_k,
                          activation_checkpointing_save_matmuls=args.activation_checkpointing_save_matmuls)
    result = memory_plan(layout, cfg, args.micro_batch, precision=args.precision, device_memory=device,
                         exact=args.exact)
    return {"shape": {"n_layers": cfg.n_layers, "d_model": cfg.d_model, "n_heads": cfg.n_heads,
                      "vocab_size": cfg.vocab_size, "tie_embeddings": cfg.tie_embeddings,
                      **{k: getattr(cfg, k) for k in VARIANT_KEYS},
                      "moe": asdict(cfg.moe) if cfg.moe is not None else None}, **result}


def format_memory(r: dict) -> str:
    """The table of `lit-pretrain memory`. Sizes in GB (1e9 bytes), the unit of trainer.device_memory_gb and of the
    `plan`/`memory --run` line above it, and what devices are sold by (an 80 GB H100, a 141 GB H200)."""
    s = r["shape"]
    gb = 1e9
    variant = "".join(f", {k} {s[k]}" for k in VARIANT_KEYS
                      if k != "moe" and s.get(k) not in (None, False, "rmsnorm", "swiglu", "head"))
    if s.get("moe"):
        m = s["moe"]
        variant += f", MoE {m['num_experts']} experts top-{m['top_k']} of width {m['d_ff_expert'] or 'd_ff'}"
    lines = [f"model: {s['n_layers']} layers, d_model {s['d_model']}, {s['n_heads']} heads{variant}, vocab "
             f"{s['vocab_size']}; "
             f"{r['params']:,} parameters"
             f"{'' if r['active_params'] == r['params'] else ' (' + format(r['active_params'], ',') + ' active)'}, "
             f"{r['params_per_device']:,.0f} on this device before ZeRO sharding",
             f"layout: data_parallel {r['data_parallel']} (ZeRO stage {r['zero_stage']}), tensor_parallel "
             f"{r['tensor_parallel']}, pipeline_parallel {r['pipeline_parallel']}, sequence_parallel "
             f"{r['sequence_parallel']}, activation_checkpointing {r['activation_checkpointing']}, precision "
             f"{r['precision']}, micro_batch {r['micro_batch']} × seq_len {r['seq_len']}"]
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes", "cast_weight_bytes",
                "activation_bytes_per_layer", "activation_bytes", "total_bytes"):
        lines.append(f"  {key:<28} {r[key]:>20,.0f} B  {r[key] / gb:>10.3f} GB")
    for key in ("recompute_bytes", "transient_bytes", "mask_bytes"):
        if key in r and (r[key] or key != "mask_bytes"):  # a mask row only where a sliding window makes one
            lines.insert(-1, f"  {key:<28} {r[key]:>20,.0f} B  {r[key] / gb:>10.3f} GB")
    if "kv_cache_bytes_per_token" in r:  # decoding, not training: the whole model's cache, never one rank's
        lines.append(f"  {'kv_cache_bytes_per_token':<28} {r['kv_cache_bytes_per_token']:>20,.0f} B  (bf16, every "
                     "layer: what generation holds per token of context)")
    if "run" in r:
        from lit_pretrain.planning.run_plan import format_fit

        lines.insert(0, f"run {r['run']}: {format_fit(r)}")
    elif "fits" in r:
        lines.append(f"fits in {r['device_memory'] / gb:.1f} GB: {'yes' if r['fits'] else 'NO'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
