"""Collectives the parallel wrappers share, written once."""

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
