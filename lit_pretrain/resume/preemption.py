"""Preemption: SIGTERM (a scheduler ending the job), SIGUSR1 (SLURM's warning before the time limit, with
`#SBATCH --signal=USR1@90`) and a first SIGINT (Ctrl-C) ask for a checkpoint at the next optimizer-step boundary,
then a clean exit (130 after Ctrl-C, with the command that resumes; 0 otherwise). A second SIGINT ends the process at
once, without the checkpoint: SIGINT's default action, which works even while a rank waits in a collective.

The handler only sets a flag: saving inside a signal handler could interrupt a collective or a half-done step. The
flag is agreed across ranks at each step boundary (a signal reaches one process, the checkpoint needs all). Our
handler replaces Lightning's for the training loop: Lightning's stops the run on SIGTERM without saving.
Under SLURM (SLURM_JOB_ID set) rank 0 requeues the job with `scontrol requeue` after the checkpoint is written, so
the next allocation resumes it with run.resume=auto.
"""

import os
import shlex
import signal
import subprocess
import sys
from typing import Dict, List, Optional

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C, as a shell reports a process ended by SIGINT (128 + 2): the run is resumable, not
failed, and the supervisor does not restart it."""


class Interrupted(KeyboardInterrupt):
    """Raised by train() after a Ctrl-C's checkpoint and summary: a KeyboardInterrupt, so callers that catch
    Exception (the ladder's rungs) stop as on any Ctrl-C; the CLI prints `message` (rank 0's; empty on the other
    ranks) and exits EXIT_INTERRUPTED."""

    def __init__(self, step: int, message: str = ""):
        super().__init__(message)
        self.step, self.message = step, message


class PreemptionFlag:
    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: Dict[int, object] = {}

    def install(self) -> None:
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            # The next Ctrl-C ends the process (SIGINT's default, kept to the end: no KeyboardInterrupt traceback).
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            self._previous.pop(signal.SIGINT, None)
            if self.signum is None and _is_rank_zero():
                # os.write: safe inside a signal handler, where print may interrupt a print of the progress bar.
                os.write(2, b"\nCtrl-C: a checkpoint at the next optimizer step, then stop (Ctrl-C again: stop now, "
                            b"without it)\n")
        if self.signum is None or signum != signal.SIGINT:
            self.signum = signum  # a scheduler's signal after Ctrl-C: it stops the run as well, exit code 0


def _is_rank_zero() -> bool:
    return all(os.environ.get(var, "0") == "0" for var in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def resume_command(argv: Optional[List[str]] = None, executable: Optional[str] = None, cwd: Optional[str] = None,
                   search_path: Optional[str] = None) -> str:
    """The command that started this process, as the user can paste it in the same shell, with run.resume=auto in
    place of any run.resume and run.overwrite given (overwrite would contradict the resume).

    The program is the one that runs now, never a bare name that may not be on PATH: the README's set-up installs
    into .venv without activating it, so `lit-pretrain` alone fails there while `.venv/bin/lit-pretrain` works. A
    program is written by its bare name only where `search_path` (default $PATH) finds that very file, else as a path
    from `cwd` (the shell's folder) when it lies below it, else absolute. Symbolic links are not followed: a
    virtualenv's python links to the system's, which lacks the project."""
    argv = list(sys.argv if argv is None else argv)
    if os.path.basename(argv[0]) == "lit-pretrain":
        program = _typed(argv[0], cwd, search_path)
    else:  # `python -m lit_pretrain.cli`: the interpreter that runs it, which has the project installed
        program = f"{_typed(executable or sys.executable, cwd, search_path)} -m lit_pretrain.cli"
    kept = [a for a in argv[1:] if not a.startswith(("run.resume=", "run.overwrite=", "+run.resume="))]
    return f"{program} {shlex.join([*kept, 'run.resume=auto'])}"


def _typed(program: str, cwd: Optional[str], search_path: Optional[str]) -> str:
    """How to type `program` (a path, absolute or from cwd) in a shell in `cwd` so that it runs this very file."""
    import shutil

    cwd = os.path.abspath(cwd or os.getcwd())
    where = os.path.normpath(os.path.join(cwd, program))
    name = os.path.basename(where)
    found = shutil.which(name, path=search_path)
    if found and os.path.normpath(os.path.join(cwd, found)) == where:
        return name
    relative = os.path.relpath(where, cwd)
    if relative.startswith(os.pardir):
        return shlex.quote(where)
    return shlex.quote(relative if os.sep in relative else os.path.join(os.curdir, relative))


def requeue_slurm_job() -> Optional[str]:
    """`scontrol requeue $SLURM_JOB_ID` when running under SLURM; the command run, or None."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    command = ["scontrol", "requeue", job]
    try:
        subprocess.run(command, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        print(f"preemption: `{' '.join(command)}` failed ({err}); resume by hand with run.resume=auto", flush=True)
    return " ".join(command)
