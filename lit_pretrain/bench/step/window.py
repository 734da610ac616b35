"""Case: a training step with sliding-window attention (model.sliding_window, a local-global pattern) against the
same step with full attention.

The experiment's model, micro-batch and optimizer in masking.py's plain loop, on the same random windows; the
windowed side keeps every second layer global (GPT-OSS's alternation) and the others to a quarter of model.seq_len.
Its layers count fewer attention FLOPs (model/mask_spec.py `scored_pairs`), but SDPA computes every score its
boolean mask drops and reads the (T, T) mask instead of taking its is_causal path: the figure, windowed / full step
time, says what the window costs through the one mask function, not what a block-sparse kernel would save.
"""

import dataclasses
import time
from typing import Dict

from lit_pretrain.bench import stats
from lit_pretrain.bench.step.masking import SKIP, STEPS, windows
from lit_pretrain.module import PretrainModule
from lit_pretrain.optim.optimizers import build_optimizer


def windowed(model):
    """The model with a window of seq_len / 4 on layers 0, 2, 4, ... (model.global_attention_every=2)."""
    return dataclasses.replace(model, sliding_window=max(1, model.seq_len // 4), global_attention_every=2)


def step_seconds(c, model, steps: int = STEPS, skip: int = SKIP) -> float:
    """Mean seconds per optimizer step over steps skip..steps."""
    module = PretrainModule(model, c.optim, c.schedule, max_steps=steps, tokens_per_step=1, seed=c.run.seed)
    opt = build_optimizer(module.model, c.optim)
    start = None
    for step, w in enumerate(windows(c, steps)):
        module.loss((w[:, :-1], w[:, 1:])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step + 1 == skip:
            start = time.perf_counter()
    return (time.perf_counter() - start) / (steps - skip)


def run(c, repeats: int) -> Dict:
    """Alternate full and windowed `repeats` times: medians and the spread of windowed / full (bench/stats.py)."""
    local = windowed(c.model)
    full, window = stats.alternate(lambda: step_seconds(c, c.model), lambda: step_seconds(c, local), repeats)
    return {"case": "sliding_window_step_time", **stats.summary(full, window), "goal": "report", "unit": "s/step",
            "detail": {"windowed": window, "full": full, "timed_steps": STEPS - SKIP,
                       "sliding_window": local.sliding_window, "global_attention_every": 2,
                       "tokens_per_step": c.trainer.micro_batch_size * c.model.seq_len}}
