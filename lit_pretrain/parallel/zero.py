"""ZeRO stages from outside the model: which state each data-parallel rank keeps only a 1/world share of.

| stage | optimizer state | gradients | parameters | built on |
|---|---|---|---|---|
| 1 | sharded | full (DDP all-reduce) | full | ZeroRedundancyOptimizer under DDP |
| 2 | sharded | sharded (reduce-scatter) | gathered from forward to end of backward | FSDP2, no reshard after forward |
| 3 | sharded | sharded | gathered per block for its forward, again for its backward | FSDP2, reshard after forward |

(Rajbhandari et al. 2020, "ZeRO", §5: P_os, P_os+g, P_os+g+p.) FSDP2 has no stage-1 mode, so stage 1 is PyTorch's
ZeroRedundancyOptimizer (built by `optim.build_adamw`): each rank owns whole parameter tensors (greedy by size) and
updates only those, then broadcasts them. FSDP2 shards every parameter along dim 0 (padded to a multiple of world)
and keeps the shards as DTensors, so the optimizer state it creates is sharded too. Stage 2 here keeps the
all-gathered parameters from forward until the end of backward (no second all-gather in backward), the equivalent of
ZeRO-2's replicated parameters during the step; between steps FSDP2 frees them, which only lowers memory.
"""

from typing import List

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard


def mixed_precision_policy():
    """bf16 parameters for the forward and backward, fp32 gradient reduction (torchtitan's and OLMo-core's default
    under FSDP2): the all-gathers move half the bytes, the reduce-scatter sums in fp32 so that adding up D ranks'
    gradients rounds once at the end, not at every hop; the sharded master parameters, their gradients and AdamW's
    state stay fp32. Each FSDP module's floating inputs are cast to bf16 (`cast_forward_inputs`): the residual
    stream is bf16 between blocks, as in both anchors, and the output head's logits are bf16 until the loss casts
    them to fp32 (model/losses.py). The norms compute in fp32 and cast back (model/gpt.py FP32Norm)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_model(model: nn.Module, mesh: DeviceMesh, stage: int, experts=None, mp_policy=None) -> nn.Module:
    """Apply FSDP2 to each block, then to the root (embeddings, final norm, head): one all-gather group per block.

    Stage 3 frees each block's gathered parameters after its forward and gathers them again for its backward;
    stage 2 keeps them until backward. The root group (embeddings, final norm, the tied
    embedding/head) follows the same rule. Applying twice changes nothing.

    `experts` (parallel/expert.py ExpertGroups, under expert parallelism): each MoE layer's experts first, as a
    group of their own over the ranks holding the same experts (the block's group then leaves them out, as FSDP2
    does for parameters an inner group already manages), their reduce-scatter divided by the data-parallel degree
    D rather than that group's size D/P (the gradient algebra in parallel/expert.py); torchtitan's
    parallelize for MoE does the same (`set_gradient_divide_factor`).

    `mp_policy`: FSDP2's MixedPrecisionPolicy for every group (`mixed_precision_policy`), or None (fp32 gathered).
    """
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    if stage not in (2, 3):
        raise ValueError(f"strategy.zero_stage={stage}: FSDP2 shards stages 2 and 3; stage 1 is an optimizer")
    if isinstance(model, FSDPModule):
        return model
    reshard = stage == 3
    for block in model.blocks:
        if experts is not None:
            from lit_pretrain.model.moe import moe_layers

            for layer in moe_layers(block):
                fully_shard(layer.experts, mesh=experts.data_mesh, reshard_after_forward=reshard, **policy)
                layer.experts.set_gradient_divide_factor(float(experts.data_parallel))
                # A divide factor other than the group's size makes FSDP2 reduce with PREMUL_SUM, which gloo
                # lacks: a plain sum, then the division. Not on one rank: FSDP2 then skips the reduction, and the
                # forced sum its division with it (measured: the experts' gradients off by the factor).
                if experts.data_mesh.size() > 1:
                    layer.experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **policy)
    return model


def zero_partition(sizes: List[List[int]], world: int) -> List[List[List[int]]]:
    """Which tensors ZeroRedundancyOptimizer assigns to which rank, as a pure function of their sizes.

    sizes[g] lists the element counts of parameter group g's tensors. Returns, per group and rank, the indices
    (into sizes[g]) of the tensors that rank owns. The rule (torch.distributed.optim.ZeroRedundancyOptimizer.
    _partition_parameters): groups in order; within a group, tensors from largest to smallest (stable sort), each
    to the rank with the fewest elements so far across all groups, the lowest rank on a tie.
    """
    totals = [0] * world
    out = []
    for group in sizes:
        per_rank: List[List[int]] = [[] for _ in range(world)]
        for i in sorted(range(len(group)), key=lambda j: group[j], reverse=True):
            rank = min(range(world), key=lambda r: totals[r])
            per_rank[rank].append(i)
            totals[rank] += group[i]
        out.append(per_rank)
    return out
