"""Cases: the compiled training step (`trainer.compile: true`; on one process the whole forward and loss as one graph,
parallel/compile.py) against eager, the MFU of both, and the Trainer against the raw loop with both compiled.

Both sides run our Trainer on the same in-memory windows (bench/step.py). The compiled side's first steps pay the
compile time (tens of seconds cold, a few seconds from inductor's on-disk cache) and are left out by `skip`; later
repeats reuse the graph compiled in this process, since every new model of the same shapes runs the same code.
"""

from typing import Dict, List

from lit_pretrain.bench import mfu
from lit_pretrain.bench.step import paired_case, run_compiled, trainer_loop
from lit_pretrain.model import GPT


def run(c, steps: int, skip: int, repeats: int, peak_flops_per_s: float) -> List[Dict]:
    case = paired_case("compiled_step_tokens_per_s", lambda: trainer_loop(c, steps, skip),
                       lambda: trainer_loop(c, steps, skip, compile=True), repeats, ">= 1.15", "tokens/s",
                       ("eager", "compiled"), {"steps": steps, "timed_steps": steps - skip})
    flops_per_token = GPT(c.model).flops_per_token()
    series = {"eager": case["detail"]["eager"], "compiled": case["detail"]["compiled"]}
    return [case, *mfu.cases(series, flops_per_token, peak_flops_per_s, {"compiled": ">= 0.7"}),
            run_compiled(c, steps, skip, repeats)]
