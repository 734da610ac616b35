"""Kill anywhere and continue bit for bit: SIGKILL and SIGTERM injected into real `lit-pretrain train` runs
(subprocesses: SIGKILL must not take pytest with it), resumed with run.resume, compared with runs never interrupted.

Runs: 6 optimizer steps of 2 micro-batches (trainer.tokens_per_step=1024 = 2 × 8 × 64), a checkpoint every 2 steps.
Faults: SIGKILL in the middle of an accumulation (second micro-batch of step 4, after the step-2 checkpoint) and at
a step boundary that is not checkpointed (start of step 6, after the step-4 checkpoint); SIGTERM at the start of
step 4. Equality is bitwise (torch.equal, exact floats in metrics.csv): same process count, same data, same RNG,
same kernels, so any difference is a resume bug, not rounding.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_pretrain.runs import read_metrics, series
from tests.conftest import EXPERIMENTS, tiny_data_overrides
from tests.test_strategies_parity import free_port

pytestmark = pytest.mark.slow

STEPS = 6
COMMON = [f"trainer.max_steps={STEPS}", "trainer.val_every_n_steps=3", "trainer.log_every_n_steps=1",
          "schedule.warmup_steps=2", "trainer.tokens_per_step=1024", "trainer.checkpoint_every_n_steps=2",
          "trainer.progress_bar=false", "strategy.timeout_seconds=60", "trainer.val_batches=2"]
DDP = ["strategy=ddp", "trainer.devices=2", "trainer.micro_batch_size=4"]


def extra(*specs) -> str:
    items = ", ".join(f"{{class_path: 'tests.resume_helpers:{cls}', init_args: {json.dumps(args)}}}"
                      for cls, args in specs)
    return f"callbacks.extra=[{items}]"


@pytest.fixture(scope="module")
def train(tmp_path_factory, tiny_data_dir):
    root = tmp_path_factory.mktemp("resume_runs")

    def run(name, *overrides, faults=(), record=False, rc=0):
        specs = [("Fault", f) for f in faults]
        if record:
            specs.append(("RecordIndices", {"out": str(root / f"{name}.indices")}))
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        for var in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
            env.pop(var, None)
        cmd = [sys.executable, "-m", "lit_pretrain.cli", "train", str(EXPERIMENTS / "runs" / "tiny.yaml"),
               *tiny_data_overrides(tiny_data_dir), f"run.root_dir={root}", f"run.name={name}", *COMMON, *overrides,
               *([extra(*specs)] if specs else [])]
        # A new session: the injected SIGKILL takes down the run's process group (every rank), not pytest.
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, start_new_session=True,
                             cwd=Path(__file__).resolve().parents[1])
        assert out.returncode == rc, out.stdout[-3000:] + out.stderr[-3000:]
        return root / name, out

    return run


def losses(run_dir: Path):
    return series(read_metrics(run_dir / "metrics.csv"), "train/loss")


def weights(run_dir: Path, name: str = "last.ckpt"):
    return torch.load(run_dir / "checkpoints" / name, map_location="cpu", weights_only=True)["state_dict"]


def assert_same_run(a: Path, b: Path):
    la, lb = losses(a), losses(b)
    assert [s for s, _ in la] == list(range(STEPS)), la  # each step once, none missing
    assert la == lb  # exact floats: the CSV holds repr-exact values
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def global_indices(prefix: Path):
    """{step: sorted window indices of every micro-batch of that step, over all ranks}."""
    out = {}
    for path in prefix.parent.glob(prefix.name + ".rank*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out.setdefault(row["step"], []).extend(row["indices"])
    return {k: sorted(v) for k, v in out.items()}


def test_single_process_sigkill_twice_and_sigterm(train):
    ref, _ = train("single-ref", record=True)
    killed, _ = train("single-killed", faults=[{"step": 3, "micro_batch": 1}], rc=-signal.SIGKILL)
    assert (killed / "checkpoints" / "latest").read_text().strip() == "step0000002.ckpt"
    # Resume from step 2, killed again at the (unsaved) start of step 6, resumed from step 4 to the end.
    train("single-killed", "run.resume=auto", faults=[{"step": 5}], rc=-signal.SIGKILL)
    assert (killed / "checkpoints" / "latest").read_text().strip() == "step0000004.ckpt"
    _, out = train("single-killed", "run.resume=auto", record=True)
    assert "resuming from" in out.stdout and "step 4" in out.stdout
    assert_same_run(ref, killed)
    # Data seen after the last resume: exactly the uninterrupted run's windows for steps 4 and 5.
    ref_idx, resumed_idx = global_indices(ref.parent / "single-ref.indices"), global_indices(
        killed.parent / "single-killed.indices")
    assert resumed_idx == {k: ref_idx[k] for k in (4, 5)}

    # SIGTERM: a checkpoint at the next step boundary, a clean exit (code 0), and the resumed run matches.
    termed, out = train("single-term", faults=[{"step": 3, "signal": "TERM"}])
    assert "preemption: checkpoint at step 3 written" in out.stdout
    assert (termed / "checkpoints" / "latest").read_text().strip() == "step0000003.ckpt"
    train("single-term", "run.resume=auto")
    assert_same_run(ref, termed)


def test_ddp_sigkill_and_world_size_changes(train, tmp_path):
    ref, _ = train("ddp-ref", *DDP, record=True)
    killed, _ = train("ddp-killed", *DDP, faults=[{"step": 3, "micro_batch": 1}], rc=-signal.SIGKILL)
    step2 = killed / "checkpoints" / "step0000002.ckpt"
    assert (killed / "checkpoints" / "latest").read_text().strip() == step2.name
    # 2 → 1: the killed 2-process run's step-2 checkpoint continued by one process sees the same global windows.
    _, out = train("ddp-to-single", f"run.resume={step2}", record=True)
    ref_idx = global_indices(ref.parent / "ddp-ref.indices")
    assert global_indices(ref.parent / "ddp-to-single.indices") == {k: ref_idx[k] for k in range(2, STEPS)}
    # 2 → 2 after SIGKILL mid-accumulation: bitwise the uninterrupted 2-process run.
    train("ddp-killed", *DDP, "run.resume=auto")
    assert_same_run(ref, killed)
    # 1 → 2: a single-process run's step-4 checkpoint continued on 2 processes.
    single = ref.parent / "single-ref"
    if not single.is_dir():
        train("single-ref")
    train("single-to-ddp", *DDP, f"run.resume={single / 'checkpoints' / 'step0000004.ckpt'}", record=True)
    assert global_indices(ref.parent / "single-to-ddp.indices") == {k: ref_idx[k] for k in (4, 5)}
