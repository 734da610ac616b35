"""Where the training step's time goes: `python -m lit_pretrain.bench.step.profile_step [--eager] [--bf16] [--steps N]`.

The step of bench/step/step.py's raw loop (forward, fp32 cross-entropy, backward, clipping, AdamW), compiled as
`trainer.compile` compiles it unless --eager, profiled with torch.profiler after warm-up steps. Prints each kind of
work's share of the step (self CPU time of its operators), the GFLOP/s the matmuls reached against the fp32 matmul
peak mfu.py measures (--bf16: the step under bf16 autocast, as trainer.precision=bf16-mixed runs it, against the bf16
peak), and the MFU that leaves: it is what bounds `mfu_compiled` on a given CPU. Kinds are
told apart by operator name (`kind_of`, table-tested); compiled kernels are named when inductor's kernel profiling
is on (this tool turns it on), and every other operator counts as "other".
"""

import argparse
from collections import defaultdict
from typing import Dict, Iterable, Tuple

# (kind, substrings of an operator's name), first match wins: matmuls are the work MFU counts; attention's own
# kernels (SDPA) do the 12·L·H·Q·T part at a lower rate; the optimizer's foreach kernels and inductor's generated
# loops (cpp_fused_*: norms, activations, rotary, softmax of the loss) are the rest.
KINDS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_weight_int", "aten::linear")),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
    ("optimizer", ("_foreach_", "_fused_adam", "Optimizer.")),
    ("compiled kernels", ("cpp_fused", "kernel_cpp", "triton_")),
)


def kind_of(name: str) -> str:
    for kind, keys in KINDS:
        if any(key in name for key in keys):
            return kind
    return "other"


def shares(events: Iterable[Tuple[str, float, float]]) -> Dict[str, Dict[str, float]]:
    """{kind: {"seconds", "flops"}} from (operator name, self seconds, FLOPs) triples."""
    out: Dict[str, Dict[str, float]] = defaultdict(lambda: {"seconds": 0.0, "flops": 0.0})
    for name, seconds, flops in events:
        row = out[kind_of(name)]
        row["seconds"] += seconds
        row["flops"] += flops
    return dict(out)


def profile(c, steps: int, warmup: int, compile: bool, bf16: bool = False) -> Dict:
    """{kind: {"seconds", "flops"}} per step of bench/step/step.py's raw step, profiled after `warmup` steps. `bf16`:
    its forward and loss under bf16 autocast, as trainer.precision=bf16-mixed runs them."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from lit_pretrain.bench.step.step import raw_step

    torch._inductor.config.cpp.enable_kernel_profile = True  # names each generated kernel in the profile
    _, step = raw_step(c, compile, bf16)
    g = torch.Generator().manual_seed(c.run.seed)
    x, y = torch.randint(0, c.model.vocab_size, (2, c.trainer.micro_batch_size, c.model.seq_len), generator=g)
    for _ in range(warmup):
        step(x, y)
    with torch_profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        for _ in range(steps):
            step(x, y)
    # Self times of the main thread's operators: each microsecond counted once, however deep the call.
    events = [(e.key, e.self_cpu_time_total / 1e6, float(e.flops or 0)) for e in prof.key_averages()]
    return {kind: {k: v / steps for k, v in row.items()} for kind, row in shares(events).items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_file", nargs="?", default="experiments/runs/default.yaml")
    parser.add_argument("--eager", action="store_true", help="profile the eager step (default: compiled)")
    parser.add_argument("--bf16", action="store_true",
                        help="the step under bf16 autocast (trainer.precision=bf16-mixed), against the bf16 peak")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (after 3 warm-up steps)")
    args = parser.parse_args(argv)

    from lit_pretrain import config as config_lib
    from lit_pretrain.bench.step.mfu import cpu_matmul_peak
    from lit_pretrain.model.gpt import GPT
    from lit_pretrain.train import resolve_vocab, setup_process

    c = config_lib.load(args.run_file, [])
    setup_process(c.trainer)
    c = resolve_vocab(c, c.data.vocab_size)
    dtype = "bf16" if args.bf16 else "fp32"
    peak = cpu_matmul_peak(dtype=dtype)
    rows = profile(c, args.steps, 3, not args.eager, args.bf16)
    total = sum(row["seconds"] for row in rows.values())
    model_flops = GPT(c.model).flops_per_token() * c.trainer.micro_batch_size * c.model.seq_len
    print(f"{'eager' if args.eager else 'compiled'} step: {total * 1e3:.0f} ms of operator time; "
          f"{dtype} matmul peak {peak / 1e9:.0f} GFLOP/s")
    for kind, row in sorted(rows.items(), key=lambda kv: -kv[1]["seconds"]):
        # Only the matmuls' rate means something: the profiler counts no FLOPs for attention's kernels.
        rate = f"  {row['flops'] / row['seconds'] / 1e9:6.0f} GFLOP/s ({row['flops'] / row['seconds'] / peak:.2f} " \
               "of the peak)" if kind == "matmul" else ""
        print(f"  {kind:<17} {row['seconds'] * 1e3:7.1f} ms  {row['seconds'] / total:5.1%}{rate}")
    print(f"MFU of this step: {model_flops / total / peak:.3f}; if everything but the matmuls took no time: "
          f"{model_flops / rows.get('matmul', {'seconds': total})['seconds'] / peak:.3f}")


if __name__ == "__main__":
    main()
