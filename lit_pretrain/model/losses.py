"""The language-model loss as a pure function of logits and targets (no Lightning), shared by PretrainModule, the
pipeline's last stage (parallel/pipeline.py) and the compiled step (parallel/compile.py), so they cannot drift and
none imports another. Under tensor parallelism the logits are split along the vocabulary and the same function,
given the split cross-entropy of that group (parallel/vocab.py `split_cross_entropy`), computes the same losses over
them: the model knows nothing of distribution, parallel/ hands it the collective."""

import torch
import torch.nn.functional as F

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
