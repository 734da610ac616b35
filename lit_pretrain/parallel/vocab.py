"""Vocabulary parallelism under tensor parallelism: the token embedding, the output head and the cross-entropy
split along the vocabulary over the tensor-parallel group (Megatron-LM: `VocabParallelEmbedding`,
`ColumnParallelLinear` for the output layer, `vocab_parallel_cross_entropy`; Shoeybi et al. 2019 §3 "input
embedding ... parallelized along the vocabulary dimension"; torchtitan's RowwiseParallel embedding and
ColwiseParallel output with loss_parallel). Rank r of t holds rows [r·V/t, (r+1)·V/t) of the (V, d) table,
V = model.vocab_size, which must divide by t (planning/plan.py refuses it otherwise when the config loads).

- Embedding: ids outside this rank's rows look up row 0 and are zeroed, so the t partial outputs sum to the whole
  lookup: Megatron's g (all-reduce forward, identity backward), or under sequence parallelism a reduce-scatter
  along the sequence (backward: all-gather), which also takes the place of the split into the sharded region.
- Head: column-parallel over the vocabulary, this rank's (V/t, d) slice: f on its input (identity forward,
  all-reduce of the input gradient backward), or under sequence parallelism the all-gather before it
  (backward: reduce-scatter, which sums the partial input gradients). Its output is this rank's (B, T, V/t) logits:
  the whole (B, T, V) never exists on one rank.
- Tied embeddings (model.tie_embeddings): both hold the same (V/t, d) Parameter, since both split the vocabulary
  into the same rows.
- Loss (`vocab_parallel_cross_entropy`, handed to model/losses.py by `split_cross_entropy`): the softmax normalizer from
  a max all-reduce and a sum all-reduce of the local exponentials, the target's logit from the rank holding
  it; backward softmax minus one-hot on the local columns, no communication.

These replace modules from outside, like the column/row linears of tensor.py, because model/gpt.py knows nothing of
distribution. Memory per rank: the table, the head and the fp32 logits are 1/t of one process's, which is what
planning/memory.py counts.
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lit_pretrain.parallel.collectives import CopyToParallel, ReduceFromParallel
from lit_pretrain.parallel.sequence import ReduceScatterFromRow


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [vocab_start, vocab_start + V/t) of the embedding table; forward returns the whole lookup
    (summed over the group), or under sequence parallelism this rank's sequence chunk of it. A subclass of
    nn.Embedding so weight decay, the optimizer's parameter kinds and the initializer treat it as the embedding."""

    tensor_parallel = "vocab"

    def __init__(self, weight: torch.Tensor, vocab_start: int, group, sequence_parallel: bool = False):
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx, self.max_norm, self.norm_type = None, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = nn.Parameter(weight)
        self.vocab_start, self.group, self.sequence_parallel = vocab_start, group, sequence_parallel

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start  # (B, T)
        outside = (local < 0) | (local >= self.num_embeddings)  # (B, T): another rank's rows
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, d)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)  # their partial sums come from the other ranks
        reduce = ReduceScatterFromRow if self.sequence_parallel else ReduceFromParallel
        return reduce.apply(x, self.group)  # (B, T, d), or (B, T/t, d) under sequence parallelism


class VocabParallelHead(nn.Linear):
    """The output head's slice of the vocabulary, (V/t, d): this rank's (B, T, V/t) logits of the whole input, as
    tensor.ColumnParallelLinear computes its output slice. f on the input, or under sequence parallelism the
    all-gather before it, installed on it by sequence.install_sequence_parallel. A subclass of nn.Linear so weight
    decay, the optimizer's parameter kinds and the initializer treat it as the head."""

    tensor_parallel = "vocab"

    def __init__(self, weight: torch.Tensor, group, sequence_parallel: bool = False):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight)
        self.register_parameter("bias", None)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x):
        if not self.sequence_parallel:
            x = CopyToParallel.apply(x, self.group)
        return F.linear(x, self.weight)  # (B, T, V/t)


def vocab_group(gpt: nn.Module):
    """The tensor-parallel group the GPT's head splits the vocabulary over; None when its head is whole (one
    process, data parallelism alone, or a pipeline stage without the head)."""
    head = getattr(gpt, "lm_head", None)
    if isinstance(head, VocabParallelHead):
        return head.group
    return None


