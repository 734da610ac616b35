"""Case: a training step with document masking (data.document_masking) against the same step without it.

The experiment's model, micro-batch and optimizer, in a plain loop (PretrainModule.loss, backward, fused AdamW) on
the same random windows, cut into documents of MEAN_DOCUMENT_TOKENS tokens on average by end-of-document ids: the
masked side pays for the document ids, the per-row RoPE gather and the (B, 1, T, T) mask that SDPA then reads
instead of its is_causal path; the mask costs the same whatever the documents' lengths. The figure is step time,
masked / unmasked: above 1 is what masking costs.
"""

import time
from typing import Dict

import torch

from lit_pretrain.bench import stats
from lit_pretrain.module import PretrainModule
from lit_pretrain.optim.optimizers import build_optimizer

EOD = 0  # any id: the windows are random, only where the EODs sit matters
MEAN_DOCUMENT_TOKENS = 64
# 8 steps (6 timed) a side, not the step case's: 5 alternations of both sides, and `make bench` stays under 12 minutes.
STEPS, SKIP = 8, 2


def windows(c, steps: int) -> torch.Tensor:
    """(steps, B, T + 1) random ids with an EOD at each token with probability 1 / MEAN_DOCUMENT_TOKENS."""
    g = torch.Generator().manual_seed(c.run.seed)
    shape = (steps, c.trainer.micro_batch_size, c.model.seq_len + 1)
    ids = torch.randint(1, c.model.vocab_size, shape, generator=g)
    return ids.masked_fill(torch.rand(shape, generator=g) < 1 / MEAN_DOCUMENT_TOKENS, EOD)


def step_seconds(c, masked: bool, steps: int = STEPS, skip: int = SKIP) -> float:
    """Mean seconds per optimizer step over steps skip..steps."""
    module = PretrainModule(c.model, c.optim, c.schedule, max_steps=steps, tokens_per_step=1, seed=c.run.seed,
                            eod_id=EOD if masked else None)
    opt = build_optimizer(module.model, c.optim)  # the experiment's optimizer, one process (fused AdamW)
    start = None
    for step, w in enumerate(windows(c, steps)):
        module.loss((w[:, :-1], w[:, 1:])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step + 1 == skip:
            start = time.perf_counter()
    return (time.perf_counter() - start) / (steps - skip)


def run(c, repeats: int) -> Dict:
    """Alternate unmasked and masked `repeats` times: medians and the spread of masked / unmasked (bench/stats.py)."""
    plain, masked = stats.alternate(lambda: step_seconds(c, masked=False), lambda: step_seconds(c, masked=True),
                                    repeats)
    return {"case": "document_masking_step_time", **stats.summary(plain, masked), "goal": "report", "unit": "s/step",
            "detail": {"masked": masked, "unmasked": plain, "timed_steps": STEPS - SKIP,
                       "mean_document_tokens": MEAN_DOCUMENT_TOKENS,
                       "tokens_per_step": c.trainer.micro_batch_size * c.model.seq_len}}
