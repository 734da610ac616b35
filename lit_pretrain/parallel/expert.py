"""Expert parallelism (strategy.expert_parallel = P): each MoE layer's routed experts split across P data-parallel
ranks, tokens dispatched to the rank that owns their expert and combined back with all-to-all.

Groups. The data-parallel ranks of one (pipeline stage, tensor-parallel rank) are numbered d = replica x shard +
shard index (the sampler's order); expert group q is d in [qP, (q+1)P), and rank d holds experts
[(d mod P)·E/P, (d mod P + 1)·E/P) of every MoE layer on its stage: only those, as parameters of shape (E/P, ...)
(`apply_expert_parallel` slices the one-process stack). The D/P ranks holding the same experts (d mod P equal) are
the experts' own data-parallel group (torchtitan's "dp_shard_mod_ep", OLMo-core's expert data-parallel mesh):
under ZeRO stages 2/3 and HSDP, FSDP2 shards the experts over that group (parallel/zero.py); without FSDP, our mesh
all-reduces their gradients over it (ParallelModel.sync_gradients). Tensor-parallel ranks hold the same experts,
each split along its width over them (parallel/expert_tensor.py, applied first: this rank's E/P experts
are rows of its tensor-parallel slices): every tensor-parallel rank routes the same tokens, so at a fixed tensor-
parallel position the exchange below is the same on every one, and the experts' f and g run over the tensor-parallel
group inside it. Pipeline stages hold different layers: all of it is one 4-D mesh (`expert_mesh`), (pipeline,
tensor_parallel, expert_data_parallel, expert_parallel).

Gradients. The one-process gradient of an expert is the mean-loss gradient over all B tokens of the global batch.
Each rank's loss is the mean over its own B/D tokens, and the backward of the combine/dispatch all-to-alls brings
every token's contribution home to the expert's owner, so the owner holds the sum over its expert group's D_q = P
ranks of d(rank's loss)/dw; summing over the expert data-parallel group adds the other groups' tokens, and the one-
process gradient is that sum divided by D (not by the group's size, D/P): FSDP2's gradient divide factor, or the
divisor of our all-reduce. Under context parallelism over C ranks each rank's loss is C x its share of its micro-
batch's (parallel/context.py) and its tokens are routed like a data-parallel rank's: D·C in place of D throughout.

Dispatch. Each MoE layer routes its own tokens as before, sorts the token copies by expert, and sends each rank the
copies of its experts (`torch.distributed.all_to_all_single` with the per-rank counts as split sizes: gloo supports
uneven splits on CPU, so no padding to a capacity is needed and the layer stays dropless); the owner regroups what
it received by local expert, runs the grouped matmul on its own experts, and the outputs travel back the same way
(the backward runs the two exchanges in reverse: `_AllToAll`). Weighting by the router score and the sum over a
token's k experts stay on the token's own rank. The exchange uses the expert-parallel group of the mesh: its own
process group, so its collectives never interleave with the dense gradients' all-reduces.
"""

import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

EXPERT_PARAM = re.compile(r"\.mlp\.experts\.(w_gate|w_up|w_down)\.weight$")
EXPERT_MESH_DIMS = ("pipeline", "tensor_parallel", "expert_data_parallel", "expert_parallel")


def is_expert_param(name: str) -> bool:
    """Whether single-process parameter (or optimizer state) `name` is a routed expert stack (E, out, in)."""
    return bool(EXPERT_PARAM.search(name.split("\0")[0]))


