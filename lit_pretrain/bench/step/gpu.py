"""`make bench-gpu` (`python -m lit_pretrain.bench.step.gpu`): the training step on CUDA, eager and compiled, with a
~125M and a ~1B model, bf16-mixed, FSDP2 (ZeRO stage 3) over this node's GPUs; MFU against the device's peak.

The step is our Trainer's (`PretrainModule` under `L.Trainer` with the strategy `build_strategy` returns), timed as
on CPU (bench/step/step.py), so the figures are those `lit-pretrain train` would reach. MFU (PaLM appendix B) divides
model FLOPs/s by the dense bf16 datasheet peak of all GPUs of the node (callbacks/throughput.py's table, e.g.
989 TFLOP/s for an H200 SXM). The CPU-bound cases (data loading, tokenization) are `make bench`'s. Results go to
runs/bench/results-gpu.json with the machine and versions. One GPU: `make bench-gpu`; all GPUs of a node:
`torchrun --standalone --nproc-per-node gpu -m lit_pretrain.bench.step.gpu`.
`make bench-gpu PRESET=llama3_2_1b` (`--preset`): a model preset of experiments/model/ instead, on one GPU, at the
largest micro-batch the memory planner (planning/memory.py, bf16-mixed, FSDP on one rank: nothing sharded) fits with
run_plan.MIN_HEADROOM to spare, with activation checkpointing only when no micro-batch fits without it, and only as
many of its layers as fit when the whole model does not (Llama 3.1 8B: its 128 GB of model states alone exceed an
H200's 90%); what was chosen is printed, and the MFU counts the FLOPs of the layers run.
"""

import argparse
import dataclasses
import json
import os
import platform
from pathlib import Path
from typing import Dict, List

import torch

from lit_pretrain.bench.step.gpu_cases import CASES
from lit_pretrain.model.config import GPTConfig

CASE_NAMES = tuple(CASES)

# ~125M: GPT-2 small's shape (12 × 768, 12 heads of 64) with SwiGLU 2048 and a 32k vocabulary, untied:
#   12 × (4·768² + 3·768·2048) = 85M in blocks + 2 × 32768·768 = 50M embedding and head = 135M.
# ~1B: 18 × 2048, 16 heads of 128, SwiGLU 5504 (LLaMA-3.2-1B's width): 911M in blocks + 134M embedding and head.
MODELS = {
    "125m": dict(n_layers=12, d_model=768, n_heads=12, seq_len=1024, micro_batch_size=16),
    "1b": dict(n_layers=18, d_model=2048, n_heads=16, seq_len=2048, micro_batch_size=8),
}
VOCAB_SIZE = 32768
GOALS = {"125m": "-", "1b": ">= 0.45"}
PRESET_GOAL = ">= 0.45"  # torchtitan reaches ~45% on Llama 3.1 8B (6,667 tokens/s/GPU on 8 H100, bf16)
PRESET_MICRO_BATCHES = (8, 4, 2, 1)
# `--dry-run`: the same code path on the CPU with a tiny model and a few steps, so the script is exercised (by a test)
# on machines without a GPU. Its figures mean nothing.
DRY_RUN_MODEL = dict(n_layers=1, d_model=32, n_heads=2, seq_len=16, micro_batch_size=2)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU build)"
        raise RuntimeError(
            f"make bench-gpu needs a CUDA GPU, and torch {torch.__version__} (built with {built}) sees none: run it "
            "on a GPU machine with a CUDA build of torch, or run `make bench` for the CPU cases"
        )


def model_config(name: str, dry_run: bool = False) -> tuple[GPTConfig, int]:
    """(model config, micro-batch size) of a named benchmark model (the tiny one under `dry_run`)."""
    shape = dict(DRY_RUN_MODEL if dry_run else MODELS[name])
    micro_batch_size = shape.pop("micro_batch_size")
    return GPTConfig(vocab_size=VOCAB_SIZE, tie_embeddings=False, **shape), micro_batch_size


