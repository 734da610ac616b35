"""Case: a training step with model.loss_chunk_size against the same step computing the whole window's logits.

The experiment's model and micro-batch, one process, the forward and backward of PretrainModule.loss on the same
random windows: the peak bytes of the step (torch's MemTracker: parameters, gradients, activations and
temporaries on the step's device) and its time. The chunked side recomputes each chunk's head in the backward (one
more head matmul per token) and never holds the (B, T, V) logits. Figures: peak bytes and step time, chunked /
whole (below 1 for memory is the saving).
"""

import time
from dataclasses import replace
from typing import Dict, List

import torch

from lit_pretrain.bench import stats
from lit_pretrain.module import PretrainModule

CHUNKS = 8  # model.loss_chunk_size = an eighth of the window: the logits held at once shrink eightfold
STEPS, SKIP = 4, 1


def _module(c, chunk):
    model = replace(c.model, loss_chunk_size=chunk)
    return PretrainModule(model, c.optim, c.schedule, max_steps=STEPS, tokens_per_step=1, seed=c.run.seed)


def _windows(c) -> torch.Tensor:
    g = torch.Generator().manual_seed(c.run.seed)
    return torch.randint(0, c.model.vocab_size, (c.trainer.micro_batch_size, c.model.seq_len + 1), generator=g)


def peak_bytes(c, chunk) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    module, w = _module(c, chunk), _windows(c)
    tracker = MemTracker()
    tracker.track_external(module.model)
    with tracker:
        module.loss((w[:, :-1], w[:, 1:])).backward()
    snapshot = tracker.get_tracker_snapshot("peak")
    return int(snapshot[next(iter(snapshot))]["Total"])


def step_seconds(c, chunk) -> float:
    module, w = _module(c, chunk), _windows(c)
    start = None
    for step in range(STEPS):
        module.loss((w[:, :-1], w[:, 1:])).backward()
        if step + 1 == SKIP:
            start = time.perf_counter()
    return (time.perf_counter() - start) / (STEPS - SKIP)


def run(c, repeats: int) -> List[Dict]:
    chunk = max(1, c.model.seq_len // CHUNKS)
    whole, chunked = peak_bytes(c, None), peak_bytes(c, chunk)
    plain, cut = stats.alternate(lambda: step_seconds(c, None), lambda: step_seconds(c, chunk), repeats)
    detail = {"loss_chunk_size": chunk, "vocab_size": c.model.vocab_size,
              "tokens": c.trainer.micro_batch_size * c.model.seq_len}
    return [{"case": "chunked_loss_peak_bytes", "value": chunked, "reference": whole, "ratio": chunked / whole,
             "goal": "report", "unit": "bytes", "detail": detail},
            {"case": "chunked_loss_step_time", **stats.summary(plain, cut), "goal": "report", "unit": "s/step",
             "detail": detail}]
