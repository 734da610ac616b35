"""trainer.compile's "auto" (the default), true and false, resolved to a yes or no with a one-line reason.

No torch here: `show` and `plan` resolve the config without importing it (tests/test_fast_commands.py).

auto compiles when all three hold:
1. inductor can build its kernels here: a C++ compiler is found ($CXX, c++, g++, clang++) and Python's headers
   (Python.h). Inductor writes C++ for CPU kernels, each built as a Python extension module, and builds a launcher
   for Triton's GPU kernels, all with the system compiler, at the first step;
2. the plan allows it: no tensor or pipeline parallelism (our tensor-parallel layers call process-group
   collectives inside the block, which a fullgraph compile cannot trace; pipeline stages run under torch's
   schedule);
3. the run is long enough to pay the compile time back: each process's training FLOPs (trainer.max_steps x its
   tokens per step x 6N + 12LHQT per token, PaLM appendix B) reach AUTO_MIN_FLOPS.

Why FLOPs and not steps: the compile time is about the same for any model (one graph of the same code), while the
time a step saves grows with the step's work. A steps threshold would compile the tiny models of the smoke runs,
ablations and the CPU scaling sweep (11 shapes in one process), where 20 s of compiling cannot be won back, or
leave large models eager for hundreds of steps.
"""

import os
import shutil
import sysconfig
from dataclasses import dataclass
from typing import Optional, Union

# Measured on the default model (experiments/runs/default.yaml: 5.3M parameters, 35.0 MFLOPs a token, 2,048 tokens a
# step) on the 2-core CPU this project is measured on, torch 2.13, alternated in one process: compiling the step
# costs COMPILE_S_COLD seconds on a cold inductor cache and COMPILE_S_WARM once the cache holds the graph's kernels (a
# later run of the same shapes), and saves SAVED_FRACTION of an eager step that runs EAGER_FLOPS_PER_S. Compiling
# pays back after COMPILE_S x EAGER_FLOPS_PER_S / SAVED_FRACTION training FLOPs.
COMPILE_S_COLD = 20.0
COMPILE_S_WARM = 4.0
EAGER_FLOPS_PER_S = 208e9
SAVED_FRACTION = 0.21
BREAK_EVEN_COLD = COMPILE_S_COLD * EAGER_FLOPS_PER_S / SAVED_FRACTION  # 2.0e13
BREAK_EVEN_WARM = COMPILE_S_WARM * EAGER_FLOPS_PER_S / SAVED_FRACTION  # 4.0e12
# Half the cold break-even: a first run on a machine (cold cache) loses at most half its compile time, and every later
# run of the same shapes gains (the default run, 1.43e13, loses about 5 s of ~75 cold and gains about 10 s warm).
# The tiny runs (experiments/runs/tiny.yaml: 3.6e10 in 100 steps), the ablations (7e10) and the CPU sweep's runs
# (under 3e12 each) stay eager, as does every test that trains through `train`.
# The same threshold serves trainer.precision=bf16-mixed (no precision enters the decision): on a CPU with bf16
# instructions its eager step runs 1.50x the fp32 one, which would raise the break-even by as much, but compiling
# saves 27% of it instead of 19-21% (inductor fuses autocast's casts into its kernels), which lowers it by 1.4x: the
# two cancel to within 6% (the default model, 1 thread, 8 steps alternated in one process, CPU time per step: fp32
# eager 1,160 ms, compiled 937; bf16-mixed eager 771, compiled 563; avx512_bf16, no AMX, torch 2.13, under load).
AUTO_MIN_FLOPS = BREAK_EVEN_COLD / 2


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
    """Why, in words, with what to set to decide otherwise where another choice is allowed."""

    def note(self) -> str:
        """The line `lit-pretrain train` prints just before training."""
        return f"torch.compile: {'on' if self.compile else 'off'} — {self.reason}"


def decide(setting: Union[bool, str], flops: Optional[float], tensor_parallel: int = 1, pipeline_parallel: int = 1,
           missing: Optional[str] = "lookup") -> CompileDecision:
    """What trainer.compile=`setting` means for this run. `flops`: each process's training FLOPs (run_flops), None
    when unknown. `missing`: what the toolchain lacks (missing_toolchain's answer; None: nothing), looked up by
    default. true and false are taken as given (true's requirements are checked where it is applied: check_plan for
    the layout, compile.check_toolchain for the toolchain)."""
    if setting is True:
        return CompileDecision(True, "trainer.compile=true asks for it (the first steps pay the compile time)")
    if setting is False:
        return CompileDecision(False, "trainer.compile=false asks for eager steps")
    if setting != "auto":
        raise ValueError(f"trainer.compile={setting!r}: expected true, false or auto")
    # trainer.compile=true is refused with tensor or pipeline parallelism (plan.check_plan): no hint to force it.
    if tensor_parallel > 1:
        return CompileDecision(False, f"tensor parallelism is on (strategy.tensor_parallel={tensor_parallel}): our "
                                      "tensor-parallel layers call collectives inside each block, which a full-graph "
                                      "compile cannot trace")
    if pipeline_parallel > 1:
        return CompileDecision(False, f"pipeline parallelism is on (strategy.pipeline_parallel={pipeline_parallel}): "
                                      "its stages run under torch's pipeline schedule, not as one compiled step")
    if flops is None:
        return CompileDecision(False, "trainer.compile=auto cannot weigh the run without the model's size; set "
                                      "trainer.compile=true to compile")
    if missing == "lookup":
        missing = missing_toolchain()
    if missing is not None:
        return CompileDecision(False, f"{missing}, which inductor needs to build its kernels; install it to let "
                                      "trainer.compile=auto compile")
    size = f"this run's {flops:.2g} training FLOPs a process"
    cost = f"the ~{COMPILE_S_COLD:.0f} s a first compile takes"
    if flops < AUTO_MIN_FLOPS:
        return CompileDecision(False, f"{size} are under the {AUTO_MIN_FLOPS:.2g} that pay back {cost} "
                                      "(trainer.compile=auto); set trainer.compile=true to compile anyway")
    return CompileDecision(True, f"a C++ compiler was found and {size} pay back {cost} (from {AUTO_MIN_FLOPS:.2g}, "
                                 "trainer.compile=auto); set trainer.compile=false to run eager")


def run_flops(max_steps: int, tokens_per_step: int, flops_per_token: float) -> float:
    """One process's training FLOPs: steps x the tokens it computes a step x FLOPs a token."""
    return float(max_steps) * tokens_per_step * flops_per_token
