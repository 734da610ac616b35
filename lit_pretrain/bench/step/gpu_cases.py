"""The precision and memory cases of `make bench-gpu` beside torchtitan's published figures: bf16 (today's eager and
compiled pair, bench/step/gpu.py), then, each compiled under FSDP2 (ZeRO stage 3) with bf16-mixed, the FSDP2
mixed-precision policy, selective activation checkpointing and FP8 (trainer.float8, rowwise and tensorwise). Each prints
tokens/s per GPU, its ratio to bf16 compiled in the same process, and MFU against the dense bf16 peak.

torchtitan's rows (benchmarks/llama3_h100_202412_torchtitan.md, Table 1: Llama 3.1 8B, 8 H100 SXM with HBM2e at
500 W, FSDP, local batch 2 of 8,192 tokens, selective activation checkpointing; torch/torchao/torchtitan of
2024-12-23/26) are for another model and scale than a one-GPU preset: printed beside ours as the nearest published
setting, not as a target to match. torchtitan reports no MFU with Float8 (bf16 and fp8 tensor cores have different
peaks); ours divides by the bf16 peak for every case, so an fp8 case's MFU is the bf16-equivalent utilization.
"""

import dataclasses
from typing import Callable, Dict, List, Optional

import torch

# Table 1 of torchtitan's benchmark, tokens/s per GPU.
PUBLISHED = {
    "fsdp": ("FSDP (bf16)", 5762),
    "compile": ("FSDP + torch.compile", 6667),
    "float8": ("FSDP + torch.compile + Float8", 8532),
}
# Goals for `make bench-gpu PRESET=llama3_2_1b` on one H100/H200, against bf16 compiled's tokens/s.
GOALS = {"bf16_policy": "MFU >= 0.40", "selective": ">= 0.90", "fp8_rowwise": ">= 1.10", "fp8_tensorwise": ">= 1.10"}


def _policy(model, c):
    return model, c


def _selective(model, c):
    return model, dataclasses.replace(c, strategy=dataclasses.replace(c.strategy, activation_checkpointing="selective"))


def _fp8(recipe: str):
    def tweak(model, c):
        from lit_pretrain.schema import Float8Config

        return model, dataclasses.replace(c, trainer=dataclasses.replace(c.trainer, float8=Float8Config(recipe=recipe)))
    return tweak


# name: (what changes from bf16 compiled, the published row it sits beside)
CASES: Dict[str, tuple] = {
    "bf16_policy": (_policy, "compile"),
    "selective": (_selective, "compile"),
    "fp8_rowwise": (_fp8("rowwise"), "float8"),
    "fp8_tensorwise": (_fp8("tensorwise"), "float8"),
}


def available(name: str) -> Optional[str]:
    """None when case `name` can run in this checkout, else why not: selective activation checkpointing needs
    "selective" among parallel/activation_checkpointing.py's MODES; fp8 needs torchao, the [fp8] extra."""
    if name == "selective":
        from lit_pretrain.parallel.activation_checkpointing import MODES

        if "selective" not in MODES:
            return "strategy.activation_checkpointing=selective is not in this checkout"
    if name.startswith("fp8"):
        try:
            import torchao  # noqa: F401
        except ImportError:
            return "torchao is not installed: pip install 'lit-pretrain[fp8]'"
        if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
            return "this GPU has no fp8 tensor cores (compute capability < 8.9)"
    return None


def gathered_dtype_probe():
    """A Lightning callback recording, at the start of training, the dtype FSDP2 gathers the weights in
    (`param_dtype` of the first sharded module's MixedPrecisionPolicy): bfloat16 under the mixed-precision policy,
    float32 when it gathers the fp32 weights and autocast casts a copy per matmul (today's bf16-mixed); and the
    number of Float8Linear modules the run trains with."""
    import lightning as L

    class GatheredDtype(L.Callback):
        dtype, float8_linears = None, None

        def on_train_start(self, trainer, pl_module):
            from torch.distributed.fsdp import FSDPModule

            # trainer.float8: how many linears apply_plan converted (0 without it), as the run holds them.
            self.float8_linears = sum(type(m).__name__ == "Float8Linear" for m in pl_module.model.modules())

            sharded = next((m for m in pl_module.model.modules() if isinstance(m, FSDPModule)), None)
            if sharded is not None:
                from lit_pretrain.internals import fsdp_mixed_precision_policy

                policy = fsdp_mixed_precision_policy(sharded)
                dtype = getattr(policy, "param_dtype", None) or next(pl_module.model.parameters()).dtype
                self.dtype = str(dtype).removeprefix("torch.")

    return GatheredDtype()


def run_cases(c, model_name: str, names: List[str], tokens_per_s: Callable, reference: float, flops_per_token: float,
              peak: float, devices: int) -> List[Dict]:
    """One result per case of `names`: `tokens_per_s(config, callbacks)` runs the step of a config (compiled, FSDP2
    ZeRO-3, bf16-mixed, as bf16 compiled) with those Lightning callbacks; `reference`: bf16 compiled's tokens/s (the
    node's)."""
    from lit_pretrain.bench.step.mfu import mfu

    out = []
    for name in names:
        tweak, row = CASES[name]
        why = available(name)
        if why is not None:
            print(f"{name}: not run: {why}", flush=True)
            continue
        model, cfg = tweak(c.model, c)
        probe = gathered_dtype_probe()
        value = tokens_per_s(dataclasses.replace(cfg, model=model), [probe])
        label, published = PUBLISHED[row]
        out.append({"case": f"gpu_{model_name}_{name}_tokens_per_s", "value": value, "reference": reference,
                    "ratio": value / reference, "goal": GOALS.get(name, "-"), "unit": "tokens/s",
                    "detail": {"tokens_per_s_per_gpu": value / devices, "mfu": mfu(value, flops_per_token, peak),
                               "gathered_dtype": probe.dtype, "float8_linears": probe.float8_linears, "name": name,
                               "torchtitan_row": label, "torchtitan_tokens_per_s_per_gpu": published}})
    return out


def published_table(results: List[Dict], pair: Dict[str, float], devices: int, flops_per_token: float,
                    peak: float) -> str:
    """The table printed after the runs: tokens/s/GPU and MFU of every case beside torchtitan's row."""
    from lit_pretrain.bench.step.mfu import mfu

    rows = [(name, tps / devices, mfu(tps, flops_per_token, peak), "-", "-", PUBLISHED[row])
            for name, tps, row in (("bf16_eager", pair["eager"], "fsdp"), ("bf16", pair["compiled"], "compile"))]
    rows += [(r["detail"]["name"], r["detail"]["tokens_per_s_per_gpu"], r["detail"]["mfu"],
              r["detail"]["gathered_dtype"] or "-", r["detail"]["float8_linears"],
              (r["detail"]["torchtitan_row"], r["detail"]["torchtitan_tokens_per_s_per_gpu"])) for r in results]
    lines = [f"{'case':<16} {'tokens/s/GPU':>13} {'MFU':>7} {'gathered':>9} {'fp8 linears':>11}  "
             "torchtitan tokens/s/GPU (Llama 3.1 8B, 8 H100)"]
    for name, per_gpu, m, dtype, fp8, (label, published) in rows:
        lines.append(f"{name:<16} {per_gpu:>13,.0f} {m:>7.1%} {dtype:>9} {fp8:>11}  {published:,} ({label})")
    return "\n".join(lines)
