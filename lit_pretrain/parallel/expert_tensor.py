"""Expert tensor parallelism: under strategy.tensor_parallel = t each routed expert of model.moe is split along its
width over the tensor-parallel group (Megatron-LM's expert tensor parallelism, `expert_tensor_parallel_size` equal
to the tensor-parallel size, its default), applied from outside the MoE layer (lit_pretrain/model/moe.py) by apply_plan,
after the linears' split (parallel/tensor.py) and before expert parallelism keeps this rank's experts.

Rank r holds slice r of every expert's hidden size: rows of the gate/up stacks (E, f/t, d), columns of the down
stack (E, d, f/t) (the architecture table's expert_column / expert_row styles, tensor.SHARD_DIM). The router is
replicated and routes the same tokens on every rank (parallel/moe_mesh.py), so the token copies sorted by expert,
xs (M, d), are the same on every rank too, and the experts are one column/row pair over them: Megatron's f on xs
(identity; backward: the partial input gradients summed over the group), the grouped kernel on this rank's slices
(a SwiGLU is elementwise in the hidden units, so this rank's slice of h is the slice of the whole h), then g on the
(M, d) outputs (the partial products summed) before the routing weights and the combine. So the combine, the router
and their gradients are as without the split, complete and equal on every rank (the router: style None, counted
once in the gradient norm), and each rank's expert gradient is exactly its slice of the whole one: its squares are
summed over the group once, as any column/row shard's (ParallelModel.grad_norm). Under expert parallelism the
dispatch calls the same `experts` module on the copies this rank received: the same at a fixed tensor-parallel
position, so f and g run inside it over the tensor-parallel group (EP x TP: E/P experts x 1/t of their width a
rank); FSDP2 then shards those slices along dim 0 (the experts).

The price: one all-reduce of the (M, d) outputs forward and of their input gradient backward per MoE layer (M = k·N
copies: k times a dense MLP's), where replicated experts cost t copies of their compute, parameters, gradients,
optimizer state and hidden activations. No key keeps the replicated layout: no Megatron-LM configuration computes
the same expert on the same tokens on t ranks (its expert_tensor_parallel_size=1 spreads the experts over the
tensor-parallel ranks by expert parallelism instead, which our expert groups, made of data-parallel ranks, do not
span).

Its own module, not tensor.py nor moe_mesh.py: it uses tensor.py's SHARD_DIM and shard, and tensor.py imports
moe_mesh.py.
"""

import torch.distributed as dist
from torch import nn

from lit_pretrain.model.moe import ExpertLinear, moe_layers
from lit_pretrain.parallel.collectives import CopyToParallel, ReduceFromParallel
from lit_pretrain.parallel.tensor import SHARD_DIM, shard


def apply_expert_tensor_parallel(model: nn.Module, group) -> int:
    """Under tensor parallelism over `group`: keep this rank's slice of every routed expert's hidden size in each MoE
    layer of `model` (the table's expert_column / expert_row styles) and run the experts between Megatron's f and
    g (see the module docstring); return how many layers were split. Idempotent. apply_plan calls it right after
    tensor.apply_tensor_parallel (which leaves the stacks whole), before expert parallelism keeps this rank's
    experts and FSDP2 shards them. Hooks on the layer's `experts` module, so the
    expert-parallel dispatch, which calls it on the copies this rank received, runs the same f and g."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layers = moe_layers(model)
    for layer in layers:
        if world == 1 or getattr(layer.experts, "_tensor_parallel", False):
            continue
        for linear in layer.experts.values():
            assert isinstance(linear, ExpertLinear) and linear.tensor_parallel in SHARD_DIM, linear.tensor_parallel
            width = linear.weight.shape[SHARD_DIM[linear.tensor_parallel]]
            if width % world:
                raise ValueError(f"model.moe.d_ff_expert={width} is not divisible by strategy.tensor_parallel="
                                 f"{world}: each rank holds an equal slice of every routed expert")
            linear.weight = nn.Parameter(shard(linear.weight.detach(), linear.tensor_parallel, rank, world))
        # The same copies on every rank (f: their gradient summed); the slices' partial outputs summed (g).
        layer.experts.register_forward_pre_hook(lambda _m, args: (CopyToParallel.apply(args[0], group), *args[1:]))
        layer.experts.register_forward_hook(lambda _m, _args, out: ReduceFromParallel.apply(out, group))
        layer.experts._tensor_parallel = True
    return len(layers)
