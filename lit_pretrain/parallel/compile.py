"""Regional compile: `torch.compile` of each block's forward, applied from outside the GPT.

Compiling the repeated block rather than the whole model (torchtitan's `apply_compile`, PyTorch's "regional
compilation" recipe) compiles one graph that every block reuses: compile time stays that of one block whatever the
depth, and the graph boundary at each block is where activation checkpointing and FSDP2's per-block all-gathers
already cut the model. `fullgraph=True` makes a graph break an error instead of a silent slow path.

Order (torchtitan's `parallelize`): activation checkpointing, then compile, then FSDP. A checkpointed block is
compiled inside its wrapper, so the recomputation in backward runs the compiled forward too; FSDP2's hooks stay
outside the compiled region (they sit on the module, not in `forward`). DDP wraps the whole model later and only
sees a module whose blocks happen to be compiled.

Inductor builds its generated kernels with the system's C++ compiler at run time: `check_toolchain` fails up
front, naming `trainer.compile`, instead of at the first step.
"""

import os
import shutil

import torch
from torch import nn

from lit_pretrain.errors import ConfigError

_COMPILED = "_lit_pretrain_compiled"


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would call ($CXX, else c++/g++/clang++ on PATH), or None."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    return None


def check_toolchain() -> None:
    """Raise a ConfigError naming trainer.compile when torch.compile cannot build its kernels here.

    Inductor writes C++ for CPU kernels and builds a C launcher for Triton's GPU kernels: either way it calls the
    system compiler at the first step, so a missing one is reported before training starts.
    """
    if cxx_compiler() is None:
        raise ConfigError(
            "trainer.compile=true needs a C++ compiler (torch.compile's inductor backend builds the kernels it "
            "generates with it) and none was found ($CXX, c++, g++, clang++): install one (e.g. `apt-get install "
            "g++`) or set trainer.compile=false"
        )


def compile_blocks(model: nn.Module) -> int:
    """Compile the forward of every block in `model.blocks` in place; return how many were compiled.

    The block's own `forward` is compiled (an instance attribute), not its `__call__`: module hooks (FSDP2's
    all-gather and reshard) stay outside the graph, and a checkpoint wrapper stays eager around the compiled
    block, so its recomputation in backward calls the compiled forward. Parameters, names and state dicts are
    unchanged. Applying twice changes nothing (Lightning may call configure_model again).
    """
    count = 0
    for block in model.blocks:
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        if not getattr(inner, _COMPILED, False) and not isinstance(inner, nn.Identity):
            inner.forward = torch.compile(inner.forward, fullgraph=True)
            setattr(inner, _COMPILED, True)
            count += 1
    return count


def is_compiled(block: nn.Module) -> bool:
    return bool(getattr(getattr(block, "_checkpoint_wrapped_module", block), _COMPILED, False))


def compiler_available() -> bool:
    """Whether `torch.compile` can run on CPU here (used by tests to skip where no C++ compiler exists)."""
    return cxx_compiler() is not None and hasattr(torch, "compile")
