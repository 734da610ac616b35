"""trainer.float8: the blocks' linears swapped for torchao's Float8Linear, from outside the GPT (parallel/apply.py calls
convert_float8 before activation checkpointing, compile and FSDP2 wrap them, as torchtitan's model converters run
before its parallelize step).

Float8Linear is an nn.Linear with the same fp32 `weight` Parameter: the state dict keeps the plain GPT's names and
dtypes, so a checkpoint loads into a model without fp8 and back, and the HF export writes plain weights. On a GPU of
compute capability 8.9 or more (H100, H200, L4, Ada) the matmuls run in fp8 (torch._scaled_mm); elsewhere (the CPU)
torchao emulates them (`emulate=True`: the same fp8 casts and scales, the product computed in high precision), so
the CPU tests see the fp8 rounding the GPU would, not its speed.

torchao is an optional extra (`pip install lit-pretrain[fp8]`), imported only here.
"""

import dataclasses
import types
from typing import List

import torch
from torch import nn

from lit_pretrain.planning.float8_policy import float8_linears

FP8_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9) and Hopper (9.0) onward


def emulated(device_type: str) -> bool:
    """Whether the fp8 matmuls are emulated on `device_type`: yes off CUDA; on CUDA a GPU without fp8 tensor cores is
    refused (emulation there only slows the step)."""
    if device_type != "cuda":
        return True
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        raise RuntimeError(f"trainer.float8 needs a GPU with fp8 tensor cores (compute capability 8.9+: H100, H200, "
                           f"L4), but this one has {capability[0]}.{capability[1]}: set trainer.float8=null")
    return False


def torchao_config(f8, emulate: bool):
    """The torchao Float8LinearConfig of a trainer.float8 section."""
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError as err:
        raise RuntimeError("trainer.float8 needs torchao: pip install 'lit-pretrain[fp8]' (torchao 0.18)") from err
    config = Float8LinearConfig.from_recipe_name(f8.recipe)
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=f8.fsdp_float8_all_gather)


def _cpu_autocast_input(module: nn.Module, args):
    """torchao casts a Float8Linear's input to the autocast dtype under CUDA autocast only; do the same under CPU
    autocast, so the output (and the gradient coming back) is bf16 as on the GPU. Without it, rowwise_with_gw_hp's
    high-precision weight gradient multiplies a bf16 gradient by an fp32 input and fails."""
    if torch.is_autocast_enabled("cpu"):
        return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None


def _forward_outside_inference_mode(self, input: torch.Tensor) -> torch.Tensor:
    """Float8Linear's forward, run under torch.no_grad where inference mode is on (Lightning's validation, evaluation):
    torchao's float8 tensors support no op under inference mode (`aten.to`, `aten.reshape` of rowwise scales fail),
    while outside it an inference tensor is a valid input. The same fp8 product either way, so the validation loss
    is the trained model's. A compiled step never runs under inference mode (parallel/compile.py runs eager there),
    and torch.compile cannot trace the test: it is skipped while compiling."""
    if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
        with torch.inference_mode(False), torch.no_grad():
            return type(self).forward(self, input)
    return type(self).forward(self, input)


def convert_float8(gpt: nn.Module, f8, device_type: str = "cpu") -> List[str]:
    """Swap the linears float8_policy.float8_linears names under `f8` (trainer.float8, a Float8Config) for
    Float8Linear, in place; return their names."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    names = set(float8_linears(gpt.cfg, f8))
    config = torchao_config(f8, emulated(device_type))
    # The roles build_linear marks (read by the initializer and the planners) move to the new module.
    roles = {name: (gpt.get_submodule(name).tensor_parallel, gpt.get_submodule(name).residual_projection)
             for name in names}
    convert_to_float8_training(gpt, config=config, module_filter_fn=lambda module, fqn: fqn in names)
    converted = [name for name, module in gpt.named_modules() if isinstance(module, Float8Linear)]
    for name in converted:
        module = gpt.get_submodule(name)
        module.tensor_parallel, module.residual_projection = roles[name]
        module.register_forward_pre_hook(_cpu_autocast_input)
        # A bound method on the instance: deepcopy binds it to the copy (copy._deepcopy_method).
        module.forward = types.MethodType(_forward_outside_inference_mode, module)
    assert sorted(converted) == sorted(names), (converted, names)
    return converted
