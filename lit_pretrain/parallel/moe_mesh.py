"""model.moe on our mesh: what tensor, sequence and pipeline parallelism and the mesh's data-parallel groups change
for a mixture-of-experts layer (model/moe.py), applied from outside it (expert parallelism: parallel/expert.py).

- Tensor parallelism: the router is replicated over the tensor-parallel group and every rank routes the same tokens
  identically (the MoE sees the replicated residual stream), so its gradient comes out complete and equal on every
  rank, like a norm's, and `ParallelModel.grad_norm` counts it once (style None). The shared experts are split like
  the dense MLP (the table marks them column/row), as Megatron-LM's SharedExpertMLP is
  (megatron/core/transformer/moe/shared_experts.py). Each routed expert is split along its width too (Megatron-LM's
  expert tensor parallelism: parallel/expert_tensor.py), its gradient a slice summed into the norm over the group.
- Sequence parallelism: the MoE gathers the whole sequence on entry (backward: each rank keeps its chunk of the
  complete gradient) and keeps its chunk on exit (backward: all-gather), so inside it nothing differs from tensor
  parallelism alone: the same tokens routed on every rank, capacity and auxiliary loss over the whole micro-batch as
  one process computes them (`replicate_over_sequence`). Megatron-LM instead routes each rank's own chunk and
  all-reduces the counts over the group for its auxiliary loss (then gathers the copies over the group for the
  experts' split); that routes 1/t of the tokens on each rank but makes capacity drops depend on the chunking.
- Pipeline parallelism: each MoE layer's auxiliary and z losses enter backward through Megatron-LM's
  MoEAuxLossAutoScaler (megatron/core/transformer/moe/moe_utils.py), since a stage cannot add a loss of its layers
  to the last stage's task loss (`install_pipeline_losses`).
- Routing counts (DeepSeek-V3's bias update, the MoE monitor) are summed over the data-parallel ranks only
  (`data_parallel_sum`): tensor-parallel ranks counted the same tokens, pipeline stages hold other layers. Context-
  parallel ranks counted other tokens (their parts of the sequence): they are summed over too.
"""

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from lit_pretrain.model.moe import MoE, moe_layers


