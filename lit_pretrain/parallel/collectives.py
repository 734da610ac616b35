"""Collectives the parallel wrappers share, written once: Megatron-LM's f and g operators (Shoeybi et al. 2019,
§3; tensor.py's linears, vocab.py's embedding and head) and the flat all-reduce."""

from typing import List, Optional

import torch
import torch.distributed as dist


def all_reduce_flat(tensors: List[torch.Tensor], group, divide_by: Optional[int] = None) -> None:
    """Sum `tensors` in place over `group` as one flat all-reduce (then divide by `divide_by`, for a mean).

    One collective instead of one per tensor: gloo and NCCL both pay a latency per call that dwarfs the bytes of
    small gradients (norm weights, QK-norm), and the flat buffer is summed in one fixed order on every rank."""
    if not tensors:
        return
    flat = torch.cat([t.flatten() for t in tensors])
    dist.all_reduce(flat, group=group)
    if divide_by is not None:
        flat /= divide_by
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward (sum the partial products), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None
