"""Worker processes for the data stages: each is a fresh interpreter that imports this module and one function of
lit_pretrain, reads tasks on its stdin, answers on its stdout, and whose stderr the parent keeps.

Why not multiprocessing.Pool: a spawned Pool worker re-imports the caller's main module, so a script
piped to Python (`python - < script.py`), or any main module a child cannot import, kills every worker as it
starts, and the Pool starts new ones for ever without a word; a worker killed for memory leaves its task
unanswered for ever. A worker here never imports the caller's main module (it gets the caller's sys.path, as a
spawned process does). Its death is seen at once (its stdout closes) with its exit code and the last line it
wrote to stderr. A worker that dies before its first task, a task that raises, a chunk on which a second worker
dies, or no answer for `timeout_s` stops the stage with one WorkerError line; a worker that dies during a chunk
once has that chunk retried once on a new worker. One pool per stage: no process is started per chunk.

Tasks and results are pickled, as multiprocessing does, and only between this process and the children it started.
"""

import importlib
import json
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import traceback
from collections import deque
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Tuple

from lit_pretrain.errors import WorkerError

_HEADER = struct.Struct("<Q")  # byte length of the pickled frame that follows
_STDERR_LINES = 20
_SYS_PATH_ENV = "LIT_PRETRAIN_WORKER_SYS_PATH"
# The child's sys.path becomes the parent's before anything of lit_pretrain is imported, so it runs the same copy.
_BOOT = (f"import json, os, sys; sys.path[:] = json.loads(os.environ[{_SYS_PATH_ENV!r}]); "
         "from lit_pretrain.data.preparation.workers import serve; serve(sys.argv[1])")
# Test hook (tests/data/test_dedup_workers.py): "import" raises while a worker starts; "kill" makes every worker SIGKILL
# itself on its first task; "kill-once:PATH" does so only in the one worker that creates PATH first.
FAULT_ENV = "LIT_PRETRAIN_WORKER_FAULT"


