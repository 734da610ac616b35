"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, §3): our own column/row-parallel linears with the paper's
f and g operators, the tensor-parallel process group passed in explicitly.

Per block: wq, wk, wv, w_gate, w_up are column-parallel (each rank keeps a slice of the output rows: whole heads,
since wq's rows are heads × head_dim in order, and wk's and wv's are the n_kv_heads key/value heads, so rank r holds
query heads r·H/t.. and exactly the key/value heads they read under grouped-query attention), wo and w_down
row-parallel (a slice of the input columns, then one all-reduce of the partial sums). So a block costs two
all-reduces forward (g after wo and w_down) and, as built, five backward: each column-parallel linear applies f to
its own input, where Megatron applies one f per attention and MLP input (two); the sums are the same, the extra
three cost bandwidth (measured by `make bench CASES=compositions`, counted in planning/communication.py; sequence
parallelism already gathers once per input).
Which linear is which is not listed here: each nn.Linear of the GPT carries `tensor_parallel` ("column" | "row" |
None), set from the architecture table (`GPTConfig.block_modules`), and `plan_of(model)` reads it.
The attention gate (model.attention_gate, attn.wg) is column-parallel like wq, its rows whole heads; the attention
sinks (model.attention_sinks, one logit per head) are split by head the same way, each rank keeping its heads'.
QK-norm's weights (one per head_dim, shared by the heads) are replicated but see only this rank's heads: they are
marked "partial" and their gradients summed over the group (`sync_partial_grads`).
Norms stay replicated: their gradients come out identical on every tensor-parallel rank because f sums the input
gradients. The embedding and the output head are split along the vocabulary (parallel/vocab.py, Megatron-LM's
VocabParallelEmbedding, column-parallel output layer and vocab_parallel_cross_entropy): rank r holds rows
[r·V/t, (r+1)·V/t) of both (one shared Parameter when tied), the head returns this rank's (B, T, V/t) logits and
losses.lm_losses, given the group, computes the cross-entropy over them, so model.vocab_size must divide by t.
Their style is "vocab" (dim 0 of the (V, d) weights), read by `shard`/`gather` like "column" and "row", so
checkpoints place each rank's rows at their vocabulary offset.

Why not DTensor's `parallelize_module` with the same plan (Colwise/Rowwise): measured on CPU, gloo, TP=2, a GPT of
4 layers, d 256, T 128, vocab 4096, batch 8, forward + backward + clipping + AdamW. With DTensor, foreach AdamW,
clipping and `torch.nn.utils.get_total_norm` fail on parameter lists that mix Tensors and DTensors (norms and
embeddings stay plain: "aten._foreach_norm.Scalar got mixed torch.Tensor and DTensor"), so it needs foreach=False;
then a step took 1,208 and 1,328 ms against 947 and 1,184 ms with these layers (two runs on a loaded 2-core
machine, load average ~5; an earlier attempt measured 540 vs 335 ms on a smaller model). Ours keep plain tensors,
so the optimizer, clipping and the checkpoint code see ordinary parameters with known shard dims.

With `sequence_parallel=True` the replicated region between the blocks is sharded along the sequence instead
(parallel/sequence.py): the column-parallel linears drop f (the all-gather before them, installed on their parent
module, sums the input gradients on its way back) and the row-parallel ones reduce-scatter instead of all-reducing.

The plan is data: a module name (on names without activation checkpointing's wrapper prefix) → "column" or "row"
(or "partial"), read off the model's modules.
"""

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lit_pretrain.model.moe import moe_layers
from lit_pretrain.parallel.collectives import CopyToParallel, ReduceFromParallel, all_reduce_flat
from lit_pretrain.parallel.moe_mesh import replicate_over_sequence
from lit_pretrain.parallel.sequence import ReduceScatterFromRow, check_seq_len, install_sequence_parallel
from lit_pretrain.parallel.vocab import apply_vocab_parallel
from lit_pretrain.planning.sharding import SHARD_DIM, WRAPPER_PREFIX, plain_name, style_of  # noqa: F401


class ColumnParallelLinear(nn.Linear):
    """y_local = f(x) W_localᵀ: this rank's slice of the output features. A subclass of nn.Linear so weight decay
    and every name-based rule treat it as the Linear it replaces. Under sequence parallelism x arrives already
    gathered (backward: reduce-scattered) and f is skipped."""

    tensor_parallel = "column"

    def __init__(self, weight: torch.Tensor, group, sequence_parallel: bool = False, residual_projection: bool = False):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight)
        self.register_parameter("bias", None)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.residual_projection = residual_projection

    def forward(self, x):
        if not self.sequence_parallel:
            x = CopyToParallel.apply(x, self.group)
        return F.linear(x, self.weight)


class RowParallelLinear(ColumnParallelLinear):
    """y = g(x_local W_localᵀ): partial products over this rank's input features, summed across the group (under
    sequence parallelism: summed and scattered along the sequence, each rank keeping its chunk)."""

    tensor_parallel = "row"

    def forward(self, x):
        reduce = ReduceScatterFromRow if self.sequence_parallel else ReduceFromParallel
        return reduce.apply(F.linear(x, self.weight), self.group)


class _EnterHeads:
    """f (forward: identity; backward: sum over the group) on a tensor computed whole on every rank and then read by
    this rank's heads alone: latent attention's shared rotated key, whose replicated down-projection must see the
    gradient of every rank's heads, as the column-parallel linears' f gives their inputs."""

    def __init__(self, group):
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return CopyToParallel.apply(x, self.group)


def plan_of(model: nn.Module) -> Dict[str, str]:
    """Module name (wrapper prefix removed) -> its `tensor_parallel` role, for every module that has one."""
    return {plain_name(name): module.tensor_parallel for name, module in model.named_modules()
            if getattr(module, "tensor_parallel", None)}


def shard(full: torch.Tensor, style: Optional[str], rank: int, world: int) -> torch.Tensor:
    """This rank's slice of a full tensor (a weight or its AdamW moment) under `style`; the whole for None."""
    if style is None or world == 1:
        return full
    return full.chunk(world, dim=SHARD_DIM[style])[rank].clone()