@dataclass
class ExpertGroups:
    """One rank's place in the expert layout: `degree` (P) ranks per expert group, this rank's index `rank` in it,
    the data-parallel degree D (D·C under context parallelism: the ranks whose gradients are averaged), and the
    groups (`group`: expert-parallel; `data_mesh`: the 1-D mesh of the ranks holding the same experts, size D/P)."""
    degree: int
    rank: int
    data_parallel: int
    group: object
    data_mesh: DeviceMesh

    @property
    def data_group(self):
        return self.data_mesh.get_group()

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a whole (E, ...) stack (a view: no copy)."""
        L = full.shape[0] // self.degree
        return full[self.rank * L:(self.rank + 1) * L]


def expert_mesh(plan, device_type: str = "cpu") -> DeviceMesh:
    """The (pipeline, tensor_parallel, expert_data_parallel, expert_parallel) mesh over the plan's world.

    Global rank = ((p·R + r)·S + s)·T + t (planning/plan.py MESH_DIMS, tensor ranks innermost); its data-parallel
    index d = r·S + s = q·P + e, q its expert data-parallel index, e its expert-parallel rank. Collective: every rank
    builds it (one process group per dimension slice). Under context parallelism the c ranks of a data-parallel
    rank route different tokens (their parts of its sequences), as data-parallel ranks do: d runs over the data-
    parallel x context-parallel ranks, d = (r·S + s)·C + c (`token_ranks`)."""
    P, T = plan.expert_parallel, plan.tensor_parallel
    ranks = torch.arange(plan.world_size).view(plan.pipeline_parallel, token_ranks(plan) // P, P, T)
    return DeviceMesh(device_type, ranks.permute(0, 3, 1, 2).contiguous(), mesh_dim_names=EXPERT_MESH_DIMS)


def token_ranks(plan) -> int:
    """The ranks of one (pipeline stage, tensor-parallel rank) that route different tokens: data-parallel x
    context-parallel (D·C)."""
    return plan.data_parallel * plan.context_parallel


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
    """An MoE layer's `expert_dispatch` under expert parallelism: its experts split over `group`'s P ranks."""

    def __init__(self, layer, group, degree: int):
        self.layer, self.group, self.degree = layer, group, degree
        # (copies per expert (P, L) this rank sends, copies per expert (P, L) it receives, rows M of xs) -> (rows sent
        # to each rank, rows received from each), the all-to-all's split sizes read on the host; replaced from outside
        # only by `lit-pretrain simulate` (simulate/routing.py), whose tensors hold no values to read.
        self.split_sizes: Callable[[torch.Tensor, torch.Tensor, int], Tuple[List[int], List[int]]] = host_split_sizes

    def __call__(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return dispatch_compute_combine(self.layer.experts, xs, counts, self.group, self.degree, self.split_sizes)


def host_split_sizes(send_counts: torch.Tensor, recv_counts: torch.Tensor, rows: int) -> Tuple[List[int], List[int]]:
    """Rows to and from each rank: the (P, L) counts summed over the L experts of each, read on the host (one sync
    per layer, as any all-to-all MoE)."""
    return send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()


def dispatch_compute_combine(experts: nn.Module, xs: torch.Tensor, counts: torch.Tensor, group, P: int,
                             split_sizes=host_split_sizes):
    """The experts' outputs for the token copies xs (M, d), sorted by expert with counts (E,) per expert, computed
    by the rank of `group` (P ranks) that owns each with its `experts` module (this rank's E/P experts); returned in
    xs's order, unweighted. `split_sizes`: the exchange's rows per rank from the counts (`host_split_sizes`)."""
    E = counts.shape[0]
    L = E // P  # experts per rank
    # How many copies each rank sends to each of my L experts: (P, L), source-rank major.
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(P, L)
    send, recv = split_sizes(counts.view(P, L), recv_counts, xs.shape[0])
    xr = _AllToAll.apply(xs, recv, send, group)  # (R, d): by source rank, then by my local expert
    local = torch.arange(L, device=xs.device).repeat(P).repeat_interleave(recv_counts.flatten(),
                                                                          output_size=sum(recv))  # (R,)
    order = local.argsort(stable=True)  # regroup by local expert (source ranks in order within each)
    offsets = recv_counts.sum(0).cumsum(0).to(torch.int32)  # (L,)
    yl = experts(xr[order], offsets)  # (R, d) by local expert
    yr = torch.empty_like(yl).index_copy(0, order, yl)  # back to the order received
    return _AllToAll.apply(yr, send, recv, group)  # (M, d) in xs's order


def apply_expert_parallel(model: nn.Module, plan, device_type: str = "cpu") -> Optional[ExpertGroups]:
    """Keep only this rank's experts of every MoE layer of `model` (after the pipeline split: its stage's layers)
    and give the layers the expert-parallel dispatch. Collective: every rank calls it (apply_plan does)."""
    from lit_pretrain.model.moe import moe_layers

    P = plan.expert_parallel
    mesh = expert_mesh(plan, device_type)
    groups = ExpertGroups(degree=P, rank=mesh.get_local_rank("expert_parallel"), data_parallel=token_ranks(plan),
                          group=mesh.get_group("expert_parallel"), data_mesh=mesh["expert_data_parallel"])
    for layer in moe_layers(model):
        if layer.cfg.num_experts % P:
            raise ValueError(f"model.moe.num_experts={layer.cfg.num_experts} is not divisible by "
                             f"strategy.expert_parallel={P}")
        for linear in layer.experts.values():
            linear.weight = nn.Parameter(groups.slice(linear.weight.detach()).clone())
        layer.expert_dispatch = ExpertDispatch(layer, groups.group, P)
    return groups
