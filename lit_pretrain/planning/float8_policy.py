"""Which linears trainer.float8 converts, and which layouts it runs under: pure, so `show` and `train` refuse the same
configs when the config loads (planning/plan.py calls check_float8), before torch or torchao is imported.

The filter is torchtitan's and OLMo-core's: every linear of the blocks whose two dimensions are multiples of 16
(torch._scaled_mm needs them), read from the architecture table (GPTConfig.block_modules); never the output head,
whose logits feed the loss and whose gradients are the largest of the model (both anchors keep it in bf16).
"""

import importlib.util
from typing import List

from lit_pretrain.errors import ConfigError

RECIPES = ("rowwise", "tensorwise", "rowwise_with_gw_hp")
ALIGNMENT = 16  # torch._scaled_mm: both dimensions of an fp8 operand divisible by 16
PRECISIONS = ("bf16-mixed",)  # the non-fp8 ops (attention, norms, the head) run in bf16, as torchtitan's do


def float8_linears(model, f8=None) -> List[str]:
    """Names of the linears trainer.float8 (`f8`, a Float8Config) converts in `model` (a GPTConfig), in the GPT's
    order (its parameter names without `.weight`)."""
    exclude = f8.exclude if f8 is not None else []
    names = []
    for i in range(model.n_layers):
        for name, spec in model.block_modules(i).items():
            full = f"blocks.{i}.{name}"
            if spec.kind != "linear" or any(d % ALIGNMENT for d in spec.shape):
                continue
            if not any(full == e or full.endswith("." + e) for e in exclude):
                names.append(full)
    return names


def check_float8(plan, trainer, model) -> None:
    """A ConfigError naming the key for a layout trainer.float8 is not built or not validated for. Tested: one process,
    DDP, ZeRO 1-3 on one data-parallel group, activation checkpointing, compile (tests/parallel/test_float8.py)."""
    f8 = plan.float8
    if f8 is None:
        return
    why = "; set trainer.float8=null"
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("trainer.float8 needs torchao, which is not installed: pip install 'lit-pretrain[fp8]' "
                          "(torchao 0.18)" + why)
    if plan.tensor_parallel > 1:
        raise ConfigError(f"trainer.float8 with strategy.tensor_parallel={plan.tensor_parallel} is not supported: fp8 "
                          "linears under tensor parallelism need torchao's float8 tensor-parallel styles, which are "
                          "not built here, and users report NaNs with them (torchtitan #3109)" + why +
                          " or strategy.tensor_parallel=1")
    if plan.pipeline_parallel > 1:
        raise ConfigError(f"trainer.float8 with strategy.pipeline_parallel={plan.pipeline_parallel} is not supported "
                          "(not validated: no parity test of fp8 pipeline stages)" + why +
                          " or strategy.pipeline_parallel=1")
    if model.moe is not None:
        raise ConfigError("trainer.float8 with model.moe is not supported: the routed experts are one grouped matmul "
                          "over stacked weights, not nn.Linear layers, and torchao's fp8 grouped matmul is not built "
                          "here" + why + " or model.moe=null")
    if plan.uses_fsdp and plan.data_parallel_replicate > 1:
        raise ConfigError(f"trainer.float8 with strategy.data_parallel_replicate={plan.data_parallel_replicate} under "
                          f"strategy.zero_stage={plan.zero_stage} (HSDP) is not supported (not validated: the fp8 "
                          "parity test runs FSDP2 over one group)" + why + " or data_parallel_replicate=1")
    if trainer.precision not in PRECISIONS:
        raise ConfigError(f"trainer.float8 with trainer.precision={trainer.precision} is not supported: the ops fp8 "
                          "leaves out (attention, norms, the output head) run in bf16, as in torchtitan; set "
                          "trainer.precision=bf16-mixed, or trainer.float8=null")
    if f8.fsdp_float8_all_gather:
        key = "trainer.float8.fsdp_float8_all_gather=true"
        if f8.recipe != "tensorwise":
            raise ConfigError(f"{key} needs trainer.float8.recipe=tensorwise (one scale per weight, so each shard can "
                              f"be cast before the gather), not {f8.recipe}: set the recipe or "
                              "fsdp_float8_all_gather=false")
        if not plan.uses_fsdp:
            raise ConfigError(f"{key} needs FSDP2 (strategy.zero_stage 2 or 3, it is {plan.zero_stage}): set "
                              "fsdp_float8_all_gather=false")
        if trainer.accelerator not in ("cuda", "gpu"):
            raise ConfigError(f"{key} runs on CUDA only (trainer.accelerator={trainer.accelerator}): the fp8 "
                              "all-gather is not validated on CPU, and users report NaNs with it (torchao #4300); "
                              "set fsdp_float8_all_gather=false (FSDP2 then gathers the weights as today), or "
                              "trainer.accelerator=cuda on a GPU")
    names = float8_linears(model, f8)
    everything = float8_linears(model)
    for e in f8.exclude:
        if not any(n == e or n.endswith("." + e) for n in everything):
            raise ConfigError(f"trainer.float8.exclude names {e!r}, which is not a converted linear of this model "
                              f"(those are {', '.join(sorted({n.split('.', 2)[2] for n in everything}))}, in each "
                              "block, or blocks.<i>.<name>): correct the name")
    if not names:
        raise ConfigError(f"trainer.float8 converts no linear of this model: every block linear has a dimension not "
                          f"divisible by {ALIGNMENT} (model.d_model={model.d_model}, MLP width {model.hidden_dim}) "
                          "or is excluded; choose multiples of 16" + why)