def fit_one_device(model: GPTConfig, device_memory: float) -> tuple[GPTConfig, int, str, str]:
    """(model as run, micro-batch, strategy.activation_checkpointing, what was chosen and why) for a preset on one
    device of `device_memory` bytes: the largest micro-batch of PRESET_MICRO_BATCHES whose plan (bf16-mixed, FSDP on
    one rank) leaves MIN_HEADROOM free, without activation checkpointing, else with it (full); else the most layers
    that fit at micro-batch 1."""
    from lit_pretrain.model import shapes
    from lit_pretrain.planning.memory import memory_plan
    from lit_pretrain.planning.plan import ParallelPlan
    from lit_pretrain.planning.run_plan import MIN_HEADROOM

    budget = (1 - MIN_HEADROOM) * device_memory

    def total(cfg: GPTConfig, micro_batch: int, ac: str) -> float:
        return memory_plan(ParallelPlan(zero_stage=3, activation_checkpointing=ac), cfg, micro_batch,
                           precision="bf16-mixed")["total_bytes"]

    where = f"one {device_memory / 1e9:.3g} GB device (at most {budget / 1e9:.3g} GB planned)"
    for ac in ("none", "full"):
        for mb in PRESET_MICRO_BATCHES:
            if total(model, mb, ac) <= budget:
                return model, mb, ac, (f"all {model.n_layers} layers, micro-batch {mb}, activation checkpointing "
                                       f"{ac}: {total(model, mb, ac) / 1e9:.3g} GB planned on {where}")
    best = (0, "none")
    for ac in ("none", "full"):
        fits = [n for n in range(1, model.n_layers)
                if total(dataclasses.replace(model, n_layers=n), 1, ac) <= budget]
        best = max(best, (max(fits, default=0), ac), key=lambda b: b[0])
    layers, ac = best
    if not layers:
        raise SystemExit(f"error: not one layer of the preset fits {where}: nothing to benchmark")
    cfg = dataclasses.replace(model, n_layers=layers)
    states = 16 * shapes.params(model)  # fp32 weights, gradients and AdamW moments (planning/memory.py)
    return cfg, 1, ac, (f"{model.n_layers} layers do not fit {where} (their model states alone are "
                        f"{states / 1e9:.3g} GB; FSDP on one GPU shards nothing): running {layers} of the "
                        f"{model.n_layers} layers, micro-batch 1, activation checkpointing {ac}, "
                        f"{total(cfg, 1, ac) / 1e9:.3g} GB planned; tokens/s and MFU are those of the layers run")


