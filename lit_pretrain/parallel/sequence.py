"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
§4.2.2), on top of the tensor-parallel layers of tensor.py, the tensor-parallel group passed in explicitly.

Under tensor parallelism alone the residual stream, the RMSNorms and everything between the blocks are replicated:
every rank computes them on the whole sequence and saves the same activations. Sequence parallelism shards that
region along the sequence (dim 1 of (B, T, d_model)) across the tensor-parallel group instead. The paper's f/g pair
around a block's attention or MLP becomes g/ḡ:
- before the column-parallel linears, the input is all-gathered along the sequence (backward: reduce-scatter, which
  also sums the partial input gradients f used to all-reduce);
- after the row-parallel linear, the partial sums are reduce-scattered along the sequence instead of all-reduced
  (backward: all-gather).
An all-reduce costs a reduce-scatter plus an all-gather, so a block moves the same bytes as under tensor
parallelism alone (§4.2.2).

At the edges of the sharded region: the vocabulary-parallel embedding (parallel/vocab.py) reduce-scatters its
partial lookups along the sequence instead of all-reducing them (each rank keeps its chunk of the sum; backward:
all-gather), and the vocabulary-parallel head's input is all-gathered (backward: reduce-scatter, summing the
partial input gradients of each rank's vocabulary columns), as before any column-parallel linear.

