"""`make bench-gpu` (`python -m lit_pretrain.bench.gpu`): the training step on CUDA, eager and compiled, with a
~125M and a ~1B model, bf16-mixed, FSDP2 (ZeRO stage 3) over this node's GPUs; MFU against the device's peak.

The step is our Trainer's (`PretrainModule` under `L.Trainer` with the strategy `build_strategy` returns), timed as
on CPU (bench/step.py), so the figures are those `lit-pretrain train` would reach. MFU (PaLM appendix B) divides
model FLOPs/s by the dense bf16 datasheet peak of all GPUs of the node (callbacks/throughput.py's table, e.g.
989 TFLOP/s for an H200 SXM). The CPU-bound cases (data loading, tokenization) are `make bench`'s. Results go to
runs/bench/results-gpu.json with the machine and versions. One GPU: `make bench-gpu`; all GPUs of a node:
`torchrun --standalone --nproc-per-node gpu -m lit_pretrain.bench.gpu`.
"""

import argparse
import dataclasses
import json
import os
import platform
from pathlib import Path
from typing import Dict, List

import torch

from lit_pretrain.model_config import GPTConfig

# ~125M: GPT-2 small's shape (12 × 768, 12 heads of 64) with SwiGLU 2048 and a 32k vocabulary, untied:
#   12 × (4·768² + 3·768·2048) = 85M in blocks + 2 × 32768·768 = 50M embedding and head = 135M.
# ~1B: 18 × 2048, 16 heads of 128, SwiGLU 5504 (LLaMA-3.2-1B's width): 911M in blocks + 134M embedding and head.
MODELS = {
    "125m": dict(n_layers=12, d_model=768, n_heads=12, seq_len=1024, micro_batch_size=16),
    "1b": dict(n_layers=18, d_model=2048, n_heads=16, seq_len=2048, micro_batch_size=8),
}
VOCAB_SIZE = 32768
GOALS = {"125m": "-", "1b": ">= 0.45"}
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


def experiment(c, name: str, devices: int, dry_run: bool = False):
    """The experiment's config with the benchmark model, its micro-batch and FSDP2 (ZeRO stage 3) on `devices`
    (under `dry_run`: the tiny model on the CPU, over gloo)."""
    from lit_pretrain.schema import StrategyConfig

    model, micro_batch_size = model_config(name, dry_run)
    trainer = dataclasses.replace(c.trainer, micro_batch_size=micro_batch_size, devices=devices,
                                  precision="bf16-mixed", accelerator="cpu" if dry_run else "cuda")
    strategy = StrategyConfig(name="zero", zero_stage=3, **({"process_group_backend": "gloo"} if dry_run else {}))
    return dataclasses.replace(c, model=model, trainer=trainer, strategy=strategy)


def run_model(c, name: str, steps: int, skip: int, devices: int, dry_run: bool = False) -> List[Dict]:
    from lit_pretrain.bench import mfu
    from lit_pretrain.bench.step import paired_case, trainer_loop
    from lit_pretrain.callbacks.throughput import gpu_peak_flops
    from lit_pretrain.model import GPT
    from lit_pretrain.parallel.strategies import build_strategy

    c = experiment(c, name, devices, dry_run)

    def tokens_per_s(compile: bool) -> float:
        # Every rank times its own share; the node's rate is that times the ranks (they step in lockstep).
        # The dry run stays eager on both sides: compiling needs a C++ compiler and tens of seconds on a CPU.
        strategy = build_strategy(c.strategy, c.trainer)
        return devices * trainer_loop(c, steps, skip, compile=compile and not dry_run,
                                      precision=c.trainer.precision, accelerator=c.trainer.accelerator,
                                      strategy=strategy, devices=devices)

    case = paired_case(f"gpu_{name}_compiled_step_tokens_per_s", lambda: tokens_per_s(False),
                       lambda: tokens_per_s(True), 1, ">= 1.0", "tokens/s", ("eager", "compiled"),
                       {"steps": steps, "timed_steps": steps - skip, "devices": devices,
                        "micro_batch_size": c.trainer.micro_batch_size, "seq_len": c.model.seq_len})
    with torch.device("meta"):
        model = GPT(c.model)
    case["detail"]["params"] = model.num_params(non_embedding=False)
    # The dry run divides by a nominal 1 TFLOP/s: no CPU datasheet peak exists, and its MFU means nothing anyway.
    peak = 1e12 if dry_run else devices * gpu_peak_flops(torch.cuda.get_device_name(), c.trainer.precision)
    best = {f"gpu_{name}_eager": case["reference"], f"gpu_{name}_compiled": case["value"]}
    return [case, *mfu.cases(best, model.flops_per_token(), peak, {f"gpu_{name}_compiled": GOALS[name]})]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_pretrain.bench.gpu", description=__doc__)
    parser.add_argument("run_file", nargs="?", default="experiments/runs/default.yaml")
    parser.add_argument("--models", default="125m,1b", help=f"comma-separated, of {', '.join(MODELS)}")
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
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        raise SystemExit(f"error: --models {','.join(unknown)}: expected a comma-separated list of {', '.join(MODELS)}")

    from lightning import __version__ as lightning_version

    from lit_pretrain import config as config_lib

    c = config_lib.to_object(config_lib.load(args.run_file, []))
    # One process drives one GPU; under `torchrun --nproc-per-node N` each of the N processes drives its own.
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cases = [case for name in args.models.split(",")
             for case in run_model(c, name, args.steps, args.skip, devices, args.dry_run)]
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


if __name__ == "__main__":
    main()
