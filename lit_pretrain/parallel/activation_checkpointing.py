"""Activation checkpointing applied from outside the GPT: whole blocks, non-reentrant.

A checkpointed block keeps only its input for the backward pass and runs its forward again there: the memory of
its internal activations is traded for one more forward of the block (about a third more compute for that block,
since backward costs about twice the forward). Non-reentrant (`use_reentrant=False`), as PyTorch recommends: it
composes with FSDP2 and DDP, supports inputs that don't require grad, and keeps torch.autograd.grad working.

Blocks are wrapped in PyTorch's `checkpoint_wrapper` (as torchtitan and Lightning's FSDP policy do); its state-dict
hooks drop the `_checkpoint_wrapped_module.` prefix, so checkpoints keep the plain GPT's parameter names.
"""

from typing import List

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

MODES = ("none", "full", "every_k")


def checkpointed_block_indices(mode: str, n_layers: int, k: int = 2) -> List[int]:
    """Which blocks a policy recomputes: none → [], full → all, every_k → 0, k, 2k, ... (torchtitan's `ac_freq`)."""
    if mode == "none":
        return []
    if mode == "full":
        return list(range(n_layers))
    if mode == "every_k":
        if k < 1:
            raise ValueError(f"model.activation_checkpointing_k={k}: must be at least 1")
        return list(range(0, n_layers, k))
    raise ValueError(f"model.activation_checkpointing={mode!r}: expected one of {', '.join(MODES)}")


def apply_activation_checkpointing(model: nn.Module, mode: str, k: int = 2) -> List[int]:
    """Wrap the chosen blocks of `model.blocks` in place; return their indices. Applying twice changes nothing."""
    indices = checkpointed_block_indices(mode, len(model.blocks), k)
    for i in indices:
        # nn.Identity: a block another pipeline stage holds (parallel/pipeline.py prunes them).
        if not isinstance(model.blocks[i], (CheckpointWrapper, nn.Identity)):
            model.blocks[i] = checkpoint_wrapper(model.blocks[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return indices


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module, CheckpointWrapper)
