"""Preemption: SIGTERM (a scheduler ending the job) and SIGUSR1 (SLURM's warning before the time limit, with
`#SBATCH --signal=USR1@90`) ask for a checkpoint at the next optimizer-step boundary, then a clean exit.

The handler only sets a flag: saving inside a signal handler could interrupt a collective or a half-done step. The
flag is agreed across ranks at each step boundary (a signal reaches one process, the checkpoint needs all). Our
handler replaces Lightning's for the training loop: Lightning's stops the run on SIGTERM without saving.
Under SLURM (SLURM_JOB_ID set) rank 0 requeues the job with `scontrol requeue` after the checkpoint is written, so
the next allocation resumes it with run.resume=auto.
"""

import os
import signal
import subprocess
from typing import Dict, Optional

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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
        self.signum = signum


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
