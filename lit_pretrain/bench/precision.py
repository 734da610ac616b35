"""Case: tokens/s of the bf16-mixed training step against fp32 (`trainer.precision`), same model and batch.

On CPUs without bf16 matrix units (AMX, AVX512-BF16) bf16 matmuls are emulated and the step is many times slower
than fp32 (about 30x here: ~30 s a step of the default model), so this case runs one sequence per micro-batch and
a few steps: enough to compare per-token cost without spending minutes. bf16 pays off on GPUs (`make bench-gpu`).
"""

import dataclasses
from typing import Dict

from lit_pretrain.bench.step import paired_case, trainer_loop

STEPS, SKIP = 3, 1  # the first step allocates and selects kernels: left out


def run(c) -> Dict:
    one = dataclasses.replace(c, trainer=dataclasses.replace(c.trainer, micro_batch_size=1))
    return paired_case("bf16_mixed_step_tokens_per_s", lambda: trainer_loop(one, STEPS, SKIP),
                       lambda: trainer_loop(one, STEPS, SKIP, precision="bf16-mixed"), 1, "- (fp32 on CPU)",
                       "tokens/s", ("fp32", "bf16_mixed"),
                       {"steps": STEPS, "timed_steps": STEPS - SKIP, "micro_batch_size": 1})
