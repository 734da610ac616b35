"""How a batch becomes losses on one rank under a plan: the one door the module's training and validation steps go
through (`ParallelModel.losses`), whatever the layout. `choose` picks the variant once, when apply_plan has put the
plan's wrappers in place, so the module never asks which layout it runs under:

- forward, then the loss: the GPT's logits and the fp32 cross-entropy of model/losses.py, over the head's vocabulary
  columns when tensor parallelism splits it (parallel/vocab.py), over the context-parallel group's positions
  (parallel/context.py), or trainer.compile's compiled forward and loss (parallel/compile.py); Lightning's backward
  then runs on `trained`.
- the pipeline schedule (parallel/pipeline.py): it runs the forward and, when training, the backward itself, as
  torchtitan's separate pipeline step does (`runs_backward`: the module must not run it again).
"""

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch

from lit_pretrain.errors import ConfigError
from lit_pretrain.model.gpt import document_ids
from lit_pretrain.model.losses import IGNORE_INDEX, chunked_lm_sums, lm_losses, loss_targets, means_of_sums
from lit_pretrain.model.moe import moe_loss
from lit_pretrain.model.mtp import mtp_tokens


@dataclass
class StepLosses:
    task: torch.Tensor
    """The mean next-token cross-entropy over the batch's predicted targets: what train/loss and val/loss report."""
    z: Optional[torch.Tensor]
    """optim.z_loss's term; None when optim.z_loss is 0."""
    trained: torch.Tensor
    """What the gradient is of: the task loss, model.moe's auxiliary losses (when training) and the z-loss; what
    Lightning's backward runs on and the callbacks' on_before_backward see (under pipeline parallelism its value
    only: the schedule has run its backward, the MoE terms inside it)."""
    metrics: Dict[str, float] = field(default_factory=dict)
    """What the layout measured of this training step, logged by the module under these names (pipeline/*)."""
    mtp: Optional[torch.Tensor] = None
    """model.mtp_depth's loss when training: the mean over depths of their cross-entropies (unweighted; λ times it is
    in `trained`), logged as train/mtp_loss. None without multi-token prediction, and in validation."""


LossFn = Callable  # (x, y, document_ids or None, z_loss) -> (task loss, z-loss or None), from logits on this rank


def choose(par) -> Tuple[Callable[..., StepLosses], bool]:
    """(`losses(batch, z_loss, eod_id, training)`, whether it runs the backward itself) for ParallelModel `par` as
    apply_plan has wrapped it."""
    if par.runner is not None:
        return functools.partial(pipeline_losses, par.runner), True
    if par.forward_losses is not None:  # trainer.compile: the compiled forward and loss (parallel/compile.py)
        loss_fn = par.forward_losses
    else:
        from lit_pretrain.parallel.vocab import sequence_slices, split_cross_entropy

        # the head's vocabulary columns on this rank under tensor parallelism: the loss reduces over that group
        split = split_cross_entropy(par.vocab_group)
        chunk, depth = par.gpt.cfg.loss_chunk_size, par.gpt.cfg.mtp_depth
        if chunk is not None or depth:  # model.loss_chunk_size, model.mtp_depth: the loss inside the forward
            loss_fn = functools.partial(forward_losses, par.gpt, split, par.cp, chunk, sequence_slices(par.gpt))
        elif par.cp is not None:
            loss_fn = functools.partial(context_parallel_losses, par.gpt, split, par.cp)
        else:
            loss_fn = functools.partial(eager_losses, par.gpt, split)
    return functools.partial(forward_then_loss, par.gpt, loss_fn), False


def eager_losses(gpt, split, x, y, docs, z_loss: float):
    logits = gpt(x) if docs is None else gpt(x, document_ids=docs)  # (B, T, V), or this rank's (B, T, V/t)
    return lm_losses(logits, y, z_loss, split)


def context_parallel_losses(gpt, split, cp, x, y, docs, z_loss: float):
    """The logits of this rank's positions against their targets, counted over the group (parallel/context.py)."""
    from lit_pretrain.parallel.context import context_losses

    logits = gpt(x) if docs is None else gpt(x, document_ids=docs)  # (B, T/c, V or V/t)
    return context_losses(logits, cp.local(y), cp.group, z_loss, split)


def head_losses(head, hidden, targets, z_loss: float, split, cp, chunk: Optional[int], seq_slices: int):
    """(task loss, z-loss or None) of head(hidden) (B, T_local, d_model) against this rank's targets: whole or, with
    model.loss_chunk_size, a chunk of positions at a time (model/losses.py `chunked_lm_sums`); under context
    parallelism counted over its group (parallel/context.py)."""
    if chunk is None:
        logits = head(hidden)  # (B, T_local, V or V/t)
        if cp is None:
            return lm_losses(logits, targets, z_loss, split)
        from lit_pretrain.parallel.context import context_losses

        return context_losses(logits, targets, cp.group, z_loss, split)
    sums = chunked_lm_sums(head, hidden, targets, chunk, z_loss, split, seq_slices)
    if cp is None:
        return means_of_sums(sums, targets, z_loss)
    from lit_pretrain.parallel.context import group_means

    return group_means(list(sums), (targets != IGNORE_INDEX).sum(), cp.group, z_loss)


