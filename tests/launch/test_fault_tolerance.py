"""A rank that dies, stops or hangs ends the job in bounded time with one line of ours; run.max_restarts restarts it
bitwise. Real `lit-pretrain train` runs of 2 processes (Lightning's launcher, gloo), faults injected by
tests/helpers/failure_helpers.py; each run in a session of its own, so the test can count what is left of it. The runs
fork from the prewarmed server (tests/helpers/prewarmed.py), their rank 1 from its zygote: what the launcher, the
watchdog and the supervisor do is theirs, only Lightning's import is shared.

Bounds: strategy.peer_failure_timeout_seconds=5 here. A process gone on the same host is seen at the next heartbeat
(1 s); a stopped one after the 5 s; a hang after strategy.hang_timeout_seconds=4. The exits are asserted within
that plus 15 s: the acknowledgements, the exit and a loaded 2-core machine (measured: 0.3–2 s past the timeout).
"""

import json
import os
import random
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from lit_pretrain.resume.weights import read_checkpoint
from lit_pretrain.runs.folder import read_metrics, series
from tests.conftest import ROOT, _prewarmed, launcher_env, train_args

pytestmark = pytest.mark.slow

STEPS = 6
COMMON = [f"trainer.max_steps={STEPS}", "trainer.val_every_n_steps=3", "trainer.log_every_n_steps=1",
          "schedule.warmup_steps=2", "trainer.checkpoint_every_n_steps=2", "trainer.progress_bar=false",
          "strategy.timeout_seconds=120", "trainer.val_windows=8", "strategy.peer_failure_timeout_seconds=5"]
DDP = ["strategy=ddp", "trainer.devices=2", "trainer.micro_batch_size=4"]
PEER_TIMEOUT = 5
MARGIN = 15


