"""Shared fixtures: one small prepared corpus for the whole session (tokenizer training is the slow part)."""

import atexit
import multiprocessing
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_pretrain import config

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"

# Denormals slowed CPU steps 5x in measurements here (docs/cpu.md, pitfall 1).
torch.set_flush_denormal(True)

# The multi-process parity tests start their ranks with start_method="forkserver": multiprocessing's fork server,
# one per pytest process, imports torch and the workers' modules once (~1.5 CPU s a rank otherwise) and forks a
# rank from that clean, single-threaded process, never from pytest itself.
multiprocessing.set_forkserver_preload(["tests.helpers.mesh_workers", "tests.helpers.expert_workers",
                                        "tests.helpers.moe_mesh_workers",
                                        "tests.helpers.sharded_workers"])


@pytest.fixture(autouse=True)
def _no_resolved_resume_left_behind():
    """A `train` run in this process (cli.main in a test) leaves rank 0's resolved resume in os.environ for the ranks
    Lightning starts from it (resume/session.py RESOLVED_ENV): removed after each test, so that a later test's
    torchrun (whose ranks inherit pytest's environment, not a rank 0's) never resumes from another test's file."""
    from lit_pretrain.resume.session import RESOLVED_ENV

    yield
    os.environ.pop(RESOLVED_ENV, None)


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    """400 documents of the default corpus, byte-level BPE with 512 tokens, prepared once."""
    from lit_pretrain.data.preparation.prepare import prepare

    folder = tmp_path_factory.mktemp("prepared") / "stdlib-tiny"
    cfg = config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", tiny_data_overrides(folder)))
    prepare(cfg.data, log=lambda *_: None)
    return folder


@pytest.fixture
def coarse_fit_grid(monkeypatch):
    """Every 11th of Hoffmann et al.'s 4,500 L-BFGS starts (scaling/fit.py grid_starts) for this test's law fits:
    410 starts, a third of the fitting's CPU time (six fits of the ladder's short grid: 47.7 s -> 15.8 s; the rows
    run at once, so fewer rows save less than their share). 11 is prime to the grid's axes (5 and 6 values), so each
    value of every coefficient is among them, unlike a stride of 25 (alpha = beta = 0 only). For tests whose subject
    is what is done with a fit (choosing, reporting, resuming); the whole grid's own result, Chinchilla's coefficients
    from its 240 runs, is tests/scaling/test_scaling_fit.py's."""
    from lit_pretrain.scaling import fit

    whole = fit.grid_starts
    monkeypatch.setattr(fit, "grid_starts", lambda *a, **k: whole(*a, **k)[::11])


def tiny_data_overrides(folder: Path) -> list:
    """The tiny corpus in `folder`, and micro-batches of 8 windows: the suite's runs were written for one micro-batch
    of 8 per step on one process (tiny.yaml's 512 tokens a step; the shipped file splits it as 4 x 2 so that
    2 data-parallel ranks divide it). A test on 2 data-parallel ranks sets trainer.micro_batch_size=4."""
    return [f"data.prepared_dir={folder}", "data.max_documents=400", "data.vocab_size=512",
            "trainer.micro_batch_size=8"]


def free_port() -> int:
    """A free port on loopback (every test server and process group listens there only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env() -> dict:
    """This environment for a fresh multi-process launch: a free loopback port and no rank variables inherited from
    an enclosing launcher, so Lightning starts and numbers the ranks itself."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for var in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
        env.pop(var, None)
    return env


def train_args(data_dir: Path, root: Path, name: str) -> list:
    """`python -m` arguments of `lit-pretrain train` on the tiny experiment and corpus, into root/name."""
    return ["lit_pretrain.cli", "train", str(EXPERIMENTS / "runs" / "tiny.yaml"), *tiny_data_overrides(data_dir),
            f"run.root_dir={root}", f"run.name={name}"]


_SERVER = []
PREWARMED = {("lit_pretrain.cli", "train"), ("lit_pretrain.cli", "ladder")}  # the commands that import Lightning


def _prewarmed():
    """This process's server of prewarmed runs (tests/helpers/prewarmed.py), started on first use."""
    if not _SERVER:
        from tests.helpers.prewarmed import Server

        _SERVER.append(Server(ROOT))
        atexit.register(_SERVER[0].close)
    return _SERVER[0]


def run_module(*args, rc: int = 0, timeout: int = 480, **kwargs) -> subprocess.CompletedProcess:
    """`python -m ARGS` in a subprocess (Lightning's launcher re-runs the command for the other ranks, which inside
    pytest would re-launch pytest: docs/cpu.md, pitfall 2); asserts its exit code, showing the output's
    tail when it differs."""
    # forked from a process that imported Lightning
    if args[:2] in PREWARMED or args[:1] == ("tests.helpers.mesh_resume",):
        out = _prewarmed().run(args, launcher_env(), ROOT, timeout, **kwargs)
    else:
        out = subprocess.run([sys.executable, "-m", *args], env=launcher_env(), capture_output=True, text=True,
                             timeout=timeout, cwd=ROOT, **kwargs)
    assert out.returncode == rc, out.stdout[-3000:] + out.stderr[-3000:]
    return out



def pytest_configure(config):
    from tests.helpers.longest_first import LongestFirst

    config.pluginmanager.register(LongestFirst(config), "longest_first")  # `make test`'s order for its workers
