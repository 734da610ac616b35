"""`python -m lit_pretrain.cli train ...` for the tests, forked from a process that imported Lightning once.

Why: a tiny training run costs ~7 CPU seconds, ~5 of them importing Lightning (it imports torchmetrics, which
imports transformers and scipy.signal, and torch._dynamo); the suite starts well over a hundred such runs. One
server per pytest process imports those third-party packages once, and forks for each run. The child then does what
`python -m lit_pretrain.cli ARGS` does (runpy, the same `__main__` and sys.argv, so that Lightning's launcher starts
the other ranks with `python -m lit_pretrain.cli ARGS`), in its own environment, working directory and session, with
stdout and stderr in files: a fresh interpreter's run in all but the import time. Nothing of lit_pretrain or tests is
imported before the fork, so each run imports our code anew, as a fresh process does.

The local ranks 1..n-1 that Lightning's launcher starts from such a run (`subprocess.Popen([sys.executable, "-m",
"lit_pretrain.cli", *argv], env=..., cwd=...)`) are forked too: before it imports anything, the run forks a
"zygote" (still the server's clean, single-threaded state, in the run's session, process group and files), and the
launcher's Popen asks it for each rank. The zygote forks the rank through a short-lived middle process, so the rank
is reparented to the run (a child subreaper: prctl PR_SET_CHILD_SUBREAPER) and is the run's child as a Popen's is:
Lightning's observer and the watchdog poll, signal, kill and wait for it through the same Popen methods. The rank
gets the launcher's argv, env and cwd exactly, the signal dispositions the run had before it imported anything, and
no file descriptors but 0-2. Anything else (torchrun's agent, the supervisor's child, a Popen with pipes or a new
session) is a real fork-exec. The server reports a run's end only once its zygote has exited (it exits when the run
closes its pipe, the run's death included), so nothing is left in the run's session after it.

Only the commands that train come here (tests/conftest.py, run_module: `train`, `ladder`, tests/helpers/mesh_resume.py):
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
import types
from pathlib import Path

# Third-party modules a training run imports (measured: the child then imports only our code).
WARM = ("lightning", "lightning.pytorch", "torch.distributed.fsdp", "torch.distributed.tensor",
        "torch.distributed.checkpoint", "torch.distributed.algorithms.join", "torch.distributed.optim", "tokenizers",
        "numpy", "yaml", "lightning.pytorch.strategies.launchers.subprocess_script")
LAUNCHER = "lightning.pytorch.strategies.launchers.subprocess_script"  # its `subprocess.Popen` starts local ranks
# What a Ctrl-C, a scheduler or a test may send the run's process group: the zygote ignores them (they are the
# ranks'), and each rank gets back the run's own dispositions.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)
PR_SET_CHILD_SUBREAPER = 36


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
        zygote_r, zygote_w = os.pipe()  # the run's zygote writes its pid there
        pid = os.fork()
        if pid == 0:
            proto.close()
            os.close(zygote_r)
            _child(req, zygote_w)  # raises SystemExit: the interpreter ends as a `python -m` run does
        os.close(zygote_w)
        proto.write(f"pid {pid}\n")
        proto.flush()
        _, status = os.waitpid(pid, 0)
        _gone(_read_line(zygote_r), time.monotonic() + 60)
        os.close(zygote_r)
        proto.write(f"rc {os.waitstatus_to_exitcode(status)}\n")
        proto.flush()


def _gone(pid_line: bytes, deadline: float) -> None:
    """Returns once the zygote has exited and was reaped (it exits when its run has; its parent, the run, being gone,
    init reaps it), so that nothing is left in the run's session when the run's exit code is reported."""
    while pid_line and os.path.exists(f"/proc/{int(pid_line)}") and time.monotonic() < deadline:
        time.sleep(0.005)


def _child(req: dict, zygote_pid_w: int) -> None:
    if req["new_session"]:
        os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = open(0, closefd=False)  # fd 0, /dev/null: a rank forked later closes every other descriptor
    _run(_start_zygote(zygote_pid_w) or req)


def _run(req: dict) -> None:
    """What `python -m ARGS` does, in req's working directory and environment."""
    import runpy

    os.chdir(req["cwd"])
    if sys.path[0] == "":
        sys.path[0] = req["cwd"]  # as `python -m` puts it: the working directory, absolute
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = [sys.argv[0], *req["args"][1:]]
    runpy.run_module(req["args"][0], run_name="__main__", alter_sys=True)
    raise SystemExit(0)


_ZYGOTE = {}  # in a run: the pipes to its zygote