def session_processes(sid: int) -> list:
    """Pids of the processes still in session `sid` (the run's: Lightning's ranks inherit it)."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if int(text[text.rindex(")") + 2:].split()[3]) == sid:  # field 6: the session id
            left.append(int(stat.parent.name))
    return left


class Job:
    """`python -m ARGS` in a new session, forked from the prewarmed server (tests/helpers/prewarmed.py: a fresh
    interpreter's run but for the import time; Lightning's rank 1 likewise; a supervisor's run is a real fork-exec);
    its stdout and stderr into one FIFO, every line with the time it arrived (for the measurements)."""

    def __init__(self, *args):
        fifo = Path(tempfile.mkdtemp(prefix="job-")) / "output"
        os.mkfifo(fifo)
        self.lines = []
        self.reader = threading.Thread(target=self._read, args=(fifo,), daemon=True)
        self.reader.start()  # opens the FIFO for reading: the run's opening it for writing returns then
        self.proc = _prewarmed().start(args, launcher_env(), ROOT, fifo, fifo, start_new_session=True)

    def _read(self, fifo: Path):
        with open(fifo) as output:
            for line in output:
                self.lines.append((time.time(), line.rstrip("\n")))
        shutil.rmtree(fifo.parent, ignore_errors=True)

    def wait(self, timeout=300) -> int:
        try:
            code = self.proc.wait(timeout)
        finally:
            left = session_processes(self.proc.pid)
            for pid in left:  # never leave a run behind, even when the test fails
                os.kill(pid, 9)
            self.proc.wait(60)  # after a timeout: the run's end, now that it is killed
        self.reader.join(10)
        self.ended, self.left = time.time(), left
        return code

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def matching(self, pattern: str) -> list:
        return [(t, line) for t, line in self.lines if re.search(pattern, line)]


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_data_dir):
    root = tmp_path_factory.mktemp("fault_runs")

    def start(name, *overrides, faults=()):
        extra = [f"callbacks.extra=[{', '.join(json.dumps(f) for f in faults)}]"] if faults else []
        return root / name, Job(*train_args(tiny_data_dir, root, name), *COMMON, *DDP, *overrides, *extra)

    return start


def fault(**init_args) -> dict:
    return {"class_path": "tests.helpers.failure_helpers:RankFault", "init_args": init_args}


def assert_one_line(job: Job, pattern: str) -> tuple:
    lines = job.matching(r"^watchdog: ")
    assert len(lines) == 1 and re.search(pattern, lines[0][1]), job.text()[-4000:]
    assert "Traceback" not in job.text(), job.text()[-4000:]  # no gloo traceback, from any rank
    return lines[0]


def test_killed_rank_ends_the_job_and_the_restart_is_bitwise(job, tmp_path):
    """SIGKILL rank 1 at a random step: rank 0 names it in one line and leaves; the supervisor (run.max_restarts)
    removes what is left, restarts from the newest verified checkpoint, and the run ends bitwise the uninterrupted
    one (per-step losses, final weights)."""
    ref_dir, ref = job("ref")
    assert ref.wait() == 0, ref.text()[-3000:]
    step = random.randint(1, STEPS - 1)
    once = tmp_path / "killed"
    run_dir, run = job("restart", "run.max_restarts=2", faults=[fault(step=step, once=str(once))])
    assert run.wait() == 0, f"killed at step {step}\n" + run.text()[-4000:]
    assert run.left == []
    died, _ = assert_one_line(run, rf"^watchdog: rank 1 \(pid \d+ on .+\) died at step {step}: ending the job$")
    # Killed at step 1 there is no checkpoint yet: the restart starts the run again in its own folder.
    restarted = run.matching(r"^supervisor: attempt 1 failed .* \(exit code 3, newest checkpoint (step \d+|none)\): "
                             r"restart 1 of 2")
    assert len(restarted) == 1, run.text()[-4000:]
    death = once.stat().st_mtime
    assert died - death < 1 + MARGIN and restarted[0][0] - death < PEER_TIMEOUT + MARGIN
    assert series(read_metrics(run_dir / "metrics.csv"), "train/loss") == \
        series(read_metrics(ref_dir / "metrics.csv"), "train/loss")
    a, b = read_checkpoint(ref_dir)["state_dict"], read_checkpoint(run_dir)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    resumed = run.matching(r"^resuming from")  # none when killed before the first checkpoint (step 1)
    after = f"; resume line {resumed[0][0] - restarted[0][0]:.1f} s after the restart" if resumed else ""
    print(f"\nkilled at step {step}: watchdog line {died - death:.1f} s after the kill, job exited and restart "
          f"launched {restarted[0][0] - death:.1f} s after it{after}")


def test_killed_rank_0_is_reported_by_its_peer(job):
    """SIGKILL rank 0, the process the user started and the holder of the rendezvous store: rank 1 (its orphan) sees
    the store gone for the peer timeout, names rank 0 in one line and leaves."""
    _, run = job("rank0", faults=[fault(step=5, rank=0)])
    assert run.proc.wait(300) == -9
    killed = time.time()
    while session_processes(run.proc.pid) and time.time() - killed < PEER_TIMEOUT + MARGIN:
        time.sleep(0.1)
    assert run.wait() == -9 and run.left == [], run.text()[-4000:]
    assert_one_line(run, r"^watchdog: rank 1 lost the rendezvous store at 127.0.0.1:\d+ for [\d.]+ s: rank 0 \(pid "
                         r"\d+ on .+\), which holds it, died at step 5: ending the job$")


def test_stopped_rank_ends_the_job_and_nothing_is_left(job):
    """SIGSTOP rank 1: it never exits by itself and gloo never errors; rank 0 names it after the peer timeout,
    kills it and leaves with exit code 3."""
    _, run = job("stopped", faults=[fault(step=3, action="STOP")])
    started = time.time()
    assert run.wait() == 3, run.text()[-4000:]
    assert run.left == []
    at, _ = assert_one_line(run, r"^watchdog: rank 1 \(pid \d+ on .+\) is stopped \(no heartbeat for [\d.]+ s, "
                                 r"strategy.peer_failure_timeout_seconds=5\) at step 3: ending the job$")
    assert run.ended - started < 120  # the whole run, 5 s of it waiting


def test_hung_rank_is_named_with_every_ranks_stack(job):
    """Rank 1's data read hangs after step 4 while rank 0 waits in step 5's first collective: rank 1 is named
    behind, each rank's stack is in the run folder (rank 1's shows the read), the job ends."""
    run_dir, run = job("hung", "strategy.hang_timeout_seconds=4", faults=[fault(step=4, action="SLOW_READ")])
    assert run.wait() == 3, run.text()[-4000:]
    assert run.left == []
    assert_one_line(run, r"^watchdog: rank 1 is behind at step 4 \(micro-batch count \d+, the others at \d+\); no "
                         r"rank progressed for \d+ s \(strategy.hang_timeout_seconds=4\); each rank's Python stack is "
                         r"in .*/hung/stacks/: ending the job$")
    stacks = {p.name: p.read_text() for p in (run_dir / "stacks").iterdir()}
    assert sorted(stacks) == ["rank0.txt", "rank1.txt"]
    assert 'failure_helpers.py", line' in stacks["rank1.txt"] and "in slow" in stacks["rank1.txt"]
    assert "in on_train_batch_start" in stacks["rank0.txt"]  # waiting in StepCheckpoint's step-5 all-reduce


def test_a_run_failing_at_the_same_step_stops_after_max_restarts(job):
    """Every attempt is killed at step 2 (one process: the whole run dies): two attempts, then one line."""
    _, run = job("again", "trainer.devices=1", "strategy=single", "trainer.micro_batch_size=8",
                 "run.max_restarts=1", faults=[fault(step=2, rank=0)])
    assert run.wait() == 137, run.text()[-4000:]
    assert run.left == []
    lines = run.matching(r"^supervisor: ")
    assert [line for _, line in lines][-1] == (
        "supervisor: the run failed 2 times, each time with exit code 137, newest checkpoint step 2: stopping after "
        "run.max_restarts=1 restarts (see the lines above for each failure)")


def test_sigterm_to_the_supervisor_checkpoints_and_is_not_restarted(job):
    """A scheduler's SIGTERM reaches the supervisor: it passes it to the run, which checkpoints at the next step
    boundary and exits 0 (what a requeue expects: the job is not failed); the supervisor does not restart it."""
    run_dir, run = job("preempted", "trainer.devices=1", "strategy=single", "trainer.micro_batch_size=8",
                       "run.max_restarts=2", "trainer.checkpoint_every_n_steps=0",
                       faults=[fault(step=3, rank=0, action="TERM_SUPERVISOR")])
    assert run.wait() == 0, run.text()[-4000:]
    assert run.left == [] and run.matching(r"^supervisor: ") == []
    assert len(run.matching(r"^preemption: checkpoint at step 4 written, stopping$")) == 1, run.text()[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step0000004.ckpt"


def test_a_rank_that_never_starts_ends_the_start_within_the_startup_timeout(tmp_path, tiny_data_dir):
    """Rank 0 of a 2-rank world (torchrun's variables) whose rank 1 never starts: the job ends
    after strategy.startup_timeout_seconds, not strategy.timeout_seconds (1800), with one line naming rank 1 and
    the key to raise; exit code 3, as for a peer the watchdog finds failed."""
    from tests.conftest import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "TORCHELASTIC_RUN_ID": "t",
           "RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"}
    env.pop("NODE_RANK", None)
    started = time.monotonic()
    out = _prewarmed().run([*train_args(tiny_data_dir, tmp_path, "alone"), "strategy=ddp", "trainer.devices=1",
                            "trainer.num_nodes=2", "trainer.micro_batch_size=4", "trainer.progress_bar=false",
                            "strategy.startup_timeout_seconds=3"], env, ROOT, 240)
    seconds = time.monotonic() - started
    lines = [line for line in out.stderr.splitlines() if line.startswith("lit-pretrain train: error:")]
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines == ["lit-pretrain train: error: start-up: rank 1 of 2 did not arrive within "
                     "strategy.startup_timeout_seconds=3 (seen by rank 0): check that every rank's process started "
                     "(its node, its log), or raise strategy.startup_timeout_seconds (now 3)"]
    # Process start, imports and the data check take ~10-20 s on this 2-core machine; 1800 s was the bound before.
    assert seconds < 120
    assert not (tmp_path / "alone").exists()  # the failed start left no folder blocking its retry