def preset_config(run_file: str, preset: str, device_memory: float, dry_run: bool = False
                  ) -> tuple[GPTConfig, int, str, str]:
    """A preset of experiments/model/ (composed into the experiment as `model=<preset>`), fitted to one device; under
    `dry_run` shrunk first to a tiny model of the same kind (GQA ratio, tied or not) so the path runs on a CPU."""
    from lit_pretrain import config as config_lib
    from lit_pretrain.errors import ConfigError

    try:
        # Only the model is taken (the micro-batch is fitted below): the run file's tokens_per_step, a count of its
        # own model's windows, need not divide into the preset's (planning/batch.py).
        model = config_lib.load(run_file, [f"model={preset}", "trainer.tokens_per_step=null"],
                                check_memory=False).model
    except ConfigError as err:
        raise SystemExit(f"error: --preset {preset}: {err}") from None
    if dry_run:
        kv = max(1, 4 * model.kv_heads // model.n_heads)
        model = dataclasses.replace(model, n_layers=min(model.n_layers, 4), d_model=64, n_heads=4, n_kv_heads=kv,
                                    d_ff=128, vocab_size=VOCAB_SIZE // 64, seq_len=16)
    return fit_one_device(model, device_memory)


def experiment(c, name: str, devices: int, dry_run: bool = False, model: GPTConfig = None, micro_batch_size=None,
               activation_checkpointing: str = "none"):
    """The experiment's config with the benchmark model, its micro-batch and FSDP2 (ZeRO stage 3) on `devices`
    (under `dry_run`: the tiny model on the CPU, over gloo); `model`, `micro_batch_size`, `activation_checkpointing`:
    a preset's, fitted."""
    from lit_pretrain.schema import StrategyConfig

    if model is None:
        model, micro_batch_size = model_config(name, dry_run)
    trainer = dataclasses.replace(c.trainer, micro_batch_size=micro_batch_size, devices=devices,
                                  precision="bf16-mixed", accelerator="cpu" if dry_run else "cuda")
    strategy = StrategyConfig(name="zero", zero_stage=3, activation_checkpointing=activation_checkpointing,
                              **({"process_group_backend": "gloo"} if dry_run else {}))
    return dataclasses.replace(c, model=model, trainer=trainer, strategy=strategy)


def run_model(c, name: str, steps: int, skip: int, devices: int, dry_run: bool = False, fitted=None,
              cases=()) -> List[Dict]:
    """The eager/compiled pair and the MFU cases of benchmark model `name`, or of a preset `fitted` by
    preset_config (model, micro-batch, activation checkpointing, the note printed and kept in the case's detail);
    then `cases` of bench/step/gpu_cases.py (policy, selective, fp8), each beside bf16 compiled and torchtitan's
    row."""
    from lit_pretrain.bench.step import mfu
    from lit_pretrain.bench.step.step import paired_case, trainer_loop
    from lit_pretrain.callbacks.throughput import gpu_peak_flops
    from lit_pretrain.model.gpt import GPT
    from lit_pretrain.planning.plan import plan_from
    from lit_pretrain.strategy.build import build_strategy

    c = experiment(c, name, devices, dry_run, *(fitted[:3] if fitted else ()))

    def tokens_per_s(compile: bool, run=None, callbacks=()) -> float:
        # Every rank times its own share; the node's rate is that times the ranks (they step in lockstep).
        # The dry run stays eager on both sides: compiling needs a C++ compiler and tens of seconds on a CPU.
        run = run or c
        plan = plan_from(run.strategy, run.trainer)
        return devices * trainer_loop(run, steps, skip, compile=compile and not dry_run,
                                      precision=run.trainer.precision, accelerator=run.trainer.accelerator,
                                      strategy=build_strategy(run.strategy, run.trainer, plan), devices=devices,
                                      callbacks=callbacks, plan=plan)

    case = paired_case(f"gpu_{name}_compiled_step_tokens_per_s", lambda: tokens_per_s(False),
                       lambda: tokens_per_s(True), 1, ">= 1.0", "tokens/s", ("eager", "compiled"),
                       {"steps": steps, "timed_steps": steps - skip, "devices": devices,
                        "micro_batch_size": c.trainer.micro_batch_size, "seq_len": c.model.seq_len,
                        "n_layers": c.model.n_layers, "activation_checkpointing": c.strategy.activation_checkpointing,
                        **({"preset": fitted[3]} if fitted else {})})
    with torch.device("meta"):
        model = GPT(c.model)
    case["detail"]["params"] = model.num_params(non_embedding=False)
    # The dry run divides by a nominal 1 TFLOP/s: no CPU datasheet peak exists, and its MFU means nothing anyway.
    peak = 1e12 if dry_run else devices * gpu_peak_flops(torch.cuda.get_device_name(), c.trainer.precision)
    best = {f"gpu_{name}_eager": case["reference"], f"gpu_{name}_compiled": case["value"]}
    goal = PRESET_GOAL if fitted else GOALS[name]
    out = [case, *mfu.cases(best, model.flops_per_token(), peak, {f"gpu_{name}_compiled": goal})]
    if cases:
        from lit_pretrain.bench.step import gpu_cases

        more = gpu_cases.run_cases(c, name, list(cases), lambda run, callbacks: tokens_per_s(True, run, callbacks),
                                   case["value"], model.flops_per_token(), peak, devices)
        print(f"\n{name}:\n" + gpu_cases.published_table(more, {"eager": case["reference"], "compiled": case["value"]},
                                                          devices, model.flops_per_token(), peak), flush=True)
        out += more
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_pretrain.bench.step.gpu", description=__doc__)
    parser.add_argument("run_file", nargs="?", default="experiments/runs/default.yaml")
    parser.add_argument("--models", default="125m,1b", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--preset", default=None, help="comma-separated model presets of experiments/model/ (e.g. "
                                                       "llama3_2_1b,llama3_1_8b) instead of --models, on one GPU")
    parser.add_argument("--device-memory", default=None, help="one device's memory for the preset's fit, e.g. 80GB "
                                                              "(default: the GPU's own; dry run: 1GB)")
    parser.add_argument("--cases", default=",".join(CASE_NAMES),
                        help="comma-separated cases run after the bf16 eager/compiled pair, of "
                             f"{', '.join(CASE_NAMES)} (bench/step/gpu_cases.py); empty: the pair alone")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=10, help="first steps left out (compile, allocator warm-up)")
    parser.add_argument("--out", default="runs/bench/results-gpu.json")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same code path on the CPU with a tiny model and a few steps (no CUDA needed); "
                             "prints the table, writes no file; the figures mean nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.steps, args.skip = min(args.steps, 3), min(args.skip, 1)
    else:
        try:
            require_cuda()
        except RuntimeError as e:
            raise SystemExit(f"error: {e}") from None
    args.cases = [x for x in args.cases.split(",") if x]
    if any(x not in CASE_NAMES for x in args.cases):
        raise SystemExit(f"error: --cases {','.join(args.cases)}: expected a comma-separated list of "
                         f"{', '.join(CASE_NAMES)}")
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        raise SystemExit(f"error: --models {','.join(unknown)}: expected a comma-separated list of {', '.join(MODELS)}")

    from lightning import __version__ as lightning_version

    from lit_pretrain import config as config_lib

    c = config_lib.load(args.run_file, [])
    # One process drives one GPU; under `torchrun --nproc-per-node N` each of the N processes drives its own.
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if args.preset:
        cases = run_presets(args, devices)
    else:
        cases = [case for name in args.models.split(",")
                 for case in run_model(c, name, args.steps, args.skip, devices, args.dry_run, cases=args.cases)]
    if int(os.environ.get("RANK", "0")) != 0:
        return  # one table, one file
    print(f"\n{'case':<36} {'value':>16} {'reference':>16} {'ratio':>7}  goal")
    for case in cases:
        print(f"{case['case']:<36} {case['value']:>16,.1f} {case['reference']:>16,.1f} {case['ratio']:>7.3f}  "
              f"{case['goal']}")
    if args.dry_run:
        print("dry run (CPU, tiny model): the code path ran; no file written")
        return
    machine = {"platform": platform.platform(), "gpu": torch.cuda.get_device_name(), "gpus": devices,
               "cuda": torch.version.cuda, "torch": torch.__version__, "lightning": lightning_version,
               "python": platform.python_version()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "experiment": args.run_file, "cases": cases}, indent=2) + "\n")
    print(f"wrote {out}")


def run_presets(args, devices: int) -> List[Dict]:
    from lit_pretrain import config as config_lib
    from lit_pretrain.planning.memory import parse_bytes

    if devices != 1:
        raise SystemExit("error: --preset runs on one GPU (it fits the preset to one device's memory): run it "
                         "without torchrun")
    if args.device_memory:
        memory = parse_bytes(args.device_memory)
    else:
        memory = 1e9 if args.dry_run else float(torch.cuda.get_device_properties(0).total_memory)
    cases = []
    for preset in args.preset.split(","):
        fitted = preset_config(args.run_file, preset, memory, args.dry_run)
        print(f"{preset}: {fitted[3]}", flush=True)
        c = config_lib.load(args.run_file, [])
        cases += run_model(c, preset, args.steps, args.skip, devices, args.dry_run, fitted, args.cases)
    return cases


if __name__ == "__main__":
    main()
