"""trainer.compile: `torch.compile` of the training step's forward and loss, applied from outside the GPT.

Two shapes, by what wraps the model (`compile_model`, chosen in parallel/apply.py):

- one process without FSDP (the default `make train`): the whole forward and the loss as one graph. Inductor then
  fuses across the blocks, the embedding and the cross-entropy over the vocabulary: the loss's forward and backward
  are a few fused passes over the (B·T, V) logits instead of log-softmax's, NLL's and their backwards' separate
  ones.
- data parallelism (DDP, ZeRO stage 1), FSDP (ZeRO stages 2 and 3, on any number of processes) or activation
  checkpointing: each block's forward (regional compile: torchtitan's `apply_compile`, PyTorch's "regional
  compilation" recipe), and the loss as a graph of its own. One block graph serves every block, and the block
  boundary is where FSDP2's per-block all-gathers and reduce-scatters and DDP's gradient buckets already cut the
  step; a whole-model graph would hand back every gradient at the end of one backward graph, leaving nothing to
  overlap their communication with. FSDP2's hooks stay outside the compiled region (they sit on the module, not in
  `forward`), and the root's parameters (embedding, head) are gathered only while the GPT's own forward runs: the
  loss takes the logits. A checkpointed block is compiled inside its wrapper, so the recomputation in backward runs
  the compiled forward; a selectively checkpointed one is compiled with its wrapper, so the op policy is traced
  into the graph (torchtitan's order: checkpointing, then compile of the wrapped block).

Measured on the default model (2 shared cores, torch 2.13, raw steps alternated in one process; README
"Performance"): eager 344 ms a step, regional blocks alone 308 ms, regional blocks and the compiled loss 280 ms,
the whole step 270 ms. The compiled step is then bound by the matrix multiplications (about 190 ms, near the
BLAS's peak) and SDPA's attention kernels (about 30 ms). `fullgraph=True` makes a graph break an error instead of
a silent slow path.

Only training runs compiled: under torch.no_grad (validation, generation, evaluation) the eager forward runs, so no
second, forward-only graph is compiled (2.5 s measured for the blocks' on a cold cache) for a pass that is a few
percent of a run, and decoding's changing lengths recompile nothing.

Inductor builds its generated kernels with the system's C++ compiler at run time: `check_toolchain` fails up
front, naming `trainer.compile`, instead of at the first step.
"""

import functools
from typing import Callable, Optional

import torch
from torch import nn

from lit_pretrain.errors import ConfigError
from lit_pretrain.model.losses import chunked_lm_losses, lm_losses
from lit_pretrain.planning.compile_policy import missing_toolchain

_COMPILED = "_lit_pretrain_compiled"


def check_toolchain() -> None:
    """Raise a ConfigError naming trainer.compile when torch.compile cannot build its kernels here.

    Inductor writes C++ for CPU kernels (Python extension modules: Python.h) and builds a C launcher for Triton's GPU
    kernels: either way it calls the system compiler at the first step, so a missing toolchain is reported before
    training starts.
    """
    missing = missing_toolchain()
    if missing is not None:
        raise ConfigError(
            f"trainer.compile=true needs a C++ compiler and Python's headers (torch.compile's inductor backend "
            f"builds the kernels it generates with them), but {missing}: install them (e.g. `apt-get install g++ "
            f"python3-dev`) or set trainer.compile=false (or auto, which then runs eager)"
        )


def training_only(compiled: Callable, eager: Callable) -> Callable:
    """`compiled` while autograd records (training), `eager` under torch.no_grad / inference_mode."""

    @functools.wraps(eager)
    def call(*args, **kwargs):
        return (compiled if torch.is_grad_enabled() else eager)(*args, **kwargs)

    return call


def compile_blocks(model: nn.Module) -> int:
    """Compile the forward of every block in `model.blocks` in place; return how many were compiled.

    The block's own `forward` is compiled (an instance attribute), not its `__call__`: module hooks (FSDP2's
    all-gather and reshard) stay outside the graph, and a checkpoint wrapper stays eager around the compiled
    block, so its recomputation in backward calls the compiled forward. Parameters, names and state dicts are
    unchanged. Applying twice changes nothing (Lightning may call configure_model again).
    """
    from lit_pretrain.parallel.activation_checkpointing import selective_policy

    count = 0
    for block in model.blocks:
        # A selectively checkpointed block is compiled with its wrapper, as torchtitan compiles it: dynamo traces the
        # checkpoint and its op policy into the graph, whose partitioner then keeps the outputs the policy saves.
        # Compiled inside the wrapper, the whole compiled region would be one opaque op to the policy: recomputed.
        inner = block if selective_policy(block) is not None else getattr(block, "_checkpoint_wrapped_module", block)
        if not getattr(inner, _COMPILED, False) and not isinstance(inner, nn.Identity):
            inner.forward = training_only(torch.compile(inner.forward, fullgraph=True), inner.forward)
            setattr(inner, _COMPILED, True)
            count += 1
    return count


def is_compiled(block: nn.Module) -> bool:
    return bool(getattr(block, _COMPILED, False) or
                getattr(getattr(block, "_checkpoint_wrapped_module", block), _COMPILED, False))


def _forward_losses(gpt: nn.Module, idx: torch.Tensor, targets: torch.Tensor,
                    document_ids: Optional[torch.Tensor] = None, z_loss: float = 0.0):
    """(task loss, z-loss) of the GPT on idx (B, T) against targets (B, T): what the module's training step computes
    (losses.lm_losses of the model's logits; model.loss_chunk_size: the chunked head and loss inside the forward)."""
    chunk = gpt.cfg.loss_chunk_size
    if chunk is not None:
        return gpt(idx, document_ids=document_ids, output=lambda model, hidden, _: chunked_lm_losses(
            model.head, hidden, targets, chunk, z_loss))
    logits = gpt(idx) if document_ids is None else gpt(idx, document_ids=document_ids)  # (B, T, V)
    return lm_losses(logits, targets, z_loss)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """`fn` compiled once per process. The GPT is an argument, not a closure, so dynamo guards on its structure
    rather than its identity: every model of the same architecture (a new module each benchmark repeat, a sweep's
    runs) reuses the graph instead of counting against dynamo's recompile limit."""
    return torch.compile(fn, fullgraph=True)


def _regional(gpt: nn.Module, idx, targets, document_ids=None, z_loss: float = 0.0):
    if gpt.cfg.loss_chunk_size is not None:  # the chunked loss runs eager, around the compiled blocks
        return _forward_losses(gpt, idx, targets, document_ids, z_loss)
    logits = gpt(idx) if document_ids is None else gpt(idx, document_ids=document_ids)  # (B, T, V)
    return _compiled(lm_losses)(logits, targets, z_loss)


def compile_model(gpt: nn.Module, whole: bool) -> Callable:
    """Compile the training step's forward and loss (see the module docstring); return
    `forward_losses(idx, targets, document_ids=None, z_loss=0.0) -> (task loss, z-loss or None)`, which runs eager
    under torch.no_grad. `whole`: one graph for the model and the loss (one process); else each block's forward in
    place and the loss apart."""
    if whole:
        compiled = functools.partial(_compiled(_forward_losses), gpt)
    else:
        compile_blocks(gpt)
        compiled = functools.partial(_regional, gpt)
    return training_only(compiled, functools.partial(_forward_losses, gpt))


def compiler_available() -> bool:
    """Whether `torch.compile` can run on CPU here (used by tests to skip where no C++ compiler exists)."""
    return missing_toolchain() is None and hasattr(torch, "compile")