class AuxLossAutoScaler(torch.autograd.Function):
    """Megatron-LM's MoEAuxLossAutoScaler: forward returns `output` unchanged; backward passes its gradient through
    and gives `losses` the gradient `scale` (d objective / d losses), so the losses train wherever the layer's
    output goes, with no term added to the loss the backward starts from."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, losses: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.scale = scale  # a constant: nothing saved for backward (activation checkpointing recomputes nothing)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, ctx.scale, None


def install_pipeline_losses(gpt: nn.Module, accumulation_scale: Callable[[], float]) -> int:
    """Hook this rank's MoE layers so their auxiliary and z losses train under pipeline parallelism; return how
    many were hooked. `accumulation_scale()`: the pipeline's 1 / (gradient-accumulation factor x its micro-batch
    count) at backward time.

    The objective of one optimizer step, as one process with Lightning's accumulation over A micro-batches of m
    pipeline micro-batches each would train it: (1/A)(1/m) Σ_j [CE_j + aux_loss · mean_l aux_l,j +
    router_z_loss · mean_l z_l,j], the means over all MoE layers l of the model (every stage's, as `moe.moe_loss`
    averages them) and each micro-batch j's own Switch loss E Σ_i f_i P_i from its own counts and probabilities
    (per micro-batch, Megatron-LM's default `moe_router_load_balancing_type=aux_loss`). So layer l's (aux, z) get the
    gradient (aux_loss, router_z_loss) / L_moe / A / m, the 1/m applied as the pipeline's loss function applies it to
    the task loss (parallel/pipeline.py: its schedules do not scale gradients). Megatron-LM sets the same scale,
    loss_scale / num_microbatches, with MoEAuxLossAutoScaler.set_loss_scale in its pipeline schedules.
    """
    layers = moe_layers(gpt)
    if not layers:
        return 0
    cfg, total = layers[0].cfg, len(gpt.cfg.moe_layers())  # every stage's MoE layers, not only this rank's
    if not (cfg.aux_loss or cfg.router_z_loss):
        return 0
    coefficients = torch.tensor([cfg.aux_loss, cfg.router_z_loss]) / total

    def hook(module: MoE, _args, output: torch.Tensor) -> torch.Tensor:
        if not (module.training and torch.is_grad_enabled()) or module.last_losses is None:
            return output
        losses = module.last_losses
        scale = (coefficients * accumulation_scale()).to(device=losses.device, dtype=losses.dtype)
        return AuxLossAutoScaler.apply(output, losses, scale)

    for layer in layers:
        if not getattr(layer, "_pipeline_losses_hooked", False):
            layer.register_forward_hook(hook)
            layer._pipeline_losses_hooked = True
    return len(layers)


def replicate_over_sequence(model: nn.Module, group) -> int:
    """Under sequence parallelism: every MoE layer of `model` works on the whole sequence, replicated over `group`
    (the tensor-parallel group), as under tensor parallelism alone; return how many layers were hooked. Idempotent.

    In: all-gather along the sequence; backward keeps this rank's chunk, the gradient inside being complete and
    equal on every rank (`sequence.GatherForReplicated`, the head's gather). Out: this rank's chunk; backward
    all-gathers the chunks' gradients (`sequence.SplitSequence`, the embedding's split)."""
    from lit_pretrain.parallel.sequence import GatherForReplicated, SplitSequence

    layers = moe_layers(model)
    for layer in layers:
        if getattr(layer, "_sequence_replicated", False):
            continue
        layer.register_forward_pre_hook(lambda _m, args: (GatherForReplicated.apply(args[0], group), *args[1:]))
        layer.register_forward_hook(lambda _m, _args, out: SplitSequence.apply(out, group))
        layer._sequence_replicated = True
    return len(layers)


def data_parallel_sum(t: torch.Tensor, groups: Iterable) -> torch.Tensor:
    """`t` summed over the data-parallel groups given (replicas, then shards: together every data-parallel rank of
    this tensor- and pipeline-parallel position), a new tensor; groups of one rank are skipped."""
    out = t.clone()
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(out, group=group)
    return out


def install_global_counts(model: nn.Module, plan) -> int:
    """Give every MoE layer of `model` the sum of its routing counts over the ranks whose tokens its auxiliary loss
    covers, on a process group of its own (made here: a collective, every rank calls it), so the sum inside the
    forward, and again in an activation-checkpointing recomputation inside the backward, never interleaves with the
    gradients' collectives: model.moe.aux_loss_scope=global, the data-parallel x context-parallel ranks of this
    rank's (pipeline stage, tensor-parallel rank); sequence or micro_batch under context parallelism, the
    context-parallel group (its ranks hold parts of the same windows). Returns the layers given it; none where one
    rank holds those tokens.

    With f_i from the summed counts (a constant of backward), each rank's E Σ_i f_i P_i over its own tokens' mean
    probabilities P_i is linear in them, so the mean over the context-parallel group of the ranks' losses is the
    micro-batch's, and the gradients' average over the group (parallel/context.py) is one process's: no sum of the
    P_i is needed. The router z-loss, a mean over tokens, likewise: every rank of the group holds T/c positions."""
    # Decided from the model's config, not the layers held: a pipeline stage may hold none, and every rank must
    # make the same groups.
    moe, d, c = model.cfg.moe, plan.data_parallel, plan.context_parallel
    if moe is None or moe.aux_loss == 0:
        return 0
    scope = d * c if moe.aux_loss_scope == "global" else c
    if scope == 1:
        return 0
    layers = moe_layers(model)
    # Global rank = ((p·D + data-parallel index)·C + context-parallel index)·T + t (planning/plan.py MESH_DIMS).
    ranks = torch.arange(plan.world_size).view(plan.pipeline_parallel, d, c, plan.tensor_parallel)
    # A group per (p, t) over D x C, or per (p, data-parallel index, t) over C.
    ranks = ranks.permute(0, 3, 1, 2) if scope == d * c else ranks.permute(0, 1, 3, 2)
    group, _ = dist.new_subgroups_by_enumeration(ranks.reshape(-1, scope).tolist())
    for layer in layers:
        layer.count_reduce = lambda t, group=group: data_parallel_sum(t, [group])
    return len(layers)
