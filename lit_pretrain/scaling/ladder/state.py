"""What state a rung is in (new; partial: a checkpoint to resume; finished) and what counts as a complete rung of the
ladder, the one test that training (in one process or in workers, pool.py), fitting, predicting and reporting
share: a rung short of its planned steps (a run stopped by a signal writes a summary too, of the steps it completed)
is trained again from its checkpoint, and never fitted, predicted from or reported as measured."""

import json
from pathlib import Path
from typing import Optional

from lit_pretrain.errors import RunFolderError
from lit_pretrain.runs.state import is_finished

LAW_PARAMETERS = 5  # E, A, B, alpha, beta: a fit needs at least one complete fitted rung more


def read_summary(folder: Path) -> Optional[dict]:
    """A rung folder's summary.json, or None where there is none yet."""
    summary = folder / "summary.json"
    return json.loads(summary.read_text()) if summary.is_file() else None


def steps_completed(summary: Optional[dict]) -> int:
    """The optimizer steps a run's summary records as done (0 without a summary)."""
    return int((summary or {}).get("steps") or 0)


def rung_complete(summary: Optional[dict], rung: dict) -> bool:
    """Whether a rung's summary records the whole rung: status finished (run_state.py), its parameter count, every
    planned optimizer step, and a final validation loss."""
    return (is_finished(summary) and summary.get("params") == rung["params"]
            and steps_completed(summary) == rung["steps"] and summary.get("final_val_loss") is not None)


def rung_state(folder: Path, rung: dict) -> str:
    """finished (rung_complete: summary.json `finished`, of the planned steps and size), partial (a checkpoint to
    resume), or new. A summary that is not finished (running, preempted, failed: run_state.py) holds no size yet, or
    only a partial run's."""
    s = read_summary(folder)
    if s is not None:
        if is_finished(s) and s.get("params") != rung["params"] or steps_completed(s) > rung["steps"]:
            raise RunFolderError(f"{folder} holds a run of {s.get('params')} parameters and {s.get('steps')} steps, "
                                 f"not the rung's {rung['params']} and {rung['steps']}: move it away or set another "
                                 "root_dir in the grid file (a rung folder is never overwritten)")
        if rung_complete(s, rung):
            return "finished"
    return "partial" if checkpointed_step(folder) is not None else "new"


def checkpointed_step(folder: Path) -> Optional[int]:
    """The step of a run folder's newest checkpoint (where a resume continues), None without one."""
    from lit_pretrain.resume.store import step_files, step_of

    checkpoints = folder / "checkpoints"
    found = step_files(checkpoints) if checkpoints.is_dir() else []
    return step_of(found[-1]) if found else None


class LadderStopped(Exception):
    """A signal stopped the ladder at a rung's checkpoint (or between rungs); `signum` None where the run's own
    handler took it. The command that continues it is printed."""

    def __init__(self, signum: Optional[int]):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


def duration(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour, for the ladder's progress lines."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"
