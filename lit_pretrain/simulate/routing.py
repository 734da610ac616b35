"""Balanced routing, the one assumption `lit-pretrain simulate` makes about values (docs/large-runs.md): fake
tensors hold no router scores, so how many token copies each expert receives, and so the split sizes of expert
parallelism's all-to-alls, cannot be counted. Under simulation each MoE layer's counts are the balanced ones,
every expert N·k/E of a micro-batch's N tokens with k experts each (the remainder one each to the first experts),
and each rank of an expert group sends every other the copies of that rank's experts and receives as many of its
own from each: what a perfectly balanced router gives, and what the planner assumes (planning/communication.py
expert_all_to_all, planning/memory.py's expert activations). The worst case, every copy on one rank's experts,
holds P times the experts' activations there (docs/large-runs.md).
"""

from typing import List, Tuple

import torch
import torch.distributed as dist


def balanced_counts(expert_of: torch.Tensor, num_experts: int) -> torch.Tensor:
    """MoE.count_assignments under simulation: (E,) copies per expert of the (N·k,) chosen, balanced."""
    copies = expert_of.shape[0]
    return balanced(copies, num_experts, expert_of.device)


def balanced(copies: int, num_experts: int, device) -> torch.Tensor:
    base, extra = divmod(copies, num_experts)
    return torch.full((num_experts,), base, dtype=torch.int64, device=device) + \
        (torch.arange(num_experts, device=device) < extra)


def per_expert(copies: int, num_experts: int) -> List[int]:
    base, extra = divmod(copies, num_experts)
    return [base + (e < extra) for e in range(num_experts)]


def balanced_split_sizes(group):
    """ExpertDispatch.split_sizes under simulation for the expert group `group`: rows to each rank, the balanced
    copies of its experts; rows from each, the balanced copies of this rank's (every rank routes alike)."""
    me = dist.get_rank(group)

    def split_sizes(send_counts: torch.Tensor, recv_counts: torch.Tensor, rows: int) -> Tuple[List[int], List[int]]:
        P, L = send_counts.shape
        counts = per_expert(rows, P * L)
        send = [sum(counts[j * L:(j + 1) * L]) for j in range(P)]
        return send, [send[me]] * P

    return split_sizes


def balance_routing(gpt) -> int:
    """Route every MoE layer of `gpt` balanced (its counts and, under expert parallelism, its split sizes); returns
    the layers changed."""
    from lit_pretrain.model.moe import moe_layers

    layers = moe_layers(gpt)
    for layer in layers:
        layer.count_assignments = balanced_counts
        if layer.expert_dispatch is not None:
            layer.expert_dispatch.split_sizes = balanced_split_sizes(layer.expert_dispatch.group)
    return len(layers)
