"""`plan`, `memory`, `show`, `runs` and every `--help` import neither torch nor lightning.

Importing torch alone takes seconds; these commands answer in well under one when they don't. The test asserts on
the imports, not on time (timings vary with the machine's load): one fresh interpreter runs every command in turn
and reports the heavy modules present after each, so the first command that pulls one in is named.
"""

import json
import subprocess
import sys

from tests.conftest import EXPERIMENTS, ROOT

HEAVY = ("torch", "lightning", "lightning_fabric", "pytorch_lightning")

# Runs in a fresh interpreter (this one has torch loaded). Every subcommand the parser knows gets its --help, so a
# command added later is held to the same rule without touching this file.
SCRIPT = r"""
import argparse, contextlib, io, json, sys
from lit_pretrain import cli

heavy, commands = json.loads(sys.argv[1])
parser = cli._parser()
names = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
commands = [["--help"]] + [[name, "--help"] for name in sorted(names)] + [
    c for c in commands if c[0] in names]
report = []
for argv in commands:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = cli.main(argv)
        except SystemExit as exit:
            code = exit.code
    report.append([argv, code, [m for m in heavy if m in sys.modules], out.getvalue()[-300:]])
print(json.dumps(report))
"""

COMMANDS = [
    ["plan", "--flops", "1e21"],
    ["plan", "--params", "7B", "--json"],
    ["plan", "--tokens", "1.4T", "--law", "kaplan"],
    ["memory", "--params", "7B", "--data-parallel", "8", "--zero-stage", "3"],
    ["memory", "--layers", "4", "--hidden", "256", "--heads", "4", "--exact", "--data-parallel", "2"],
    ["memory", "--params", "1B", "--model", "n_kv_heads=2", "--model", "mlp=gelu"],  # the architecture variants' keys
    ["show", str(EXPERIMENTS / "runs" / "default.yaml")],
    ["show", str(EXPERIMENTS / "runs" / "tiny.yaml"), "strategy=tensor", "trainer.devices=2"],
    ["show", str(EXPERIMENTS / "runs" / "tiny.yaml"), "trainer.max_stepz=3"],  # the error path too (exit 2)
    ["memory", "--run", str(EXPERIMENTS / "runs" / "llama3_1_8b_h200x8.yaml")],  # a run file's fit
    ["plan", "--run", str(EXPERIMENTS / "runs" / "llama3_1_8b_h200x32.yaml")],
    # GPU-hours read the GPUs' datasheet peaks (lit_pretrain/gpu_peaks.py), not the throughput callback's module
    ["plan", "--run", str(EXPERIMENTS / "runs" / "llama3_1_8b_h200x8.yaml"), "--mfu", "0.4", "--gpu", "H200"],
    ["show", str(EXPERIMENTS / "runs" / "llama3_2_1b_h200x8.yaml")],
    ["runs", str(EXPERIMENTS)],  # `lit-pretrain runs [ROOT]`, where the parser has it
    ["ladder", "--plan", "--small"],  # the ladder's grid and time estimate: trains nothing
    ["ladder", "--plan", "--small", "--mfu", "0.4"],  # and its GPU-hours
]


def test_fast_commands_import_neither_torch_nor_lightning():
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([HEAVY, COMMANDS])], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.splitlines()[-1])
    ran = [argv for argv, *_ in report]
    for argv, code, heavy, tail in report:
        assert heavy == [], f"lit-pretrain {' '.join(argv)} imported {heavy}"
        # `runs` may find no run under experiments/ and say so (exit 2): only its imports matter here.
        expected = {2} if argv[-1] == "trainer.max_stepz=3" else {0, 2} if argv[0] == "runs" else {0}
        assert code in expected, f"lit-pretrain {' '.join(argv)} exited {code}: {tail}"
    assert ["plan", "--help"] in ran and ["generate", "--help"] in ran and ["train", "--help"] in ran


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    # `lit-pretrain ladder --plan GRID | head -1`: the reader is gone before the command writes (its read end is
    # closed at once, so the first write fails whatever the pipe's buffer holds): exit 141 (128 + SIGPIPE) and
    # nothing on stderr, where Python's BrokenPipeError printed a traceback twice (the write, then the exit's flush).
    import os

    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "lit_pretrain.cli", "ladder", "--plan",
                               str(EXPERIMENTS / "ladder" / "short.yaml")], stdout=write, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, timeout=60)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")
