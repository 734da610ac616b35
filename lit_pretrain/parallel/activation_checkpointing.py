"""Activation checkpointing applied from outside the GPT: whole blocks, or op by op (selective), non-reentrant.

A checkpointed block keeps only its input for the backward pass and runs its forward again there: the memory of
its internal activations is traded for one more forward of the block (about a third more compute for that block,
since backward costs about twice the forward). Non-reentrant (`use_reentrant=False`), as PyTorch recommends: it
composes with FSDP2 and DDP, supports inputs that don't require grad, and keeps torch.autograd.grad working.

Selective (torchtitan's op-level policy, `_apply_op_sac`): every block is checkpointed, but the outputs of the ops
that are costly to recompute (matmuls, the attention kernel, collectives) are kept, and only the cheap elementwise
and normalization ops (norms, RoPE, SiLU, the residual adds, casts) run again in the backward. It keeps most of
the compute of no checkpointing at a fraction of its memory (Korthikanti et al. 2022, §5: recompute what is cheap
and large). `save_matmuls=every_other` keeps only the 1st, 3rd, ... matmul of each block, as torchtitan's policy
does, trading a little more compute (half the matmuls' forward) for less memory.

Blocks are wrapped in PyTorch's `checkpoint_wrapper` (as torchtitan and Lightning's FSDP policy do); its state-dict
hooks drop the `_checkpoint_wrapped_module.` prefix, so checkpoints keep the plain GPT's parameter names.
"""

from collections import defaultdict
from functools import partial
from typing import Callable, List, Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lit_pretrain.internals import CheckpointImpl, CheckpointWrapper, checkpoint_wrapper

MODES = ("none", "full", "every_k", "selective")
SAVE_MATMULS = ("all", "every_other")


def _ops(*names: str) -> set:
    """The overloads of `names` ("aten.mm", ...) this torch build has (the attention kernels differ by version)."""
    out = set()
    for name in names:
        namespace, op = name.split(".")
        packet = getattr(getattr(torch.ops, namespace, None), op, None)
        if packet is not None and hasattr(packet, "default"):
            out.add(packet.default)
    return out


# What torchtitan's op policy saves, with the CPU attention kernel beside the GPU ones. The functional collectives
# are DTensor's; our own tensor- and sequence-parallel layers (parallel/collectives.py, sequence.py) all-reduce,
# all-gather and reduce-scatter in place (c10d ops writing into a buffer the block allocates), which a cache cannot
# stand in for: the buffer is recomputed empty and only running the op fills it. They run again in the backward, as
# under full checkpointing (one more collective per row-parallel linear; the losses stay bit-identical,
# tests/parallel/test_mesh_parallel.py).
#
# model.moe: the router is an mm and the routed experts' three products are `aten._grouped_mm` calls inside one
# autograd Function (model/moe_kernels.py): matmuls too, kept (counted by every_other in forward order). The routing
# is data-dependent: `aten.topk`'s indices and values are kept (12 bytes per token copy), so the recomputation routes
# exactly as the forward did by construction, whatever the kernels do with ties; the argsort, bincount, gathers and
# the capacity mask then rerun from them (integer ops, exact). Expert parallelism's all-to-alls (parallel/expert.py)
# are in-place c10d ops like the tensor-parallel ones above: they run again in the recomputation, with the same
# split sizes (from the kept routing), three per MoE layer, as under full checkpointing.
MATMULS = _ops("aten.mm", "aten.addmm", "aten.bmm", "aten._grouped_mm")
SAVED = MATMULS | _ops("aten.topk") | _ops(
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional.reduce_scatter_tensor", "_c10d_functional.all_reduce", "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.all_to_all_single")


class SelectivePolicy:
    """The context_fn of a selectively checkpointed block: a fresh op policy per forward (the matmul count restarts
    at each block, as torchtitan's meta dict does). `recorder` (tests, parallel/memory.py) sees each forward's cache
    of saved outputs; None in training."""

    def __init__(self, save_matmuls: str = "all"):
        if save_matmuls not in SAVE_MATMULS:
            raise ValueError(f"strategy.activation_checkpointing_save_matmuls={save_matmuls!r}: expected one of "
                             f"{', '.join(SAVE_MATMULS)}")
        self.save_matmuls = save_matmuls
        self.recorder: Optional[Callable[[dict], None]] = None

    def __call__(self):
        counts = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            # Called in the forward only: torch records each op's decision then and replays it in the recomputation.
            if func in MATMULS and self.save_matmuls == "every_other":
                counts["matmuls"] += 1
                if counts["matmuls"] % 2 == 0:  # the 2nd, 4th, ... matmul of the block
                    return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if func in SAVED else CheckpointPolicy.PREFER_RECOMPUTE

        contexts = create_selective_checkpoint_contexts(policy)
        if self.recorder is not None:
            self.recorder(contexts[0].storage)
        return contexts


def _contexts(policy: SelectivePolicy):
    return policy()


def checkpointed_block_indices(mode: str, n_layers: int, k: int = 2) -> List[int]:
    """Which blocks a policy recomputes: none → [], full and selective → all, every_k → 0, k, 2k, ... (torchtitan's
    `ac_freq`)."""
    if mode == "none":
        return []
    if mode in ("full", "selective"):
        return list(range(n_layers))
    if mode == "every_k":
        if k < 1:
            raise ValueError(f"strategy.activation_checkpointing_k={k}: must be at least 1")
        return list(range(0, n_layers, k))
    raise ValueError(f"strategy.activation_checkpointing={mode!r}: expected one of {', '.join(MODES)}")


def apply_activation_checkpointing(model: nn.Module, mode: str, k: int = 2, save_matmuls: str = "all") -> List[int]:
    """Wrap the chosen blocks of `model.blocks` in place; return their indices. Applying twice changes nothing."""
    indices = checkpointed_block_indices(mode, len(model.blocks), k)
    # A function, not the policy object: torch.compile traces a checkpoint's context_fn only as a function or a
    # functools.partial of one.
    extra = {"context_fn": partial(_contexts, SelectivePolicy(save_matmuls))} if mode == "selective" else {}
    for i in indices:
        # nn.Identity: a block another pipeline stage holds (parallel/pipeline.py prunes them).
        if not isinstance(model.blocks[i], (CheckpointWrapper, nn.Identity)):
            model.blocks[i] = checkpoint_wrapper(model.blocks[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT, **extra)
    return indices


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module, CheckpointWrapper)


def selective_policy(module: nn.Module) -> Optional[SelectivePolicy]:
    """The op policy of a selectively checkpointed block (a CheckpointWrapper), else None."""
    fn = getattr(module, "checkpoint_fn", None)
    context_fn = getattr(fn, "keywords", {}).get("context_fn")
    policy = context_fn.args[0] if isinstance(context_fn, partial) and context_fn.args else None
    return policy if isinstance(policy, SelectivePolicy) else None