def sequence_slices(gpt: nn.Module) -> int:
    """How many slices of the window the head's input is split into along the sequence (sequence parallelism: the
    tensor-parallel degree, its all-gather joining them in rank order); 1 when the head reads the whole window.
    model/losses.py `chunked_lm_sums` matches each chunk's targets to it."""
    head = getattr(gpt, "lm_head", None)
    if isinstance(head, VocabParallelHead) and head.sequence_parallel:
        return dist.get_world_size(head.group)
    return 1


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row negative log-likelihood and log-normalizer of logits split along the vocabulary (Megatron-LM's
    `_VocabParallelCrossEntropy`): forward one max all-reduce and one all-reduce of (sum of exponentials, target
    logit); backward softmax · (g_nll + g_logz) minus g_nll on the target's column, on the local columns only."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        # logits (N, V/t) fp32, this rank's columns [start, start + V/t); targets (N,) global ids or IGNORE_INDEX
        n_local = logits.shape[-1]
        start = dist.get_rank(group) * n_local
        top = logits.max(dim=-1).values  # (N,)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)  # (N, V/t), <= 0
        local = targets - start  # (N,)
        inside = (local >= 0) & (local < n_local)  # (N,): the target is one of this rank's columns
        index = local.clamp(0, n_local - 1)  # (N,)
        exp = shifted.exp()  # (N, V/t)
        sums = torch.stack([exp.sum(-1), shifted.gather(1, index.unsqueeze(-1)).squeeze(-1) * inside])  # (2, N)
        dist.all_reduce(sums, group=group)
        log_sum = sums[0].log()  # (N,)
        softmax = exp.div_(sums[0].unsqueeze(-1))  # (N, V/t), in place: the exponentials are not needed again
        ctx.save_for_backward(softmax, index, inside)
        # nll = log Z - logit_target, log Z = max + log Σ exp(logit - max): as F.cross_entropy's log-softmax
        return log_sum - sums[1], log_sum + top

    @staticmethod
    def backward(ctx, grad_nll, grad_log_z):
        softmax, index, inside = ctx.saved_tensors
        grad = softmax * (grad_nll + grad_log_z).unsqueeze(-1)  # d log Z / d logits = softmax
        grad.scatter_add_(1, index.unsqueeze(-1), -(grad_nll * inside).unsqueeze(-1))  # - one-hot of the target
        return grad, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group):
    """(nll, log Z), each (N,), of this rank's logits (N, V/t) against global targets (N,); rows whose target is
    IGNORE_INDEX get a meaningless nll, which the caller masks (losses.lm_losses). Collectives over `group`: every
    rank of it calls this with the same targets."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group)


def split_cross_entropy(group):
    """lm_losses' split_cross_entropy for logits split over the tensor-parallel `group`: None when there is none
    (the logits are whole), so callers pass `split_cross_entropy(vocab_group)` whatever the layout."""
    if group is None:
        return None
    return functools.partial(vocab_parallel_cross_entropy, group=group)


def whole_logits(logits: torch.Tensor, group) -> torch.Tensor:
    """(..., V) from every rank's (..., V/t) columns, on every rank (all-reduce of zero-padded slices, as
    tensor.gather does: all-gather on mesh subgroups hung under gloo). For checks and evaluation, not training."""
    t, n_local = dist.get_world_size(group), logits.shape[-1]
    out = logits.new_zeros((*logits.shape[:-1], t * n_local))
    out.narrow(-1, dist.get_rank(group) * n_local, n_local).copy_(logits)
    dist.all_reduce(out, group=group)
    return out


def _rows(weight: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows [rank·V/t, (rank+1)·V/t) of a (V, d) weight, as tensor.shard's "vocab" style slices it."""
    return weight.detach().chunk(world, dim=0)[rank].clone()


def apply_vocab_parallel(model: nn.Module, group, sequence_parallel: bool = False) -> int:
    """Replace the GPT's embedding and head (whichever this rank holds: a pipeline stage may hold one) by their
    vocabulary-parallel versions holding this rank's rows of the current (full) weights, keeping a tie. Idempotent.
    Returns how many modules were replaced."""
    from lit_pretrain.model.init import set_output_multiplier

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    V = model.cfg.vocab_size
    if V % world:
        raise ValueError(f"model.vocab_size={V} is not divisible by strategy.tensor_parallel={world}: the "
                         f"embedding and head are split along the vocabulary; choose a vocab size that is a multiple "
                         f"of {world} (Megatron-LM pads it to a multiple of 128 x {world})")
    start = rank * (V // world)
    emb, head = getattr(model, "tok_embeddings", None), getattr(model, "lm_head", None)
    tied = emb is not None and head is not None and head.weight is emb.weight
    replaced = 0
    if emb is not None and not isinstance(emb, VocabParallelEmbedding):
        model.tok_embeddings = VocabParallelEmbedding(_rows(emb.weight, rank, world), start, group,
                                                      sequence_parallel)
        replaced += 1
    if head is not None and not isinstance(head, VocabParallelHead):
        new = VocabParallelHead(_rows(head.weight, rank, world), group, sequence_parallel)
        if tied:
            new.weight = model.tok_embeddings.weight  # one Parameter, as in the full model
        # μP's readout multiplier is a forward hook on the head (lit_pretrain/model/init.py): carried to the new head.
        set_output_multiplier(new, getattr(head, "output_multiplier", 1.0))
        model.lm_head = new
        replaced += 1
    return replaced
