"""run.max_restarts: `lit-pretrain train` restarts a failed run from its newest verified checkpoint by itself.

The process the user started becomes a supervisor (it imports neither torch nor Lightning): it runs the same command
as a child in a session of its own (the child is rank 0; Lightning's launcher starts the other local ranks in that
session), waits for it, SIGKILLs whatever is left of the session (a rank that never exited), and runs the command
again with run.resume=auto, at most run.max_restarts times. The resume machinery (lit_pretrain/resume/) makes the
restarted run bitwise the uninterrupted one. As OLMo-core's launch_with_retries.sh and torchrun's --max-restarts,
on one node: under torchrun (several nodes) its agents restart the workers (--max-restarts), under SLURM the requeue
does (`lit-pretrain launch slurm`), so the key is refused there.

What is not restarted: a success (exit 0, a preemption's checkpoint-and-stop included), a refused start (exit 2: the
config or the data is wrong, a restart would fail the same way), a Ctrl-C (exit 130: the user stopped it). SIGTERM,
SIGUSR1 and SIGINT to the supervisor are passed to every process of the run (the scheduler's preemption signal and
a terminal's Ctrl-C reach the ranks, which checkpoint).
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

from lit_pretrain.resume.preemption import EXIT_INTERRUPTED

ATTEMPT_ENV = "LIT_PRETRAIN_ATTEMPT"
"""Set in the supervised run (its attempt, 0 first): it trains, it does not supervise again."""
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def supervised() -> bool:
    return ATTEMPT_ENV in os.environ


def latest_step(run_dir: Path) -> Optional[int]:
    """The step of the checkpoint `latest` names (written last, after the checkpoint verified: resume/store.py)."""
    try:
        match = re.match(r"^step(\d+)", (run_dir / "checkpoints" / "latest").read_text().strip())
    except OSError:
        return None
    return int(match.group(1)) if match else None


def restart_args(argv: List[str], run_dir: Path, fresh_allowed: bool, resume: Optional[str]) -> List[str]:
    """The command of a restart: resume from the newest verified checkpoint of the run; with none yet, the first
    command again (a run.resume=PATH resumes from that file again), and a fresh start again in the folder the first
    attempt made (never in one that was there before the supervisor started: resume=auto keeps its files aside)."""
    if latest_step(run_dir) is not None:
        return [*argv, "run.resume=auto", "run.overwrite=false"]
    if resume not in (None, "auto"):
        return [*argv, "run.overwrite=false"]
    if fresh_allowed:
        return [*argv, "run.resume=null", "run.overwrite=true"]
    return [*argv, "run.resume=auto"]  # a folder from before, without a checkpoint: its files go to attempts/<n>/


def kill_session(pid: int) -> None:
    """SIGKILL every process left in the child's session (its process group: the child is its leader)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def supervise(argv: List[str], max_restarts: int, run_dir: Path, overwrite: bool,
              resume: Optional[str] = None) -> int:
    """Run `python -m lit_pretrain.cli ARGV` until it succeeds, is refused, or has failed max_restarts + 1 times;
    its exit code (a signal's as 128 + the signal's number, as a shell reports it)."""
    fresh_allowed = overwrite or not run_dir.exists()
    child: List[subprocess.Popen] = []

    def forward(signum, frame):
        if child and child[0].poll() is None:
            os.killpg(child[0].pid, signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    failures: List[str] = []
    try:
        for attempt in range(max_restarts + 1):
            args = argv if attempt == 0 else restart_args(argv, run_dir, fresh_allowed, resume)
            started = time.monotonic()
            child[:] = [subprocess.Popen([sys.executable, "-m", "lit_pretrain.cli", *args],
                                         env={**os.environ, ATTEMPT_ENV: str(attempt)}, start_new_session=True)]
            code = child[0].wait()
            kill_session(child[0].pid)
            if code in (0, 2):
                return code
            if code in (EXIT_INTERRUPTED, -signal.SIGINT):  # Ctrl-C: checkpointed (or a second Ctrl-C): no restart
                return EXIT_INTERRUPTED
            code = 128 - code if code < 0 else code
            step = latest_step(run_dir)
            failures.append(f"exit code {code}, newest checkpoint " + (f"step {step}" if step is not None else "none"))
            if attempt < max_restarts:
                print(f"supervisor: attempt {attempt + 1} failed after {time.monotonic() - started:.1f} s "
                      f"({failures[-1]}): restart {attempt + 1} of {max_restarts} (run.max_restarts), from "
                      f"{'step ' + str(step) if step is not None else 'the start'}", file=sys.stderr, flush=True)
        same = len(set(failures)) == 1
        print(f"supervisor: the run failed {len(failures)} times, "
              f"{'each time with ' + failures[0] if same else 'last with ' + failures[-1]}: stopping after "
              f"run.max_restarts={max_restarts} restarts (see the lines above for each failure)",
              file=sys.stderr, flush=True)
        return code
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
