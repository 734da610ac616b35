"""A run's state, as summary.json records it: running, preempted, stopped, diverged, failed or finished (torch-free:
`runs` reads it).

train() writes summary.json three times over a run's life: a start record when the run folder is held (`running`,
with the process that holds it), then at the end either the full summary or, when an exception ended it, the start
record marked `failed` with the error. The full summary's status says what ended the run:
- `finished`: every planned step trained, or a callback declared the run done (resume/stop.py, `done=True`:
  its `stop_reason` says why, and `steps` may be short of `max_steps`);
- `preempted`: a signal stopped it at a checkpoint, which `run.resume=auto` continues;
- `stopped`: a callback ended it early on purpose (resume/stop.py, or a bare `trainer.should_stop`), its reason in
  `stop_reason`; the checkpoint of its last step is written, and `run.resume=auto` continues from it;
- `diverged`: a stability callback stopped it (nan_guard, or loss_spike on a divergence): `stop_reason` says why and
  names the checkpoint `run.resume=auto` continues from, the last healthy one (`resume_step`; none when no
  checkpoint holds healthy weights): the weights at the stop are never `latest`.
A process killed outright (SIGKILL, the OOM killer, a lost node) writes nothing, so its record still says
`running`: readers tell that apart by the run folder's lock (runs.in_use: the flock a live start holds on the
folder's marker, which the kernel drops with the process), not by the record, and call it `killed`.

Fields every reader may rely on (summary.json):
- `status`: one of STATUSES.
- `steps`: optimizer steps completed (the start record: those the run starts from; a preempted run: the step of the
  checkpoint it resumes from).
- `max_steps`: the steps planned (trainer.max_steps). A run is a complete result when, and only when, status is
  "finished".
- `resume_step`: the step `run.resume=auto` would continue from (the newest checkpoint named by
  checkpoints/latest), or null when there is none (and for a run finished at max_steps).
- `error` (failed only): one line saying what ended the run; `stop_reason` (stopped, diverged, and finished by a
  callback): what stopped it.
A summary.json written before these fields existed has no `status`: it was written at the end of training, and
reads as finished.
"""

import os
import re
import socket
import time
from pathlib import Path
from typing import Dict, Optional

RUNNING, PREEMPTED, FAILED, FINISHED = "running", "preempted", "failed", "finished"
STOPPED, DIVERGED = "stopped", "diverged"
STATUSES = (RUNNING, PREEMPTED, STOPPED, DIVERGED, FAILED, FINISHED)
ENDED = (PREEMPTED, STOPPED, DIVERGED, FINISHED)
"""The statuses of a summary written at the run's end (its numbers are the run's own, not a start record's)."""
KILLED = "killed"
"""Not written by anyone: what a `running` record reads as once no live process holds the run folder."""

_LATEST_STEP = re.compile(r"^step(\d{7,})(\.ckpt)?$")


def status_of(summary: Optional[Dict]) -> Optional[str]:
    """The summary's status; "finished" for a summary from before the field existed; None without a summary."""
    if summary is None:
        return None
    return summary.get("status", FINISHED)


def is_finished(summary: Optional[Dict]) -> bool:
    """Whether the summary is a finished run's (every planned step trained, or a callback declared it done): the only
    kind a fit, a sweep or an ablation may use as a result."""
    return status_of(summary) == FINISHED


def resume_step(run_dir: Path) -> Optional[int]:
    """The step of the checkpoint checkpoints/latest names (run.resume=auto starts there), None when there is none.
    Only the name is read (resume/store.py verifies the file when a run resumes from it)."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    try:
        m = _LATEST_STEP.match(pointer.read_text().strip())
    except OSError:
        return None
    return int(m.group(1)) if m and (pointer.parent / pointer.read_text().strip()).exists() else None


def start_record(run: str, steps: int, max_steps: int) -> Dict:
    """summary.json while the run trains: who holds it (host, pid: for a person reading it; `runs` asks the lock)."""
    return {"run": run, "status": RUNNING, "steps": steps, "max_steps": max_steps, "resume_step": None,
            "host": socket.gethostname(), "pid": os.getpid(), "started_unix": round(time.time(), 3)}


def end_status(steps: int, max_steps: int, preempted: bool, stop_outcome: Optional[str] = None) -> str:
    """preempted when a signal stopped the run at a checkpoint; else what a callback's stop says it is (finished,
    stopped or diverged: resume/stop.py); else finished when every planned step trained, and failed when it ended
    short with no stop asked for (nothing in the loop ends it so: a bug)."""
    if preempted:
        return PREEMPTED
    if stop_outcome is not None:
        return stop_outcome
    return FINISHED if steps >= max_steps else FAILED


def failed_record(start: Optional[Dict], steps: Optional[int], error: BaseException, run_dir: Path) -> Dict:
    """The start record marked failed: the steps completed when it failed (None when unknown), the error in one line
    and the step a resume would continue from."""
    record = dict(start or {})
    message = str(error).strip().splitlines()
    record.update(status=FAILED, error=f"{type(error).__name__}: {message[0]}" if message else type(error).__name__,
                  resume_step=resume_step(run_dir), ended_unix=round(time.time(), 3))
    if steps is not None:
        record["steps"] = steps
    return record


def describe(summary: Optional[Dict], held: Optional[bool], run_dir: Path) -> Optional[str]:
    """The status `runs` shows: finished, running, killed (a `running` record no live process holds), preempted,
    stopped, diverged or failed, with the step a resume continues from where there is one. None without a summary
    (an older run folder: run_table's heuristics decide). `held`: whether a live start holds the folder (None:
    unknown)."""
    state = status_of(summary)
    if state is None or state == FINISHED:
        return state
    if state == RUNNING:
        if held is not False:
            return RUNNING
        state = KILLED
    step = resume_step(run_dir)
    return state if step is None else f"{state}, resumes from step {step}"
