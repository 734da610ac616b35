"""Dense peak FLOP/s of common GPUs, from their datasheets: the denominator of MFU (callbacks/throughput.py) and of
GPU-hours (`plan --run FILE --mfu`, `ladder --plan --mfu`: scaling/gpu_hours.py). Pure data, no torch, so the
planning commands that read it stay fast."""

from typing import Optional

from lit_pretrain.errors import ConfigError

# Dense peak FLOP/s per device by matmul precision, from NVIDIA's datasheets (A100: "NVIDIA A100 Tensor Core GPU"
# datasheet; H100/H200: "NVIDIA H100 Tensor Core GPU" and "NVIDIA H200" datasheets, SXM; L40S, L4, A10, V100, T4:
# their product datasheets). "half" is bf16 (fp16 where a GPU has no bf16), "tf32" TensorFloat-32, "fp32" plain FP32.
# Order matters: the first name contained in the device name wins ("H100 PCIe" before "H100", "A100" before "A10").
GPU_PEAK_FLOPS = (
    ("H200", {"half": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    ("H100 PCIe", {"half": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100", {"half": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    ("A100", {"half": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"half": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("L4", {"half": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("A10", {"half": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("V100", {"half": 125e12, "tf32": 15.7e12, "fp32": 15.7e12}),
    ("T4", {"half": 65e12, "tf32": 8.1e12, "fp32": 8.1e12}),
)


def gpu_peaks(device_name: str) -> Optional[dict]:
    """The peaks of the first table entry whose name the device name contains (case-insensitive), else None."""
    return next((peaks for name, peaks in GPU_PEAK_FLOPS if name.lower() in device_name.lower()), None)


def bf16_peak_flops(gpu: str, given_as: str) -> float:
    """The dense bf16 peak of `gpu`, the one GPU-hours divide by; a ConfigError that quotes `given_as` (the option
    or key as the user wrote it: "--gpu H300", "gpu=H300") when the table has no such GPU."""
    peaks = gpu_peaks(gpu)
    if peaks is None:
        raise ConfigError(f"{given_as}: no datasheet peak for it; one of {', '.join(n for n, _ in GPU_PEAK_FLOPS)}"
                          " (the table in lit_pretrain/gpu_peaks.py)")
    return peaks["half"]
