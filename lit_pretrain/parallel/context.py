"""Context parallelism: the ranks of a context-parallel group share one micro-batch and split its sequence, as Llama 3
does (Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.2) and torchtitan's all-gather variant.

- The window of T positions is cut into 2c chunks; rank r of the c ranks computes chunks r and 2c-1-r, so under the
  causal mask every rank has the same attention work (chunk i attends to i+1 chunks: r+1 + 2c-r = 2c+1 each).
- Every rank embeds and runs its own T/c positions through the blocks. Only attention needs the others: the keys
  and values of the whole sequence are all-gathered over the group (`GatherKV`, whose backward reduce-scatters
  their gradients, summing what every rank's queries put into each key) and each rank's queries attend to them with
  the causal (and document) mask in global positions, through our SDPA path (PyTorch's own context-parallel SDPA
  has no CPU sharding rule, and FlexAttention no CPU backward, so neither could be tested here).
- RoPE turns each token by its global position (or its position in its document under document masking).
- The loss is the micro-batch's mean over its predicted tokens, counted over the whole group (`context_losses`).

The model knows nothing of this: parallel/apply.py installs a `ContextParallel` as `GPT.context_split` (the
positions this rank computes) and as each Attention's `context` (the gathered attention), from outside.

Gradient algebra: rank r's loss is c x (its tokens' summed loss) / N, N the group's predicted tokens, so the mean
over the group of those losses is the micro-batch's loss; the gradients are then averaged over the group like data-
parallel ones (FSDP2 over data_parallel_shard x context_parallel; our mesh's all-reduce otherwise), and the result
is one process's gradient of the whole micro-batch.
"""

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lit_pretrain.model.losses import IGNORE_INDEX
from lit_pretrain.model.mask import Mask, sdpa_mask
from lit_pretrain.parallel.sequence import _all_gather_single, _reduce_scatter_single


def chunk_positions(T: int, c: int, rank: int, device=None) -> torch.Tensor:
    """The positions rank `rank` of `c` computes in a window of T: chunks rank and 2c-1-rank of 2c, in that order.
    Returns (T/c,) int64."""
    if T % (2 * c):
        raise ValueError(f"context parallelism cuts a window of {T} positions into 2 x strategy.context_parallel = "
                         f"{2 * c} equal chunks: choose model.seq_len (and any shorter window) divisible by {2 * c}")
    n = T // (2 * c)
    first = torch.arange(rank * n, (rank + 1) * n, device=device)
    second = torch.arange((2 * c - 1 - rank) * n, (2 * c - rank) * n, device=device)
    return torch.cat([first, second])  # (T/c,)


def gathered_order(T: int, c: int, device=None) -> torch.Tensor:
    """The global position of each row of an all-gather of every rank's T/c positions (rank-major). (T,)"""
    return torch.cat([chunk_positions(T, c, r, device) for r in range(c)])


