"""Cases: the compiled training step (`trainer.compile: true`; on one process the whole forward and loss as one graph,
parallel/compile.py) against eager, the MFU of both, and the Trainer against the raw loop with both compiled.

Both sides run our Trainer on the same in-memory windows (bench/step/step.py). The compiled side's first steps pay the
compile time (tens of seconds cold, a few seconds from inductor's on-disk cache) and are left out by `skip`; later
repeats reuse the graph compiled in this process, since every new model of the same shapes runs the same code.
"""

from typing import Dict, List

from lit_pretrain.bench.step import mfu
from lit_pretrain.bench.step.step import paired_case, run_compiled, trainer_loop
from lit_pretrain.model.gpt import GPT


def run(c, steps: int, skip: int, repeats: int, peak_flops_per_s: float) -> List[Dict]:
    """`peak_flops_per_s`: the matmul peak measured at the start of the run. The MFU cases divide by the best of it
    and a measurement before each alternation: one measurement of a fraction of a second moved 374-444 GFLOP/s
    between two idle runs here (and the MFU with it), while the best of six moves far less, and a peak is the best
    rate the matmuls reach, so more samples can only make the MFU more conservative."""
    peaks = [peak_flops_per_s]

    def eager() -> float:
        peaks.append(mfu.cpu_matmul_peak())  # untimed, next to the runs it is the reference of
        return trainer_loop(c, steps, skip)

    case = paired_case("compiled_step_tokens_per_s", eager, lambda: trainer_loop(c, steps, skip, compile=True),
                       repeats, ">= 1.15", "tokens/s", ("eager", "compiled"),
                       {"steps": steps, "timed_steps": steps - skip})
    flops_per_token = GPT(c.model).flops_per_token()
    series = {"eager": case["detail"]["eager"], "compiled": case["detail"]["compiled"]}
    mfu_cases = mfu.cases(series, flops_per_token, max(peaks), {"compiled": ">= 0.7"})
    for m in mfu_cases:
        m["detail"]["peak_samples_gflops"] = [p / 1e9 for p in peaks]
    return [case, *mfu_cases, run_compiled(c, steps, skip, repeats)]
