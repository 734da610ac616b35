"""What counts as a complete rung of the ladder, the one test that training, fitting, predicting and reporting share:
a rung short of its planned steps (a run stopped by a signal writes a summary too, of the steps it completed) is
trained again from its checkpoint, and never fitted, predicted from or reported as measured."""

import json
from pathlib import Path
from typing import Optional

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
