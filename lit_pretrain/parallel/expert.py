"""Expert parallelism (strategy.expert_parallel), first step: the routed experts' compute split across the
data-parallel ranks, tokens dispatched to the rank that owns their expert and combined back with all-to-all.

Rank r of an expert-parallel group of P ranks owns experts [r·E/P, (r+1)·E/P). Each MoE layer routes its own tokens
as before, sorts the token copies by expert, and sends each rank the copies of its experts
(`torch.distributed.all_to_all_single` with the per-rank counts as split sizes: gloo supports uneven splits on CPU,
so no padding to a capacity is needed and the layer stays dropless); the owner regroups what it received by local
expert, runs the grouped matmul on its slice of the expert weights, and the outputs travel back the same way
(the backward runs the two exchanges in reverse: `_AllToAll`). Weighting by the router score and the sum over a
token's k experts stay on the token's own rank.

What this step does not do yet: the expert weights stay replicated (each rank holds all E, computes with its E/P):
the compute and activation memory of the experts are split, their parameter and optimizer memory are not. That
keeps every other piece unchanged and exact: an expert's gradient is non-zero only on its owner, where it is the
sum over every rank's tokens of d(rank's mean loss)/dw, so data parallelism's gradient average gives the
one-process gradient; optimizer state, clipping norm and checkpoints are those of plain data parallelism.
Any ZeRO stage composes as it is: FSDP2's reduce-scatter averages the same gradients, and at ZeRO-3 its dim-0
shards of a stacked (E, out, in) weight are whole experts, E/P per rank, those the rank owns when EP equals the
data-parallel degree (the forward still all-gathers the stack and slices its own). Expert groups smaller than the
data-parallel world (EP x expert-data-parallel), with weights sharded by expert and their own gradient reduction, are
the next step; until then strategy.expert_parallel equals the data-parallel degree (tests/test_moe_parallel.py: EP 2
and EP 2 x ZeRO-3 against one process).
The exchange uses its own process group, so its collectives never interleave with DDP's gradient all-reduces.
"""

from typing import List

import torch
import torch.distributed as dist
from torch import nn


class _AllToAll(torch.autograd.Function):
    """Rows of x (sum(send), ...) go to each rank in `send` split sizes; returns the (sum(recv), ...) rows received.
    Backward: the gradients travel back with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: List[int], send: List[int], group) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


class ExpertDispatch:
    """An MoE layer's `expert_dispatch` under expert parallelism: its experts split over `group`'s ranks."""

    def __init__(self, layer, group, degree: int, rank: int):
        self.layer, self.group, self.degree, self.rank = layer, group, degree, rank

    def __call__(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return dispatch_compute_combine(self.layer, xs, counts, self.group, self.degree, self.rank)


def dispatch_compute_combine(layer, xs: torch.Tensor, counts: torch.Tensor, group, P: int, rank: int) -> torch.Tensor:
    """The experts' outputs for the token copies xs (M, d), sorted by expert with counts (E,) per expert, computed
    by the rank of `group` (P ranks; this one is `rank`) that owns each; returned in xs's order, unweighted."""
    E = counts.shape[0]
    L = E // P  # experts per rank
    # How many copies each rank sends to each of my L experts: (P, L), source-rank major.
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(P, L)
    send = counts.view(P, L).sum(1).tolist()  # host: the split sizes (one sync per layer, as any all-to-all MoE)
    recv = recv_counts.sum(1).tolist()
    xr = _AllToAll.apply(xs, recv, send, group)  # (R, d): by source rank, then by my local expert
    local = torch.arange(L, device=xs.device).repeat(P).repeat_interleave(recv_counts.flatten())  # (R,)
    order = local.argsort(stable=True)  # regroup by local expert (source ranks in order within each)
    offsets = recv_counts.sum(0).cumsum(0).to(torch.int32)  # (L,)
    lo, hi = rank * L, (rank + 1) * L
    yl = layer.experts_forward(xr[order], offsets, lo, hi)  # (R, d) by local expert
    yr = torch.empty_like(yl).index_copy(0, order, yl)  # back to the order received
    return _AllToAll.apply(yr, send, recv, group)  # (M, d) in xs's order


def apply_expert_parallel(model: nn.Module, degree: int) -> None:
    """Give every MoE layer of `model` the expert-parallel group: the whole world for now (degree = data-parallel
    degree, checked at config load). Collective: every rank calls it (configure_model does)."""
    from lit_pretrain.moe import moe_layers

    world = dist.get_world_size()
    if degree != world:
        raise ValueError(f"strategy.expert_parallel={degree} must equal the {world} data-parallel ranks for now")
    group = dist.new_group(list(range(world)))  # its own group: never interleaved with DDP's all-reduces
    for layer in moe_layers(model):
        if layer.cfg.num_experts % degree:
            raise ValueError(f"model.moe.num_experts={layer.cfg.num_experts} is not divisible by "
                             f"strategy.expert_parallel={degree}")
        layer.expert_dispatch = ExpertDispatch(layer, group, degree, dist.get_rank())