def gather(local: torch.Tensor, style: Optional[str], group, world: int) -> torch.Tensor:
    """The full tensor from every rank's slice, on every rank of the tensor-parallel group.

    Each rank writes its slice into zeros and the group sums them (an all-reduce, not an all-gather: all-gather on
    these mesh subgroups hung under gloo here, an all-reduce moves t times the bytes, which checkpoints can afford).
    """
    if style is None or world == 1:
        return local
    dim, rank = SHARD_DIM[style], dist.get_rank(group)
    shape = list(local.shape)
    shape[dim] *= world
    full = torch.zeros(shape, dtype=local.dtype)
    full.narrow(dim, rank * local.shape[dim], local.shape[dim]).copy_(local)
    dist.all_reduce(full, group=group)
    return full


def apply_tensor_parallel(model: nn.Module, group, sequence_parallel: bool = False) -> int:
    """Replace the nn.Linears of `model` marked column or row in place by their parallel versions holding this
    rank's slice of the current (full) weights, and the embedding and head by their vocabulary-parallel versions
    (parallel/vocab.py); return how many modules were replaced. Idempotent.

    sequence_parallel: also shard the region between them along the sequence (parallel/sequence.py); the caller
    must then call `sequence.sync_sequence_parallel_grads(model, group)` once per optimizer step. Raises ValueError
    when model.seq_len does not divide by the group's size, when a split does not give whole heads, or when
    model.vocab_size does not divide by it."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    cfg = model.cfg
    if cfg.n_heads % world or cfg.kv_heads % world:
        raise ValueError(f"model.n_heads={cfg.n_heads} and model.n_kv_heads={cfg.kv_heads} must both be divisible "
                         f"by strategy.tensor_parallel={world}: each rank holds whole query and key/value heads")
    if sequence_parallel and getattr(cfg, "attention", "mha") == "mla":
        raise ValueError("strategy.sequence_parallel with model.attention=mla: the latent attention's replicated "
                         "down-projections would get partial gradients; set strategy.sequence_parallel=false")
    if sequence_parallel:  # before anything is replaced
        check_seq_len(cfg.seq_len, world)
    replaced = 0
    column_parents = []
    # model.moe: the shared experts' linears sit inside the MoE layer, which sequence parallelism replicates along
    # the sequence (parallel/moe_mesh.py): they are plain tensor-parallel layers (f and g) whatever the setting.
    in_moe_layer = {id(m) for layer in moe_layers(model) for m in layer.modules()}
    for name, module in list(model.named_modules()):
        style = getattr(module, "tensor_parallel", None)
        if getattr(module, "sink", False) and module.weight.shape[0] == cfg.n_heads:  # whole: not yet split
            # model.attention_sinks: this rank's heads' logits (dim 0, as wq's rows); each head's softmax is on
            # one rank, so their gradients are whole there
            module.weight = nn.Parameter(shard(module.weight.detach(), style, rank, world))
            replaced += 1
            continue
        if style not in ("column", "row") or not isinstance(module, nn.Linear):
            continue  # the head ("vocab") is replaced below, with the embedding
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        in_moe = id(module) in in_moe_layer
        sp = sequence_parallel and not in_moe
        if style == "column" and not in_moe and all(parent is not p for p in column_parents):
            column_parents.append(parent)
        if isinstance(module, ColumnParallelLinear):
            if module.sequence_parallel != sp:
                raise ValueError(f"{name} is already tensor-parallel with sequence_parallel="
                                 f"{module.sequence_parallel}: apply to a fresh model to change it")
            continue
        cls = ColumnParallelLinear if style == "column" else RowParallelLinear
        setattr(parent, child, cls(shard(module.weight.detach(), style, rank, world), group, sp,
                                   getattr(module, "residual_projection", False)))
        replaced += 1
    replaced += apply_vocab_parallel(model, group, sequence_parallel)
    for module in model.modules():  # latent attention (model/mla.py): the key every head shares enters the heads
        if hasattr(module, "enter_heads"):
            module.enter_heads = _EnterHeads(group)
    if sequence_parallel:
        install_sequence_parallel(model, group, column_parents)
        replicate_over_sequence(model, group)
    return replaced


def partial_params(model: nn.Module) -> List[nn.Parameter]:
    """Replicated parameters whose gradient on one rank covers only its heads (QK-norm's weights), in module order."""
    return [p for m in model.modules() if getattr(m, "tensor_parallel", None) == "partial"
            for p in m.parameters(recurse=False)]


def sync_partial_grads(model: nn.Module, group) -> None:
    """Sum the "partial" parameters' gradients over the tensor-parallel group (one flat all-reduce), so they are
    the whole gradient, equal on every rank like any replicated parameter's. Call once per optimizer step, after
    backward (FSDP's reduce-scatter included: every rank of the group holds the same shard of them)."""
    grads = [p.grad for p in partial_params(model) if p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    all_reduce_flat([g.to_local() if hasattr(g, "to_local") else g for g in grads], group)