def _start_zygote(pid_w: int):
    """Forks the zygote. Returns None in the run; in a rank the zygote forked, that rank's request."""
    req_r, req_w = os.pipe()
    ans_r, ans_w = os.pipe()
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    pid = os.fork()
    if pid == 0:
        os.close(req_w)
        os.close(ans_r)
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        try:
            os.write(pid_w, f"{os.getpid()}\n".encode())
            os.close(pid_w)
            rank = _zygote(req_r, ans_w)
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(1)
        if rank is None:
            os._exit(0)
        for s, handler in saved.items():
            signal.signal(s, handler)
        return rank
    os.close(req_r)
    os.close(ans_w)
    os.close(pid_w)
    _ZYGOTE.update(req=req_w, ans=ans_r, lock=threading.Lock())
    launcher = sys.modules.get(LAUNCHER)
    if launcher is not None:
        shim = types.ModuleType("subprocess")
        shim.__dict__.update(subprocess.__dict__)
        shim.Popen = RankPopen
        launcher.subprocess = shim
    return None


def _read_line(fd: int) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            return b""
        line += chunk
    return line


def _zygote(req_r: int, ans_w: int):
    """The zygote's loop: a rank per request line; returns (in the rank) its request, or None at EOF."""
    while True:
        line = _read_line(req_r)
        if not line:
            return None
        req = json.loads(line)
        pid_r, pid_w = os.pipe()
        middle = os.fork()
        if middle == 0:
            middle = os.getpid()
            rank = os.fork()
            if rank == 0:
                for fd in (pid_r, pid_w, req_r, ans_w):
                    os.close(fd)
                while os.getppid() == middle:  # until reparented: from its first line on, its parent is the run
                    time.sleep(0.001)
                return req
            os.write(pid_w, f"{rank}\n".encode())
            os._exit(0)  # the rank is reparented to the run (its subreaper) now, before the run hears its pid
        os.close(pid_w)
        rank = _read_line(pid_r)
        os.close(pid_r)
        os.waitpid(middle, 0)
        os.write(ans_w, rank or b"0\n")


class RankPopen(subprocess.Popen):
    """subprocess.Popen whose `python -m ...` children (no pipes, no new session) come from the run's zygote."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):
        plain = (isinstance(args, list) and len(args) > 2 and args[:2] == [sys.executable, "-m"]
                 and executable is None and preexec_fn is None and close_fds and not pass_fds and not shell
                 and env is not None and (p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite) == (-1,) * 6
                 and restore_signals and gid is None and gids is None and uid is None and umask < 0
                 and not start_new_session and process_group in (None, -1) and _ZYGOTE)
        if not plain:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, restore_signals, gid, gids, uid, umask, start_new_session,
                                          process_group)
        req = dict(args=[str(a) for a in args[2:]], env={str(k): str(v) for k, v in env.items()},
                   cwd=os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd())
        with _ZYGOTE["lock"]:
            if not _ZYGOTE.get("subreaper"):  # only a run that starts ranks adopts orphans (a supervisor never does)
                import ctypes

                if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
                    raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
                _ZYGOTE["subreaper"] = True
            os.write(_ZYGOTE["req"], (json.dumps(req) + "\n").encode())
            pid = int(_read_line(_ZYGOTE["ans"]) or 0)
        if pid <= 0:
            raise OSError("the prewarmed zygote did not start the rank")
        self.pid = pid
        self._child_created = True


class Server:
    def __init__(self, cwd: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", "from tests.helpers.prewarmed import serve; serve()"],
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


    def start(self, args: list, env: dict, cwd: Path, stdout: Path, stderr: Path,
              start_new_session: bool = False) -> Started:
        """Starts `python -m ARGS`, its output into the files (or FIFOs) named; wait for it with the handle before the
        next run (one run at a time)."""
        self.lock.acquire()
        try:
            req = dict(args=list(args), env=dict(env), cwd=str(cwd), stdout=str(stdout), stderr=str(stderr),
                       new_session=start_new_session)
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            pid = int(self._line(time.monotonic() + 60).split()[1])
        except BaseException:
            self.lock.release()
            raise
        return Started(self, list(args), pid, start_new_session)

    def run(self, args: list, env: dict, cwd: Path, timeout: float,
            start_new_session: bool = False) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            run = self.start(args, env, cwd, out, err, start_new_session)
            try:
                rc = run.wait(timeout)
            except subprocess.TimeoutExpired:  # as subprocess.run does on a timeout: kill (its session too), then raise
                run.kill()
                run.wait(60)
                raise subprocess.TimeoutExpired(args, timeout, out.read_text(), err.read_text()) from None
            return subprocess.CompletedProcess([sys.executable, "-m", *args], rc, out.read_text(), err.read_text())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Started:
    """A run the server started: its pid (its session's id under start_new_session), and as Popen's, wait() for its
    exit code (after its zygote has exited) and kill()."""

    def __init__(self, server: Server, args: list, pid: int, new_session: bool):
        self.server, self.args, self.pid, self.new_session = server, args, pid, new_session
        self.returncode = None

    def wait(self, timeout: float = None) -> int:
        if self.returncode is None:
            line = self.server._line(time.monotonic() + (1e9 if timeout is None else timeout))
            if not line:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line.split()[1])
            self.server.lock.release()
        return self.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL) if self.new_session else os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
