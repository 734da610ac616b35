"""Cases: tokens/s of the experiment's training step in bf16-mixed against 32-true (`trainer.precision`), and the MFU
of each against the matmul peak of its own dtype, measured beside it.

Both sides run our Trainer (bench/step/step.py trainer_loop) on the experiment's model and micro-batch, compiled as the
run compiles (trainer.compile resolved by the plan: `auto` compiles the default run), alternated (bench/stats.py);
the first `skip` steps of each run hold the compile and are left out. bf16-mixed is Lightning's autocast: the
matmuls and attention run in bf16 on fp32 weights, the loss, the gradients, their clipping and AdamW stay fp32
(tests/parallel/test_bf16.py).

CPUs with bf16 matrix instructions (AVX512-BF16, AMX on Sapphire Rapids and later) run a bf16 matmul at 2-2.4x the
fp32 one (a 2048² matmul here: `detail.matmul_peak_ratio`), which bounds the step's gain: the step is ~90% matmul
FLOPs, and the rest (attention, norms, the fp32 loss over the vocabulary, AdamW) gains little. Without them bf16
matmuls are emulated and the step is many times slower (about 30x: ~30 s a step of the default model), so the case
stops after the first alternation when bf16 is emulated (EMULATED slower): five would take minutes to say the same.
"""

from typing import Dict, List

from lit_pretrain.bench import stats
from lit_pretrain.bench.step import mfu
from lit_pretrain.bench.step.step import trainer_loop
from lit_pretrain.model.gpt import GPT
from lit_pretrain.planning.plan import build_plan

EMULATED = 0.2  # bf16 / fp32 tokens/s below this: no bf16 units, one alternation is enough


def run(c, steps: int, skip: int, repeats: int) -> List[Dict]:
    compile = build_plan(c).compile
    refs, cands, peaks = [], [], {"fp32": [], "bf16": []}
    for _ in range(repeats):
        for dtype in peaks:  # untimed, next to the runs they are the references of
            peaks[dtype].append(mfu.cpu_matmul_peak(dtype=dtype))
        refs.append(trainer_loop(c, steps, skip, compile=compile))
        cands.append(trainer_loop(c, steps, skip, compile=compile, precision="bf16-mixed"))
        if cands[0] / refs[0] < EMULATED:
            break
    emulated = cands[0] / refs[0] < EMULATED
    case = {"case": "bf16_mixed_step_tokens_per_s", **stats.summary(refs, cands), "goal": ">= 1.5",
            "unit": "tokens/s",
            "detail": {"bf16_mixed": cands, "fp32": refs, "steps": steps, "timed_steps": steps - skip,
                       "micro_batch_size": c.trainer.micro_batch_size, "compiled": compile,
                       "matmul_peak_ratio": max(peaks["bf16"]) / max(peaks["fp32"]), "emulated_bf16": emulated}}
    # Each side's MFU against the best peak of its own dtype (bench/step/compile.py: a peak is the best rate reached, so
    # more samples only make the MFU more conservative).
    flops_per_token = GPT(c.model).flops_per_token()
    out = [case]
    for name, series, dtype in (("bf16_mixed", cands, "bf16"), ("32_true", refs, "fp32")):
        (m,) = mfu.cases({name: series}, flops_per_token, max(peaks[dtype]), {}, peak_dtype=dtype)
        m["detail"]["peak_samples_gflops"] = [p / 1e9 for p in peaks[dtype]]
        out.append(m)
    return out
