"""Lightning's launcher of the local ranks, with its child observer replaced by one that lets the watchdog speak.

Without torchrun or srun, rank 0 re-runs the command for local ranks 1..n-1 (Lightning's _SubprocessScriptLauncher)
and starts a thread that SIGKILLs every rank, itself included, within 5 s of a child's nonzero exit: rank 0 then dies
before its watchdog (launch/watchdog.py) has said which rank failed at which step. WatchedLauncher does the same
cleanup, but only `grace_seconds` after the first failed child (the watchdog's peer timeout plus a margin), so
normally the watchdog has ended the job with its one line by then; the ranks it starts are kept in CHILDREN so the
watchdog's exit removes those still running (a stopped rank never exits by itself).
"""

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, List, Optional

from lit_pretrain.internals import LocalLauncherSwap, SubprocessScriptLauncher, launch_local_ranks
from lit_pretrain.resume.preemption import EXIT_INTERRUPTED

CHILDREN: List[subprocess.Popen] = []
"""The local ranks this process started (rank 0 under Lightning's launcher; empty elsewhere)."""


def kill_children(wait_seconds: float = 0.0) -> None:
    """SIGKILL the local ranks this process started that are still running after `wait_seconds`."""
    deadline = time.monotonic() + wait_seconds
    while any(p.poll() is None for p in CHILDREN) and time.monotonic() < deadline:
        time.sleep(0.05)
    for proc in CHILDREN:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class ChildObserver(threading.Thread):
    """Polls the children each second; `grace_seconds` after the first nonzero exit, kills them and this process."""

    def __init__(self, children: List[subprocess.Popen], grace_seconds: float):
        super().__init__(daemon=True, name="lit-pretrain-child-observer")
        self.children, self.grace = children, grace_seconds

    def run(self) -> None:
        failed_at: Optional[float] = None
        while True:
            time.sleep(1.0)
            codes = [p.poll() for p in self.children]
            if all(code in (0, EXIT_INTERRUPTED) for code in codes):
                return
            # 130: a rank that stopped after a Ctrl-C's checkpoint, as rank 0 is about to (not a failure).
            if failed_at is None and any(code not in (None, 0, EXIT_INTERRUPTED) for code in codes):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > self.grace:
                rank, code = next((i + 1, c) for i, c in enumerate(codes) if c not in (None, 0, EXIT_INTERRUPTED))
                print(f"launcher: local rank {rank} exited with code {code} and the job did not end within "
                      f"{self.grace:.0f} s: killing the other ranks", file=sys.stderr, flush=True)
                kill_children()
                os.kill(os.getpid(), signal.SIGKILL)


class WatchedLauncher(SubprocessScriptLauncher):
    def __init__(self, *args, grace_seconds: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.grace_seconds = grace_seconds

    def launch(self, function: Callable, *args: Any, trainer=None, **kwargs: Any) -> Any:
        return launch_local_ranks(self, function, args, kwargs, self._observe)

    def _observe(self, procs: List[subprocess.Popen]) -> None:
        CHILDREN[:] = procs
        ChildObserver(procs, self.grace_seconds).start()


class WatchedLaunch(LocalLauncherSwap):
    """Strategy mixin: Lightning's local launcher becomes WatchedLauncher (build_strategy sets the grace)."""

    launch_grace_seconds: float = 5.0  # Lightning's own observer's period when no watchdog runs

    def local_launcher(self) -> WatchedLauncher:
        return WatchedLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                               grace_seconds=self.launch_grace_seconds)
