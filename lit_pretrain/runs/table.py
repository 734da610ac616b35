"""Read run folders without torch or Lightning: what `lit-pretrain runs` tabulates and `compare` plots.

A run folder (lit_pretrain/runs/folder.py) holds config.yaml when training starts, metrics.csv as Lightning's CSVLogger
flushes it, checkpoints/ with a `latest` pointer after each checkpoint, and summary.json from the start, whose
`status` says what the run is (lit_pretrain/runs/state.py). Every `step` is optimizer steps completed.
"""

import csv
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from lit_pretrain.errors import DataError
from lit_pretrain.runs import state as run_state
from lit_pretrain.runs.folder import in_use, read_metrics

# A run folder from before summary.json's start record (no summary) whose folder changed this recently is taken to
# be training still. CSVLogger flushes
# metrics every 100 logged rows and at each checkpoint, so a slow run can look idle for a while: runs --active-minutes.
ACTIVE_MINUTES = 15.0

COLUMNS = ("name", "steps", "tokens", "train loss", "val loss", "bits/byte", "tokens/s", "status")


@dataclass
class RunRecord:
    path: Path
    config: Dict = field(default_factory=dict)
    summary: Optional[Dict] = None
    rows: List[Dict[str, float]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("config.yaml", "metrics.csv", "summary.json"))


def read_run(path: Path) -> RunRecord:
    """The run folder's config, summary (None until training ended) and metrics rows; a missing file reads empty."""
    path = Path(path)
    if not is_run_folder(path):
        raise DataError(f"{path} is not a run folder (it holds no config.yaml, metrics.csv or summary.json): give a "
                        "folder that `lit-pretrain train` made, e.g. runs/<run.name>")
    config, summary = {}, None
    if (path / "config.yaml").is_file():
        try:
            config = yaml.safe_load((path / "config.yaml").read_text()) or {}
        except yaml.YAMLError as err:
            raise DataError(f"{path / 'config.yaml'} is not valid YAML: {err}") from None
    if (path / "summary.json").is_file():
        try:
            summary = json.loads((path / "summary.json").read_text())
        except json.JSONDecodeError as err:
            raise DataError(f"{path / 'summary.json'} is not valid JSON: {err}") from None
    return RunRecord(path, config if isinstance(config, dict) else {}, summary, metrics_rows(path / "metrics.csv"))


def metrics_rows(path: Path) -> List[Dict[str, float]]:
    """read_metrics, tolerating a row a running training is still writing: a cell that is no number is dropped."""
    try:
        return read_metrics(path)
    except ValueError:
        with open(path, newline="") as f:
            return [{k: v for k, v in ((k, _number(v)) for k, v in r.items() if k) if v is not None}
                    for r in csv.DictReader(f)]


def _number(text: Optional[str]) -> Optional[float]:
    try:
        return float(text) if text not in ("", None) else None
    except ValueError:
        return None


def last_value(rows: List[Dict[str, float]], key: str) -> Optional[float]:
    values = [r[key] for r in rows if key in r]
    return values[-1] if values else None


def steps_logged(rows: List[Dict[str, float]]) -> Optional[int]:
    """Optimizer steps done at the last train/loss row (its `step`: steps completed, lit_pretrain/runs/step_axis.py)."""
    steps = [int(r["step"]) for r in rows if "train/loss" in r and "step" in r]
    return max(steps) if steps else None


def has_checkpoint(path: Path) -> bool:
    """checkpoints/latest names a checkpoint file that exists (its checksum is not read: that needs the whole file)."""
    pointer = path / "checkpoints" / "latest"
    if not pointer.is_file():
        return False
    named = pointer.read_text().strip()
    return bool(named) and "/" not in named and (path / "checkpoints" / named).is_file()


def newest_change(path: Path) -> float:
    """The newest modification time of the folder and the files training writes as it goes."""
    candidates = [path, path / "metrics.csv", path / "checkpoints", path / "checkpoints" / "latest"]
    return max((p.stat().st_mtime for p in candidates if p.exists()), default=0.0)


def held(path: Path) -> Optional[bool]:
    """Whether a live start holds the run folder (its lock on the marker, runs.in_use); None when it cannot be
    asked (a folder this user may not write to)."""
    try:
        return in_use(path)
    except OSError:
        return None


def status(run: RunRecord, now: Optional[float] = None, active_minutes: float = ACTIVE_MINUTES) -> str:
    """What summary.json's `status` says (run_state.describe): finished; running while a live process holds the
    folder, killed once none does (SIGKILL, out of memory: nothing wrote an end); preempted, stopped, diverged or
    failed; each but finished and running with ", resumes from step k" when a checkpoint is there to continue from.

    A run folder from before summary.json had a status (no summary during training; a summary without `status`
    at its end) is judged as it was then: finished if its summary's `steps` is at least the last step in
    metrics.csv; else running if the folder changed in the last `active_minutes`; else resumable with a
    checkpoint, failed without.
    """
    if run.summary is not None and "status" in run.summary:
        return run_state.describe(run.summary, held(run.path), run.path)
    logged = steps_logged(run.rows)
    if run.summary is not None and (logged is None or (run.summary.get("steps") or 0) >= logged):
        return "finished"
    now = time.time() if now is None else now
    if now - newest_change(run.path) < active_minutes * 60:
        return "running"
    return "resumable" if has_checkpoint(run.path) else "failed"


def row(run: RunRecord, now: Optional[float] = None, active_minutes: float = ACTIVE_MINUTES) -> Dict[str, object]:
    """One table row. A finished, preempted, stopped or diverged run's numbers come from its summary (written at its
    end: a preempted run's steps are its checkpoint's); any other run's from its last metrics rows (tokens/s is
    then the last logged throughput/tokens_per_s: the rate of the latest interval, not the mean). Bits per byte is
    the summary's val_bits_per_byte (written by the held-out evaluation when it ran), else '-'."""
    state = status(run, now, active_minutes)
    if state == run_state.FINISHED or state.startswith(run_state.ENDED):
        s = run.summary
        values = [s.get("steps"), s.get("tokens_seen"), s.get("final_train_loss"), s.get("final_val_loss"),
                  s.get("val_bits_per_byte"), s.get("tokens_per_second")]
    else:
        rows = run.rows
        values = [steps_logged(rows), last_value(rows, "train/tokens_seen"), last_value(rows, "train/loss"),
                  last_value(rows, "val/loss"), None, last_value(rows, "throughput/tokens_per_s")]
    return dict(zip(COLUMNS, [run.name, *values, state]))


def cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "nan"
        if value.is_integer() and abs(value) >= 100:
            return f"{int(value):,}"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def find_runs(root: Path) -> List[Path]:
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"runs folder {root} does not exist: give the folder that holds run folders (run.root_dir, "
                        "runs/ by default)")
    return sorted(p for p in root.iterdir() if is_run_folder(p))


def table(root: Path, now: Optional[float] = None, active_minutes: float = ACTIVE_MINUTES) -> str:
    """The runs under `root` as a fixed-width text table, one line a run, sorted by name."""
    rows = [row(read_run(p), now, active_minutes) for p in find_runs(root)]
    if not rows:
        return f"no run folders in {root}"
    cells = [list(COLUMNS)] + [[cell(r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    # Name and status left-aligned, numbers right-aligned.
    return "\n".join("  ".join(v.ljust(w) if i in (0, len(COLUMNS) - 1) else v.rjust(w)
                               for i, (v, w) in enumerate(zip(line, widths))).rstrip() for line in cells)