def forward_losses(gpt, split, cp, chunk: Optional[int], seq_slices: int, x, y, docs, z_loss: float, mtp=()):
    """The losses computed inside the GPT's forward (its `output`, `output_losses`). Returns (task, z), and with
    `mtp` the depths' mean cross-entropy third."""

    def output(model, hidden, rope_and_mask):  # hidden (B, T_local, d_model)
        return output_losses(model, hidden, rope_and_mask, y, z_loss, mtp, split, cp, chunk, seq_slices)

    return gpt(x, document_ids=docs, output=output)


def output_losses(model, hidden, rope_and_mask, y, z_loss: float, mtp, split, cp, chunk: Optional[int],
                  seq_slices: int):
    """The main head's losses of the last block's output `hidden` (B, T_local, d_model) against the window's
    targets y (B, T), and with `mtp` (model.mtp_depth's (inputs, targets) per depth, model/mtp.py `mtp_tokens`)
    each depth's module run on the previous depth's output under the same RoPE positions and document mask
    (`rope_and_mask`: cos, sin, mask as the blocks had them), its cross-entropy through the shared head. Called
    inside the GPT's forward, and by the pipeline's last stage on its output (parallel/pipeline.py)."""
    local = (lambda t: t) if cp is None else cp.local  # this rank's positions under context parallelism
    task, z = head_losses(model.head, hidden, local(y), z_loss, split, cp, chunk, seq_slices)
    if not mtp:
        return task, z
    cos, sin, mask = rope_and_mask
    depths = []
    for k, (inputs, targets) in enumerate(mtp):
        hidden = model.mtp[k](hidden, model.tok_embeddings(local(inputs)), cos, sin, mask)  # (B, T_local, d)
        depths.append(head_losses(model.mtp_head(k), hidden, local(targets), 0.0, split, cp, chunk,
                                  seq_slices)[0])
    return task, z, torch.stack(depths).mean()


def forward_then_loss(gpt, loss_fn: LossFn, batch, z_loss: float, eod_id: Optional[int],
                      training: bool) -> StepLosses:
    x, y = batch  # (B, T) inputs and (B, T) next-token targets
    cfg = gpt.cfg
    # model.mtp_depth: each depth's tokens and targets, from the targets before masking (model/mtp.py); trained on
    # only (validation reports the next-token loss)
    mtp = [mtp_tokens(x, y, k, eod_id) for k in range(1, cfg.mtp_depth + 1)] if training else []
    docs = None
    if eod_id is not None:  # data.document_masking
        docs, y = document_ids(x, eod_id), loss_targets(x, y, eod_id)  # (B, T) each
    task, z, mtp_loss = loss_fn(x, y, docs, z_loss, mtp) if mtp else (*loss_fn(x, y, docs, z_loss), None)
    trained = task
    # model.moe: the load-balancing and router z-losses of this forward (model/moe.py), trained on but kept out of
    # train/loss, as the z-loss is (the MoE monitor logs them per layer). Added in this order, task + MoE + z, as
    # the step always has: the sum is then the same bits.
    balance = moe_loss(gpt) if training else None
    if balance is not None:
        trained = trained + balance
    if z is not None:
        trained = trained + z  # the task loss stays what train/loss reports, comparable across z_loss settings
    if mtp_loss is not None:  # DeepSeek-V3 eq. 25: λ/D Σ_k CE_k, the mean over depths times λ
        trained = trained + cfg.mtp_loss_weight * mtp_loss
    return StepLosses(task, z, trained, mtp=mtp_loss)


def pipeline_losses(runner, batch, z_loss: float, eod_id: Optional[int], training: bool) -> StepLosses:
    if eod_id is not None:  # the stages call blocks with (x, cos, sin): no mask, positions unrestarted
        raise ConfigError("data.document_masking is not supported with pipeline parallelism: set "
                          "data.document_masking=false or strategy.pipeline_parallel=1")
    runner.z_loss = z_loss
    task = runner.loss(batch, training=training)  # when training, gradients accumulated by the schedule's backward
    z = runner.last_z_loss if z_loss > 0 else None
    metrics = {"pipeline/idle_fraction": runner.last_idle_fraction,
               "pipeline/bubble_formula": runner.bubble_formula} if training else {}
    trained = task if z is None else task + z
    mtp = runner.last_mtp_loss if training and runner.gpt.cfg.mtp_depth else None
    if mtp is not None:  # its value only, as the task loss's: the schedule has run the backward of λ·mtp too
        trained = trained + runner.gpt.cfg.mtp_loss_weight * mtp
    return StepLosses(task, z, trained, metrics, mtp=mtp)
