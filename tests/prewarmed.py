"""`python -m lit_pretrain.cli train ...` for the tests, forked from a process that imported Lightning once.

Why: a tiny training run costs ~7 CPU seconds, ~5 of them importing Lightning (it imports torchmetrics, which
imports transformers and scipy.signal, and torch._dynamo); the suite starts well over a hundred such runs. One
server per pytest process imports those third-party packages once, and forks for each run. The child then does what
`python -m lit_pretrain.cli ARGS` does (runpy, the same `__main__` and sys.argv, so that Lightning's launcher starts
the other ranks with `python -m lit_pretrain.cli ARGS`), in its own environment, working directory and session, with
stdout and stderr in files: a fresh interpreter's run in all but the import time. Nothing of lit_pretrain or tests is
imported before the fork, so each run imports our code anew, as a fresh process does.

Only the commands that train come here (tests/conftest.py, run_module: `train`, `ladder`, tests/mesh_resume.py):
the other commands are cheap, and some tests measure what a command imports.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Third-party modules a training run imports (measured: the child then imports only our code).
WARM = ("lightning", "lightning.pytorch", "torch.distributed.fsdp", "torch.distributed.tensor",
        "torch.distributed.checkpoint", "torch.distributed.algorithms.join", "torch.distributed.optim", "tokenizers",
        "numpy", "yaml")


def serve() -> None:
    """The server: one JSON request a line on stdin; answers `pid N` when the child started and `rc N` when it
    ended, one run at a time."""
    import importlib

    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever an import prints goes to stderr, never into the answers
    for name in WARM:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    assert threading.active_count() == 1, "forking a process with threads"
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            proto.close()
            _child(req)  # raises SystemExit: the interpreter ends as a `python -m` run does
        proto.write(f"pid {pid}\n")
        proto.flush()
        _, status = os.waitpid(pid, 0)
        proto.write(f"rc {os.waitstatus_to_exitcode(status)}\n")
        proto.flush()


def _child(req: dict) -> None:
    import runpy

    if req["new_session"]:
        os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(os.devnull)
    os.chdir(req["cwd"])
    if sys.path[0] == "":
        sys.path[0] = req["cwd"]  # as `python -m` puts it: the working directory, absolute
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = [sys.argv[0], *req["args"][1:]]
    runpy.run_module(req["args"][0], run_name="__main__", alter_sys=True)
    raise SystemExit(0)


class Server:
    def __init__(self, cwd: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", "from tests.prewarmed import serve; serve()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=cwd, text=True)
        self.lock = threading.Lock()

    def _line(self, deadline: float) -> str:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                return ""
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the prewarmed server ended")
            return line.strip()


    def run(self, args: list, env: dict, cwd: Path, timeout: float,
            start_new_session: bool = False) -> subprocess.CompletedProcess:
        with self.lock, tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            req = dict(args=list(args), env=dict(env), cwd=str(cwd), stdout=str(out), stderr=str(err),
                       new_session=start_new_session)
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            deadline = time.monotonic() + timeout
            pid = int(self._line(time.monotonic() + 60).split()[1])
            line = self._line(deadline)
            if not line:  # as subprocess.run does on a timeout: kill (its session too), then raise
                try:
                    os.killpg(pid, signal.SIGKILL) if start_new_session else os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._line(time.monotonic() + 60)
                raise subprocess.TimeoutExpired(args, timeout, out.read_text(), err.read_text())
            rc = int(line.split()[1])
            return subprocess.CompletedProcess([sys.executable, "-m", *args], rc, out.read_text(), err.read_text())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
