"""GPU-hours of a run at a model FLOPs utilization (MFU): given by the user (`plan --run FILE --mfu 0.4`), or the one
`make bench-gpu` measured (its results file, runs/bench/results-gpu.json by default). Pure: no torch.

GPU-hours = FLOPs / (MFU x peak FLOP/s of one GPU) / 3600, the same whatever the number of GPUs (they divide the
wall-clock time as they multiply the peak). FLOPs are the run's model FLOPs with attention (PaLM appendix B: 6·N +
12·L·H·Q·T per token, model/shapes.py), the numerator MFU is measured with (callbacks/throughput.py), and the peak
is the GPU's dense bf16 datasheet figure, the one bench-gpu divides by for every case (fp8 included).
"""

from typing import Dict, Optional, Tuple

from lit_pretrain.errors import ConfigError


def gpu_hours(flops: float, mfu: float, peak_flops_per_gpu: float) -> float:
    """Hours of one GPU that `flops` take at `mfu` of `peak_flops_per_gpu`."""
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {mfu:g}: model FLOPs utilization is a fraction in (0, 1], e.g. 0.4")
    return flops / (mfu * peak_flops_per_gpu) / 3600.0


def bench_case_for(float8, activation_checkpointing: str) -> str:
    """The bench-gpu case whose setting a run matches: fp8 (trainer.float8) by its recipe (rowwise_with_gw_hp:
    rowwise's), selective activation checkpointing (strategy.activation_checkpointing), else bf16 compiled
    (bench/step/gpu_cases.py's names)."""
    if float8 is not None:
        return "fp8_tensorwise" if float8.recipe == "tensorwise" else "fp8_rowwise"
    if activation_checkpointing == "selective":
        return "selective"
    return "compiled"


def measured_mfu(results: Dict, flops_per_token: float, case: str) -> Optional[Tuple[float, str]]:
    """(MFU, the case it is of) from a bench-gpu results file: of the benchmarked models, the one nearest the run's
    FLOPs per token (by ratio), its `case`, else its bf16 compiled MFU; None when the file holds no MFU."""
    by_model = {}  # model name -> (flops_per_token, {case: mfu})
    for r in results.get("cases", []):
        name = r["case"]
        if name.startswith("mfu_gpu_") and name.endswith("_compiled"):
            model = name.removeprefix("mfu_gpu_").removesuffix("_compiled")
            entry = by_model.setdefault(model, [r["detail"]["flops_per_token"], {}])
            entry[0] = r["detail"]["flops_per_token"]
            entry[1]["compiled"] = (r["ratio"], name)
        elif name.startswith("gpu_") and "mfu" in r.get("detail", {}) and "name" in r["detail"]:
            model = name.removeprefix("gpu_").removesuffix(f"_{r['detail']['name']}_tokens_per_s")
            by_model.setdefault(model, [None, {}])[1][r["detail"]["name"]] = (r["detail"]["mfu"], name)
    known = {m: v for m, v in by_model.items() if v[0] and "compiled" in v[1]}
    if not known:
        return None
    nearest = min(known, key=lambda m: max(known[m][0], flops_per_token) / min(known[m][0], flops_per_token))
    mfus = known[nearest][1]
    return mfus.get(case, mfus["compiled"])


def format_gpu_hours(hours: float, mfu: float, gpu: str, peak: float, source: str) -> str:
    return (f"  GPU-hours: {hours:,.0f} at MFU {mfu:.1%} of one {gpu}'s {peak / 1e12:,.0f} TFLOP/s (dense bf16) "
            f"({source})")
