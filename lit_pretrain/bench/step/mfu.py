"""Case: model FLOPs utilization (MFU) of the training step, against a matmul peak measured in the same run.

MFU (PaLM, Chowdhery et al. 2022, appendix B) = model FLOPs per second / peak FLOPs per second, where model FLOPs
are the training FLOPs per token of the architecture (`GPT.flops_per_token`: 6·N + 12·L·H·Q·T) times tokens per
second: work the model needs, not work the hardware happened to do (activation checkpointing's recomputation does
not count). On a CPU there is no datasheet peak we could trust for this core count and clock, so the reference is
the best of a few large matmuls in the step's matmul dtype (fp32; bf16 for bf16-mixed) on the same threads, measured
at the start of the run and beside the runs it is the reference of.
"""

from typing import Dict, List, Sequence, Union

from lit_pretrain.bench import stats
from lit_pretrain.callbacks.throughput import measured_cpu_peak_flops

# 2048² fp32 matmuls (2·2048³ = 17.2 GFLOP each, ~0.1 s here) are large enough for the BLAS to reach its peak;
# 1024² ran ~10% lower in measurements on this machine (docs/cpu.md reports 216-246 GFLOP/s at 2048²).
PEAK_MATMUL_N = 2048


def model_flops_per_s(tokens_per_s: float, flops_per_token: float) -> float:
    return tokens_per_s * flops_per_token


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilization: the fraction of the peak the model's own FLOPs use (PaLM appendix B)."""
    if peak_flops_per_s <= 0:
        raise ValueError(f"peak FLOP/s must be positive, got {peak_flops_per_s}")
    return model_flops_per_s(tokens_per_s, flops_per_token) / peak_flops_per_s


def cpu_matmul_peak(repeats: int = 5, dtype: str = "fp32") -> float:
    """Best FLOP/s of `repeats` PEAK_MATMUL_N² matmuls in `dtype` ("fp32" or "bf16") on this process's threads,
    measured at each call (the training callback's measurement is cached once per process; the bench samples the
    peak several times)."""
    import torch

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    return measured_cpu_peak_flops.__wrapped__(torch_dtype, PEAK_MATMUL_N, repeats)


def peak_label(dtype: str = "fp32") -> str:
    return f"best of {dtype} {PEAK_MATMUL_N}x{PEAK_MATMUL_N} matmuls"


def cases(tokens_per_s: Dict[str, Union[float, Sequence[float]]], flops_per_token: int, peak_flops_per_s: float,
          goals: Dict[str, str], peak_dtype: str = "fp32") -> List[Dict]:
    """One case per measured step (e.g. {"eager": [...], "compiled": [...]}): model GFLOP/s over the peak's; a
    series of runs' tokens/s gives the median and spread of their MFUs (bench/stats.py)."""
    out = []
    for name, tps in tokens_per_s.items():
        series = [tps] if isinstance(tps, (int, float)) else list(tps)
        mfu(series[0], flops_per_token, peak_flops_per_s)  # refuses a non-positive peak before dividing by it
        summary = stats.single([model_flops_per_s(t, flops_per_token) / 1e9 for t in series],
                               lambda gflops: gflops * 1e9 / peak_flops_per_s)
        if len(series) == 1:
            summary = {k: v for k, v in summary.items() if k in ("value", "ratio")}  # one figure: no spread
        out.append({"case": f"mfu_{name}", **summary, "reference": peak_flops_per_s / 1e9,
                    "goal": goals.get(name, "-"), "unit": "GFLOP/s",
                    "detail": {"tokens_per_s": stats.median(series), "flops_per_token": flops_per_token,
                               "peak": peak_label(peak_dtype)}})
    return out