def _note_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _recv(stream):
    """The next frame, or None at the end of the stream (the other side closed it or died)."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    data = stream.read(size)
    return pickle.loads(data) if len(data) == size else None


class _Worker:
    def __init__(self, target: str, events: queue.Queue):
        env = {**os.environ, _SYS_PATH_ENV: json.dumps(sys.path)}
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, target], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.started = False  # set by its "ready" frame: its imports succeeded
        self.load = 0  # chunks sent and not answered
        self._frames: queue.SimpleQueue = queue.SimpleQueue()
        self._tail: deque = deque(maxlen=_STDERR_LINES)
        # A writer thread per worker: a 1 MB task does not fit a pipe's buffer, and blocking on it would stop this
        # process from computing its own chunks meanwhile.
        threading.Thread(target=self._write, daemon=True).start()
        threading.Thread(target=self._read, args=(events,), daemon=True).start()
        self._stderr = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr.start()

    def send(self, obj) -> None:
        self._frames.put(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def _write(self) -> None:
        try:
            while (data := self._frames.get()) is not None:
                self.proc.stdin.write(_HEADER.pack(len(data)) + data)
                self.proc.stdin.flush()
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass  # the worker is gone: its reader reports the exit

    def _read(self, events: queue.Queue) -> None:
        try:
            while (frame := _recv(self.proc.stdout)) is not None:
                events.put((self, frame))
        finally:
            events.put((self, None))

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self._tail.append(line.decode("utf-8", "replace").rstrip())

    def exit_story(self) -> Tuple[str, str]:
        """(how it ended, its last error line) once its stdout has closed."""
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # closed its stdout but lives on: stop it
            self.proc.kill()
            rc = self.proc.wait()
        self._stderr.join(timeout=2)
        lines = [line for line in self._tail if line.strip()]
        if rc < 0:
            try:
                how = f"was killed by {signal.Signals(-rc).name}"
            except ValueError:
                how = f"was killed by signal {-rc}"
            last = lines[-1] if lines else "no error line, so killed from outside (out of memory?)"
        else:
            how = f"exited with code {rc}"
            last = lines[-1] if lines else "no error line"
        return how, last

    def stop(self, kill: bool) -> None:
        self._frames.put(None)  # closes its stdin: a worker ends at the end of its input
        if kill:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class WorkerPool:
    """`processes` workers that run `target` ("lit_pretrain.module:function") on submitted tasks.

    `what` names the workers in messages ("MinHash signature"); `fix` ends every error line; `note` takes the one
    line said when a chunk is retried. Use as a context manager: leaving it stops the workers (kills them on an
    error)."""

    def __init__(self, target: str, processes: int, what: str, fix: str,
                 note: Callable[[str], None] = _note_to_stderr, retries: int = 1, timeout_s: float = 600.0):
        self._target, self._what, self._fix, self._note = target, what, fix, note
        self._retries, self._timeout_s = retries, timeout_s
        self._events: queue.Queue = queue.Queue()
        self._held: Dict[Hashable, Tuple[Any, str, _Worker]] = {}  # key -> (task, label, worker), sent order
        self._deaths: Dict[Hashable, int] = {}  # key -> workers that died while computing it
        self._replacements = processes  # idle workers that may die and be replaced, in all
        self._workers: List[_Worker] = []
        try:
            for _ in range(processes):
                self._workers.append(self._start())
        except BaseException:
            self.close(kill=True)
            raise

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(kill=exc_type is not None)

    @property
    def pending(self) -> int:
        """Tasks submitted and not yet answered."""
        return len(self._held)

    def submit(self, key: Hashable, task: Any, label: str) -> None:
        """Send `task` to the least loaded worker; `label` names it in messages (a chunk's first document id)."""
        self._send(min(self._workers, key=lambda w: w.load), key, task, label)

    def ready(self) -> Iterator[Tuple[Hashable, Any]]:
        """(key, result) of the tasks answered so far, without waiting."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            done = self._handle(*event)
            if done is not None:
                yield done

    def drain(self) -> Iterator[Tuple[Hashable, Any]]:
        """(key, result) of every task still pending, waiting at most timeout_s for each next answer."""
        while self._held:
            try:
                event = self._events.get(timeout=self._timeout_s)
            except queue.Empty:
                task, label, worker = next(iter(self._held.values()))
                raise WorkerError(f"{self._what} worker (pid {worker.proc.pid}) gave no result for the chunk from "
                                  f"document {label} in {self._timeout_s:.0f} s: {self._fix}") from None
            done = self._handle(*event)
            if done is not None:
                yield done

    def close(self, kill: bool = False) -> None:
        for worker in self._workers:
            worker.stop(kill)
        self._workers = []

    def _start(self) -> _Worker:
        try:
            return _Worker(self._target, self._events)
        except OSError as err:
            raise WorkerError(f"{self._what} worker could not be started with {sys.executable!r}: {err}: "
                              f"{self._fix}") from None

    def _send(self, worker: _Worker, key: Hashable, task: Any, label: str) -> None:
        self._held[key] = (task, label, worker)
        worker.load += 1
        worker.send(("task", key, task))

    def _handle(self, worker: _Worker, frame) -> Optional[Tuple[Hashable, Any]]:
        if frame is None:
            self._died(worker)
        elif frame[0] == "ready":
            worker.started = True
        elif frame[0] == "result":
            _, key, value = frame
            del self._held[key]
            worker.load -= 1
            return key, value
        else:  # ("error", key, line): a task that raises would raise again on any worker
            _, key, line = frame
            raise WorkerError(f"{self._what} worker (pid {worker.proc.pid}) failed on the chunk from document "
                              f"{self._held[key][1]}: {line}: {self._fix}")
        return None

    def _died(self, worker: _Worker) -> None:
        how, last = worker.exit_story()
        self._workers.remove(worker)
        held = [(key, task, label) for key, (task, label, w) in self._held.items() if w is worker]
        pid = worker.proc.pid
        if not worker.started:
            where = f" (its first chunk starts at document {held[0][2]})" if held else ""
            raise WorkerError(f"{self._what} worker (pid {pid}) {how} while starting{where}: {last}: {self._fix}")
        if held:
            # Only the chunk it was computing (its oldest) counts the death; the others merely waited behind it.
            key, _, label = held[0]
            self._deaths[key] = self._deaths.get(key, 0) + 1
            if self._deaths[key] > self._retries:
                raise WorkerError(f"{self._what} worker (pid {pid}) {how} during the chunk from document {label}, "
                                  f"which had already been retried after another worker died on it: {last}: "
                                  f"{self._fix}")
            self._note(f"{self._what} worker (pid {pid}) {how} during the chunk from document {label}: {last}; "
                       "retrying that chunk once on a new worker")
        else:
            self._replacements -= 1
            if self._replacements < 0:
                raise WorkerError(f"{self._what} workers keep dying between chunks; the last (pid {pid}) {how}: "
                                  f"{last}: {self._fix}")
        new = self._start()
        self._workers.append(new)
        for key, task, label in held:
            del self._held[key]
            self._send(new, key, task, label)


def serve(target: str) -> None:
    """A worker's loop: import target's function, say "ready", then answer each task until the input ends."""
    frames_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a print in a task goes to stderr, never into the frames
    fault = os.environ.get(FAULT_ENV, "")
    if fault == "import":
        raise RuntimeError(f"{FAULT_ENV}=import: a test fault raised while the worker starts")
    module, _, name = target.partition(":")
    if not module.startswith("lit_pretrain."):
        raise ValueError(f"worker target {target!r} is not a function of lit_pretrain")
    function = getattr(importlib.import_module(module), name)
    _send(frames_out, ("ready",))
    while (frame := _recv(sys.stdin.buffer)) is not None:
        _, key, task = frame
        if fault == "kill" or (fault.startswith("kill-once:") and _first_to_create(fault.split(":", 1)[1])):
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            value = function(task)
        except Exception as err:
            _send(frames_out, ("error", key, traceback.format_exception_only(err)[-1].strip()))
            continue
        _send(frames_out, ("result", key, value))


def _first_to_create(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
