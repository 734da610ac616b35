"""The language-model loss as a pure function of logits and targets (no Lightning), shared by PretrainModule, the
pipeline's last stage (parallel/pipeline.py) and the compiled step (parallel/compile.py), so they cannot drift and
none imports another. Under tensor parallelism the logits are split along the vocabulary and the same function,
given the split cross-entropy of that group (parallel/vocab.py `split_cross_entropy`), computes the same losses over
them: the model knows nothing of distribution, parallel/ hands it the collective."""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index, written out where targets are masked


def lm_losses(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0, split_cross_entropy=None):
    """(task loss, z-loss) of logits (B, T, V) against targets (B, T) (IGNORE_INDEX: not predicted).

    Task: the mean cross-entropy over the predicted targets, in fp32 (under bf16 the log-softmax over a large
    vocabulary loses most of its precision). z-loss (PaLM, Chowdhery et al. 2022 §5): z_loss x log(Z)^2, Z the
    softmax normalizer of the final logits (after any soft-cap: these are the logits the model predicts with), its
    mean over the same predicted targets; None when z_loss is 0 (nothing extra computed).

    split_cross_entropy: when the logits are this rank's (B, T, V/t) columns of the vocabulary, the function
    (logits, targets) -> (nll, log_z) per target over the tensor-parallel group (parallel/vocab.py
    `split_cross_entropy(group)`); the losses are then those of the whole logits, equal on every rank of the group,
    and backward gives each rank its own columns' gradient. A collective: every rank of it calls this."""
    logits, targets = logits.float().flatten(0, 1), targets.flatten()  # (B*T, V or V/t), (B*T,)
    kept = (targets != IGNORE_INDEX).float()  # (B*T,)
    if split_cross_entropy is None:
        task = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
        if not z_loss:
            return task, None
        log_z = torch.logsumexp(logits, dim=-1)  # (B*T,)
    else:
        nll, log_z = split_cross_entropy(logits, targets)  # (B*T,) each
        task = (nll * kept).sum() / kept.sum()  # F.cross_entropy's mean (NaN when nothing is predicted, as there)
        if not z_loss:
            return task, None
    return task, z_loss * (log_z.square() * kept).sum() / kept.sum().clamp(min=1.0)


def loss_targets(x: torch.Tensor, y: torch.Tensor, eod_id: int) -> torch.Tensor:
    """The targets y (B, T) with the one that follows an EOD input set to IGNORE_INDEX: under document masking the
    EOD's query sees only the document it ends, so its target, the next document's first token, is a prediction
    across the boundary from unrelated text. Megatron-LM masks it the same way (`eod_mask_loss`: loss_mask is 0
    where the input is the EOD, with reset_attention_mask/reset_position_ids); torchtitan's block-causal flex
    attention keeps it in the loss. Dropping it costs one target per document (under 1% of them with documents of
    hundreds of tokens) and keeps the loss a sum over predictions made inside one document. The EOD itself stays
    a target: predicting where a document ends is within that document."""
    return y.masked_fill(x == eod_id, IGNORE_INDEX)


def target_sums(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0, split_cross_entropy=None):
    """(Σ nll, Σ log(Z)² or None when z_loss is 0) over the predicted targets of logits (B, T, V or V/t) against
    targets (B, T): lm_losses' terms before the division by the predicted count, so the sums of chunks of positions
    (`chunked_lm_sums`) or of ranks (parallel/context.py) add up to those of the whole. Returned stacked, (1,) or
    (2,), so one autograd node carries them."""
    logits, targets = logits.float().flatten(0, 1), targets.flatten()  # (N, V or V/t), (N,)
    kept = (targets != IGNORE_INDEX).float()  # (N,)
    if split_cross_entropy is None:
        nll = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
        log_z = torch.logsumexp(logits, dim=-1) if z_loss else None  # (N,)
    else:
        nll, log_z = split_cross_entropy(logits, targets)  # (N,) each
        nll = (nll * kept).sum()
    if not z_loss:
        return nll.unsqueeze(0)
    return torch.stack([nll, (log_z.square() * kept).sum()])


def _chunk_sums(head, hidden, targets, z_loss, split_cross_entropy):
    return target_sums(head(hidden), targets, z_loss, split_cross_entropy)


def chunked_lm_sums(head, hidden: torch.Tensor, targets: torch.Tensor, chunk: int, z_loss: float = 0.0,
                    split_cross_entropy=None, seq_slices: int = 1) -> torch.Tensor:
    """`target_sums` of head(hidden) computed chunk positions at a time, so the (B, T, V) logits never exist whole:
    each chunk's logits (and softmax) are freed after its sums, and the backward recomputes them one chunk at a
    time (activation checkpointing per chunk: only the chunk's input, a view of `hidden`, is kept). The chunked
    loss of torchtitan and OLMo-core; Liger's fused linear cross-entropy computes the gradient in the forward
    instead, which would bypass the head's own modules (soft-cap, μP's multiplier, the vocabulary-parallel head).

    head: (B, C, d) -> (B, C', V or V/t) logits; hidden (B, T_local, d); targets (B, T) in the order the head's
    output positions come in. seq_slices: under sequence parallelism (parallel/sequence.py) hidden holds this rank's
    T/s positions and the head all-gathers each chunk from the s ranks in rank order, so the chunk's targets are
    the same positions of each of the s slices of the window. Sums of chunks are added in chunk order: equal to
    the unchunked sums up to fp32 rounding of the order of summation."""
    rows = targets.unflatten(1, (seq_slices, -1))  # (B, s, T/s)
    total = None
    for start in range(0, hidden.shape[1], chunk):
        part = rows[:, :, start:start + chunk].flatten(1)  # (B, s·C)
        # non-reentrant: keeps the chunk's input only; no dropout in the head, so no RNG state to restore
        sums = checkpoint(_chunk_sums, head, hidden[:, start:start + chunk], part, z_loss, split_cross_entropy,
                          use_reentrant=False, preserve_rng_state=False)
        total = sums if total is None else total + sums
    return total


def chunked_lm_losses(head, hidden: torch.Tensor, targets: torch.Tensor, chunk: int, z_loss: float = 0.0,
                      split_cross_entropy=None, seq_slices: int = 1):
    """lm_losses of head(hidden) against targets, the logits computed `chunk` positions at a time
    (`chunked_lm_sums`): the same means, the task loss NaN when nothing is predicted as F.cross_entropy's."""
    return means_of_sums(chunked_lm_sums(head, hidden, targets, chunk, z_loss, split_cross_entropy, seq_slices),
                         targets, z_loss)


def means_of_sums(sums: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0):
    """(task loss, z-loss or None) from `target_sums`-shaped sums over targets: lm_losses' means (the task loss
    NaN when nothing is predicted, as F.cross_entropy's mean; the z-loss then 0)."""
    count = (targets != IGNORE_INDEX).sum().to(sums.dtype)
    return sums[0] / count, (z_loss * sums[1] / count.clamp(min=1.0) if z_loss else None)
