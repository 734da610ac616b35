"""ThroughputMonitor: tokens/s, samples/s, model FLOPs/s and MFU, read once per logging interval.

Model FLOPs utilization (PaLM, Chowdhery et al. 2022, appendix B) is the whole model's training FLOPs per token
(`model.shapes.flops_per_token`: 6·N + 12·L·H·Q·T, from the architecture table, never one rank's part of the model)
times the global tokens per second, over the peak FLOP/s of all devices. The peak
comes from `trainer`'s config when set, else from a table of dense (no sparsity) datasheet figures of common GPUs
(lit_pretrain/gpu_peaks.py), else, on a CPU, from a matmul measured once at start-up in the training dtype. Tokens
are counted from batch shapes (host data) and time is read at interval ends only; on a GPU the interval end waits
for the device once, so the figure covers the work actually done.
"""

import time
from functools import lru_cache
from typing import Dict, Optional

import torch
from lightning.pytorch.callbacks import Callback

from lit_pretrain.gpu_peaks import gpu_peaks


def precision_class(precision: str) -> str:
    """Lightning precision → the matmul precision that sets the peak."""
    if precision.startswith(("bf16", "16")):
        return "half"
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"


def gpu_peak_flops(device_name: str, precision: str) -> Optional[float]:
    peaks = gpu_peaks(device_name)
    return None if peaks is None else peaks[precision_class(precision)]


@lru_cache(maxsize=4)
def measured_cpu_peak_flops(dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5) -> float:
    """Best of `repeats` n×n matmuls on this process's threads: 2·n³ FLOPs each (once per process and dtype)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # the first call pays one-time set-up (allocation, kernel selection): not timed
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def peak_flops_per_device(device: torch.device, precision: str) -> Optional[float]:
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), precision)
    if device.type == "cpu":
        return measured_cpu_peak_flops(torch.bfloat16 if precision.startswith("bf16") else torch.float32)
    return None


class ThroughputMonitor(Callback):
    def __init__(self, log_every_n_steps: int = 10, flops_per_token: Optional[int] = None,
                 peak_flops_per_s: Optional[float] = None):
        """flops_per_token: None counts it from `pl_module.model_cfg` (the whole model's architecture table).
        peak_flops_per_s: per device; None looks it up (GPU table, CPU measurement); MFU is not reported when no peak
        is known."""
        self.log_every_n_steps = max(1, log_every_n_steps)
        self.flops_per_token, self.peak_flops_per_s = flops_per_token, peak_flops_per_s
        self.totals = {"tokens": 0, "samples": 0, "seconds": 0.0}
        self.last: Dict[str, float] = {}
        self._tokens = self._samples = 0
        self._start: Optional[float] = None
        self._paused_at: Optional[float] = None

    def on_train_start(self, trainer, pl_module) -> None:
        if self.flops_per_token is None and getattr(pl_module, "model_cfg", None) is not None:
            from lit_pretrain.model.shapes import flops_per_token

            # the config, not pl_module.model: under tensor, pipeline or expert parallelism a rank holds a part
            self.flops_per_token = flops_per_token(pl_module.model_cfg)
        if self.peak_flops_per_s is None:
            self.peak_flops_per_s = peak_flops_per_device(trainer.strategy.root_device, str(trainer.precision))
        self._world = trainer.world_size
        # Tensor- and pipeline-parallel ranks of one replica read the same micro-batch: the global batch is one
        # micro-batch per data-parallel rank (the sampler's count), not per process.
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        self._data_parallel = kwargs.get("num_replicas", trainer.world_size)
        self._start = time.perf_counter()
        # A resumed run starts at a step already logged: its first micro-batches are not a new step to report.
        self._logged_step = trainer.global_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        self._tokens += x.numel() * self._data_parallel  # every data-parallel rank runs the same micro-batch shape
        self._samples += x.shape[0] * self._data_parallel

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._start is not None:
            self._paused_at = time.perf_counter()  # validation time is not training throughput

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._paused_at is not None and self._start is not None:
            self._start += time.perf_counter() - self._paused_at
        self._paused_at = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == 0 or step % self.log_every_n_steps or step == getattr(self, "_logged_step", None):
            return
        self._logged_step = step
        self._flush(trainer, step)

    def on_train_end(self, trainer, pl_module) -> None:
        self._flush(trainer, trainer.global_step)

    def _flush(self, trainer, step: int) -> None:
        if self._start is None or not self._tokens:
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # once per interval: count the time of the work queued, not of queueing it
        now = time.perf_counter()
        seconds = now - self._start
        self.totals["tokens"] += self._tokens
        self.totals["samples"] += self._samples
        self.totals["seconds"] += seconds
        self.last = self.rates(self._tokens, self._samples, seconds)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({f"throughput/{k}": v for k, v in self.last.items()}, step=step)
        self._tokens = self._samples = 0
        self._start = now

    def rates(self, tokens: int, samples: int, seconds: float) -> Dict[str, float]:
        out = {"tokens_per_s": tokens / seconds, "samples_per_s": samples / seconds}
        if self.flops_per_token:
            out["flops_per_s"] = out["tokens_per_s"] * self.flops_per_token
            if self.peak_flops_per_s:
                out["mfu"] = out["flops_per_s"] / (self.peak_flops_per_s * self._world)
        return out

    def summary(self) -> Dict:
        t = self.totals
        out = self.rates(t["tokens"], t["samples"], t["seconds"]) if t["seconds"] > 0 else {}
        return {**out, "peak_flops_per_s_per_device": self.peak_flops_per_s, "flops_per_token": self.flops_per_token}

    def state_dict(self) -> Dict:
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state: Dict) -> None:
        self.totals = dict(state["totals"])
