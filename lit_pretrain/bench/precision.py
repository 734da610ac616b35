"""Case: tokens/s of the bf16-mixed training step against fp32 (`trainer.precision`), same model and batch.

On CPUs with bf16 matrix units (AMX on Sapphire Rapids and later, AVX512-BF16) bf16 is faster than fp32 (2.2x on
this bench's AMX machine); without them bf16 matmuls are emulated and the step is many times slower (about 30x: ~30 s
a step of the default model). So the case runs one sequence per micro-batch and a few steps, and stops after the
first alternation when bf16 is emulated (EMULATED slower): five would take minutes to say the same. bf16 pays off on
GPUs (`make bench-gpu`).
"""

import dataclasses
from typing import Dict

from lit_pretrain.bench import stats
from lit_pretrain.bench.step import trainer_loop

STEPS, SKIP = 3, 1  # the first step allocates and selects kernels: left out
EMULATED = 0.2  # bf16 / fp32 tokens/s below this: no bf16 units, one alternation is enough


def run(c, repeats: int) -> Dict:
    one = dataclasses.replace(c, trainer=dataclasses.replace(c.trainer, micro_batch_size=1))
    refs, cands = [], []
    for _ in range(repeats):
        refs.append(trainer_loop(one, STEPS, SKIP))
        cands.append(trainer_loop(one, STEPS, SKIP, precision="bf16-mixed"))
        if cands[0] / refs[0] < EMULATED:
            break
    return {"case": "bf16_mixed_step_tokens_per_s", **stats.summary(refs, cands), "goal": "- (fp32 on CPU)",
            "unit": "tokens/s", "detail": {"bf16_mixed": cands, "fp32": refs, "steps": STEPS,
                                           "timed_steps": STEPS - SKIP, "micro_batch_size": 1,
                                           "emulated_bf16": cands[0] / refs[0] < EMULATED}}
