"""Cases: activation checkpointing none / selective / full on one process's forward and backward: seconds per step
and the bytes the forward leaves saved for the backward (parallel/memory.py SavedActivations, the selective cache
included), each mode as a ratio to none, alternated in one process (bench/stats.py).

Goals: selective at most 10% slower than none (torchtitan's op policy recomputes only the cheap ops);
full about 1.33x (one more forward of each block). On this CPU the norms, RoPE and SiLU the selective mode runs
again are a larger share of the step than on a GPU, where the matmuls dominate: report, don't gate.
"""

import copy
import time

import torch
import torch.nn.functional as F

from lit_pretrain.bench import stats

MODES = ("selective", "full")


def run(c, steps: int = 4, skip: int = 1, alternations: int = stats.ALTERNATIONS) -> list:
    from lit_pretrain.model.gpt import GPT
    from lit_pretrain.parallel.activation_checkpointing import apply_activation_checkpointing
    from lit_pretrain.parallel.memory import SavedActivations

    torch.manual_seed(c.run.seed)
    base = GPT(c.model)
    g = torch.Generator().manual_seed(c.run.seed)
    windows = torch.randint(0, c.model.vocab_size, (c.trainer.micro_batch_size, c.model.seq_len + 1), generator=g)
    x, y = windows[:, :-1], windows[:, 1:]
    seconds = {m: [] for m in ("none", *MODES)}
    saved = {}
    for _ in range(alternations):
        for mode in seconds:
            model = copy.deepcopy(base)
            apply_activation_checkpointing(model, mode, save_matmuls=c.strategy.activation_checkpointing_save_matmuls)
            with SavedActivations(model) as meter:
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            loss.backward()
            saved[mode] = meter.bytes
            for step in range(steps):
                if step == skip:
                    start = time.perf_counter()
                F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).backward()
            seconds[mode].append((time.perf_counter() - start) / (steps - skip))
    detail = {"forward_backward_only": True, "micro_batch_size": c.trainer.micro_batch_size,
              "save_matmuls": c.strategy.activation_checkpointing_save_matmuls}
    goals = {"selective": "<= 1.10 (on GPU)", "full": "report (recompute: ~1.33 expected)"}
    cases = []
    for mode in MODES:
        cases.append({"case": f"act_ckpt_{mode}_vs_none_step_seconds", **stats.summary(seconds["none"], seconds[mode]),
                      "goal": goals[mode], "unit": "s/step", "detail": detail})
        cases.append({"case": f"act_ckpt_{mode}_vs_none_saved_bytes", "value": saved[mode], "reference": saved["none"],
                      "ratio": saved[mode] / saved["none"], "goal": "report (< 1)", "unit": "bytes", "detail": detail})
    return cases