Everything is installed on modules (the gathers as forward pre-hooks on the modules holding column-parallel linears
and on the head; the embedding's reduce-scatter inside it), not in GPT.forward, so a pipeline stage that calls
those modules directly gets the same behaviour.

The norms' weight gradients are partial under sequence parallelism (each rank saw T/t positions):
`sync_sequence_parallel_grads` sums them over the tensor-parallel group, once per optimizer step.

What the activations saved for backward become on our block is counted in planning/memory.py
(`block_activation_elements`). Like torchtitan's SequenceParallel, the gathered input of the column-parallel
linears is saved in full (t× the chunk): Megatron-LM instead saves the chunk and all-gathers it again in backward,
which needs one autograd function over q, k and v together (they are fused there); ours are three nn.Linears.
"""

from typing import Iterable, List

import torch
import torch.distributed as dist
from torch import nn

from lit_pretrain.parallel.collectives import all_reduce_flat

SEQ_DIM = 1  # activations are (B, T, d_model)

# The real collectives, so a step moves what the communication formula counts: on torch 2.13 gloo runs
# all-gather and reduce-scatter into single tensors on mesh subgroups (checked on a (1, 2, 2) mesh, and by the 2- and
# 4-process tests; tensor.gather's docstring reports a hang of all-gather on subgroups, not seen with these forms).
# Were one missing, an all-reduce and a narrow would do at twice the bytes of a reduce-scatter. Older torch has only
# the older names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check_divisible(T: int, t: int) -> None:
    if T % t:
        raise ValueError(f"sequence parallelism splits the {T} positions of a window over strategy.tensor_parallel="
                         f"{t} ranks: choose model.seq_len (and any shorter window) divisible by {t}")


def check_seq_len(seq_len: int, t: int) -> None:
    if seq_len % t:
        raise ValueError(f"model.seq_len={seq_len} is not divisible by strategy.tensor_parallel={t}: sequence "
                         f"parallelism gives each tensor-parallel rank seq_len / {t} positions; choose a multiple "
                         f"of {t}")


def all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, T/t, ...) chunks of every rank, in rank order -> (B, T, ...), contiguous.

    The collective concatenates along dim 0, so the result is rearranged once (one copy of the output). Contiguous
    matters: nn.Linear on a strided input copies it inside matmul, and each of q, k, v would then save its own copy.
    """
    t = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((t * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # (t·B, T/t, ...)
    _all_gather_single(out, x, group=group)
    return out.unflatten(0, (t, -1)).transpose(0, 1).reshape(x.shape[0], t * x.shape[1], *x.shape[2:])  # (B, T, ...)


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums (B, T, ...) on every rank -> this rank's chunk (B, T/t, ...) of their sum."""
    t = dist.get_world_size(group)
    _check_divisible(x.shape[SEQ_DIM], t)
    chunks = x.unflatten(SEQ_DIM, (t, -1)).transpose(0, 1)  # (t, B, T/t, ...): chunk r goes to rank r
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)  # (B, T/t, ...)
    _reduce_scatter_single(out, chunks.flatten(0, 1).contiguous(), group=group)  # input (t·B, T/t, ...)
    return out


def split_seq(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's chunk (B, T/t, ...) of a tensor every rank holds in full, as its own storage (so the full
    tensor can be freed)."""
    t = dist.get_world_size(group)
    _check_divisible(x.shape[SEQ_DIM], t)
    return x.chunk(t, dim=SEQ_DIM)[dist.get_rank(group)].contiguous()


class GatherForColumn(torch.autograd.Function):
    """Korthikanti et al.'s g before a column-parallel linear: all-gather forward, reduce-scatter backward (the sum
    of every rank's partial input gradient, and this rank's chunk of it). Saves nothing."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_seq(grad, ctx.group), None


class ReduceScatterFromRow(torch.autograd.Function):
    """Korthikanti et al.'s ḡ after a row-parallel linear: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group), None


class SplitSequence(torch.autograd.Function):
    """Into the sharded region (a replicated module's output, as model.moe's layers: parallel/moe_mesh.py): keep
    this rank's chunk; backward all-gathers the chunks' gradients, so the replicated module gets the whole
    sequence's gradient on every rank."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_seq(grad, ctx.group), None


class GatherForReplicated(torch.autograd.Function):
    """Out of the sharded region into a replicated module (model.moe's layers, parallel/moe_mesh.py): all-gather
    forward; backward keeps this rank's chunk, since the replicated computation produces the same complete gradient
    on every rank (summing would count it t times)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_seq(grad, ctx.group), None


def _first_arg(fn, group):
    def hook(_module, args):
        return (fn.apply(args[0], group), *args[1:])

    return hook


def install_sequence_parallel(model: nn.Module, group, column_parents: Iterable[nn.Module]) -> None:
    """Hook `model` (a GPT, whole or pruned to pipeline stages) for sequence parallelism over `group`: gather into
    each of `column_parents` (the modules whose column-parallel linears read their first input: attn, mlp) and into
    the vocabulary-parallel `lm_head`. The embedding needs no hook: built with sequence_parallel=True it
    reduce-scatters itself (parallel/vocab.py). Idempotent: a hooked module is not hooked twice."""
    check_seq_len(model.cfg.seq_len, dist.get_world_size(group))

    def once(module, register, hook):
        if module is not None and not getattr(module, "_sequence_parallel_hooked", False):
            register(module)(hook)
            module._sequence_parallel_hooked = True

    for parent in column_parents:
        once(parent, lambda m: m.register_forward_pre_hook, _first_arg(GatherForColumn, group))
    once(getattr(model, "lm_head", None), lambda m: m.register_forward_pre_hook, _first_arg(GatherForColumn, group))


NORM_TYPES = (nn.RMSNorm, nn.LayerNorm)


def sequence_parallel_params(model: nn.Module) -> List[nn.Parameter]:
    """The parameters that see only this rank's chunk of the sequence: every norm's (the blocks' pre-norms and the
    final norm), in a fixed order so every rank of the group lines them up the same way."""
    out, seen = [], set()
    for module in model.modules():
        # QK-norm's norms act inside the head-sharded region on the gathered sequence: their gradient is partial
        # over heads, not over the sequence (tensor.sync_partial_grads sums it).
        if isinstance(module, NORM_TYPES) and getattr(module, "tensor_parallel", None) != "partial":
            for p in module.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


def sync_sequence_parallel_grads(model: nn.Module, group) -> None:
    """Sum the norms' weight gradients over the tensor-parallel group (one flat all-reduce): each rank holds the
    gradient of its sequence chunk only. Call once per optimizer step, after backward (and accumulation) and before
    the gradient norm; afterwards they are equal on every tensor-parallel rank, like any replicated parameter's."""
    # Under FSDP (ZeRO-2/3 x TP) each rank sums its own shard: every rank of the group holds the same shard of them.
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
             for p in sequence_parallel_params(model) if p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    all_reduce_flat(grads, group)
