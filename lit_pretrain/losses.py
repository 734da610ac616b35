"""The language-model loss as a pure function of logits and targets (no Lightning), shared by PretrainModule and
the pipeline's last stage (parallel/pipeline.py), so the two cannot drift and neither imports the other."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index, written out where targets are masked


def lm_losses(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0):
    """(task loss, z-loss) of logits (B, T, V) against targets (B, T) (IGNORE_INDEX: not predicted).

    Task: the mean cross-entropy over the predicted targets, in fp32 (under bf16 the log-softmax over a large
    vocabulary loses most of its precision). z-loss (PaLM, Chowdhery et al. 2022 §5): z_loss x log(Z)^2, Z the
    softmax normalizer of the final logits (after any soft-cap: these are the logits the model predicts with), its
    mean over the same predicted targets; None when z_loss is 0 (nothing extra computed)."""
    logits, targets = logits.float().flatten(0, 1), targets.flatten()  # (B*T, V), (B*T,)
    task = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
    if not z_loss:
        return task, None
    kept = (targets != IGNORE_INDEX).float()  # (B*T,)
    log_z = torch.logsumexp(logits, dim=-1)  # (B*T,)
    return task, z_loss * (log_z.square() * kept).sum() / kept.sum().clamp(min=1.0)