class GatherKV(torch.autograd.Function):
    """k (B, KV, T/c, Qk), v (B, KV, T/c, Qv) of this rank -> the whole sequence's (B, KV, T, Qk) and (B, KV, T, Qv),
    in global order, in one all-gather of both side by side (Qk and Qv differ under latent attention, model/mla.py).
    Backward: the gradients of every rank's queries summed into each key and value and this rank's positions kept,
    in one reduce-scatter (the gathered tensors themselves are saved by attention, not here)."""

    @staticmethod
    def forward(ctx, k, v, group, c: int):
        B, KV, Tl, Qk = k.shape
        T, D = Tl * c, Qk + v.shape[-1]
        order = gathered_order(T, c, k.device)
        ctx.group, ctx.c, ctx.order, ctx.Qk = group, c, order, Qk
        local = torch.cat([k, v], dim=-1).unsqueeze(0).contiguous()  # (1, B, KV, T/c, Qk + Qv)
        out = local.new_empty((c, B, KV, Tl, D))
        _all_gather_single(out, local, group=group)  # rank-major: (c, B, KV, T/c, D)
        rows = out.permute(1, 2, 0, 3, 4).reshape(B, KV, T, D)  # positions in `order`
        whole = torch.empty_like(rows).index_copy_(2, order, rows)  # (B, KV, T, D): global order
        return whole[..., :Qk], whole[..., Qk:]

    @staticmethod
    def backward(ctx, gk, gv):
        c, Qk = ctx.c, ctx.Qk
        g = torch.cat([gk, gv], dim=-1).index_select(2, ctx.order)  # (B, KV, T, D) in the gathered (rank-major) order
        B, KV, T, D = g.shape
        per_rank = g.unflatten(2, (c, T // c)).permute(2, 0, 1, 3, 4).reshape(c, B, KV, T // c, D)
        out = g.new_empty((1, B, KV, T // c, D))
        _reduce_scatter_single(out, per_rank.contiguous(), group=ctx.group)
        return out[0, ..., :Qk], out[0, ..., Qk:], None, None


class ContextParallel:
    """This rank's part of the context-parallel group `group`: the positions it computes and its attention."""

    def __init__(self, group, sequence_parallel: int = 1):
        self.group = group
        self.c, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # Under sequence parallelism a block's hidden state holds T/(c·t) positions (parallel/sequence.py): a
        # pipeline stage reads the window's length off its input (window_of).
        self.sequence_parallel = sequence_parallel

    def positions(self, T: int, device=None) -> torch.Tensor:
        """(T/c,) the positions of a window of T this rank computes (chunk_positions)."""
        return chunk_positions(T, self.c, self.rank, device)

    def window_of(self, local_len: int) -> int:
        """The window length whose part this rank holds as `local_len` hidden positions."""
        return local_len * self.c * self.sequence_parallel

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's positions of t (B, T, ...) along dim 1 (targets, token ids)."""
        return t[:, self.positions(t.shape[1], t.device)]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: Optional[torch.Tensor], window: Optional[int] = None,
                 sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of this rank's queries q (B, H, T/c, Q) over the whole sequence's keys and values, given this
        rank's k, v (B, KV, T/c, Q). mask: (B, 1, T/c, T) bool in global positions (document masking, made by
        model/mask.py's `sdpa_mask`), or None for the causal mask: each of the two query chunks attends to the keys
        up to its own end, the causal triangle aligned to the bottom right, as two SDPA calls whose masks
        `sdpa_mask` makes (SDPA's is_causal for a square first chunk; off CUDA one additive mask of the window's
        width shared by every layer and both chunks). sinks: (H,) the heads' sink logits (model.attention_sinks):
        each query's softmax is one SDPA call over every key it sees, so the sink joins it once, as on one process.
        window: the layer's sliding window (model.sliding_window),
        which the mask made with documents already holds; without documents a binding one is a (T/c, T) boolean mask
        of this rank's positions, made once and read by every window layer: the window crosses the chunks' edges as
        it crosses positions, the keys all being here."""
        from lit_pretrain.model.gpt import attend

        k, v = GatherKV.apply(k, v, self.group, self.c)  # (B, KV, T, Q) each
        n, T = q.shape[2] // 2, k.shape[2]  # chunk length T/(2c), window
        if mask is None and window is not None and window < T:
            mask = self._window_mask(T, window, q)  # (T/c, T)
        if mask is not None:
            return attend(q, k, v, mask, sinks=sinks)  # (B, H, T/c, Q)
        out = []
        for i, chunk in enumerate((self.rank, 2 * self.c - 1 - self.rank)):
            qi, end = q[:, :, i * n:(i + 1) * n], (chunk + 1) * n  # the chunk's n queries end at key `end`
            sdpa = sdpa_mask(Mask(queries=end - n), n, end, q, shared_width=T)
            out.append(attend(qi, k[:, :, :end], v[:, :, :end], *sdpa, sinks=sinks))  # (B, H, n, Q)
        return torch.cat(out, dim=2)  # (B, H, T/c, Q)

    def _window_mask(self, T: int, window: int, like: torch.Tensor) -> torch.Tensor:
        """The sliding-window mask of this rank's positions over the window's T keys, (T/c, T) bool, kept for the
        next layers and steps (model/mask.py `sdpa_mask` makes it); one at a time."""
        key = (T, window, like.device)
        cached = getattr(self, "_window_masks", {})
        if key not in cached:
            with torch.inference_mode(False):  # kept across steps: one made under inference mode must train
                mask = Mask(queries=self.positions(T, like.device), window=window)
                cached = self._window_masks = {key: sdpa_mask(mask, T // self.c, T, like).attn_mask}
        return cached[key]


def context_losses(logits: torch.Tensor, targets: torch.Tensor, group, z_loss: float = 0.0,
                   split_cross_entropy=None):
    """lm_losses (model/losses.py) of this rank's logits (B, T/c, V or V/t) and targets (B, T/c), normalized by the
    predicted tokens of the whole context-parallel group: (task loss, z-loss or None).

    Each returned value is the micro-batch's (equal on every rank of the group: one all-reduce of the sums); what
    backward sees is rank r's c x (its summed loss) / N, whose mean over the group is that loss, so averaging the
    gradients over the group (as over data-parallel ranks) gives the micro-batch's gradient. With ignored targets
    (document masking, padding) the ranks predict different counts: a mean of the ranks' own means would weigh them
    wrongly."""
    logits, targets = logits.float().flatten(0, 1), targets.flatten()  # (N, V or V/t), (N,)
    kept = (targets != IGNORE_INDEX).float()
    if split_cross_entropy is None:
        nll = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")  # (N,), 0 where ignored
        log_z = torch.logsumexp(logits, dim=-1) if z_loss else None
    else:
        nll, log_z = split_cross_entropy(logits, targets)
        nll = nll * kept
    sums = [nll.sum()] + ([(log_z.square() * kept).sum()] if z_loss else [])
    return group_means(sums, kept.sum(), group, z_loss)


def group_means(sums, kept: torch.Tensor, group, z_loss: float = 0.0):
    """(task loss, z-loss or None) from this rank's sums (Σ nll and, with z_loss, Σ log(Z)²) over its `kept`
    predicted targets: the group's means, trained on as `context_losses` explains."""
    c = dist.get_world_size(group)
    totals = torch.stack([s.detach() for s in sums] + [kept.to(sums[0].dtype)])
    dist.all_reduce(totals, group=group)
    count = totals[-1]
    out = []
    for i, s in enumerate(sums):
        # z-loss over no predicted target is 0 (lm_losses' clamp); the task loss NaN, as F.cross_entropy's mean
        n = count if i == 0 else count.clamp(min=1.0)
        trained = s * c / n
        out.append(trained + (totals[i] / n - trained).detach())
    task = out[0]
    return task, (z_loss * out[1] if z_loss else None)


def install_context_parallel(gpt, group, sequence_parallel: int = 1) -> ContextParallel:
    """Give `gpt` (whole, or pruned to pipeline stages) this rank's positions and every attention it holds the
    gathered attention over `group`. Returns the ContextParallel."""
    cp = ContextParallel(group, sequence_parallel)
    gpt.context_split = cp
    mtp_blocks = [m.block for m in getattr(gpt, "mtp", None) or ()]  # model.mtp_depth's blocks attend alike
    for block in [*gpt.blocks, *mtp_blocks]:
        attn = getattr(block, "attn", None)  # a block of another pipeline stage is an nn.Identity
        if attn is not None:
            attn.context = cp
    return cp
