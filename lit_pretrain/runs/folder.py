"""The run folder: created once, never silently overwritten; holds config, metrics, checkpoints, plots, summary."""

import contextlib
import csv
import fcntl
import json
import math
import os
import time
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from lit_pretrain.errors import RunFolderError
from lit_pretrain.paths import SAFE_NAME_RULE, confined, is_safe_name, safe_rmtree

# Written into every run folder when it is made: `run.overwrite` and the clean-up after a failed start delete only
# folders holding it (or, from versions before it, a config.yaml naming the run).
MARKER = ".lit-pretrain-run"
CLAIMS_LOCK = ".lit-pretrain-claims"  # in run.root_dir: see _claiming
ATTEMPTS = "attempts"
"""In a run folder: attempts/<n>/ holds the files of a start that was killed before its first checkpoint, set aside
(never deleted) when run.resume=auto starts the run again (set_aside_attempt)."""


def is_primary_process() -> bool:
    """True in the process that owns the run folder: global rank 0.

    Lightning's `ddp` launcher re-runs the command for the other ranks with LOCAL_RANK/NODE_RANK set (torchrun and
    SLURM set RANK); those processes must use the folder rank 0 made, not create or reject it.
    """
    return all(os.environ.get(var, "0") == "0" for var in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def run_dir_path(root_dir: str, name: str) -> Path:
    """root_dir/name, refused unless `name` is one safe folder name (the config loader checks it too) and the folder
    is not a symlink and resolves strictly inside root_dir."""
    if not is_safe_name(name):
        raise RunFolderError(f"run.name={name!r}: expected {SAFE_NAME_RULE}")
    return confined(root_dir, Path(root_dir) / name, "run folder")


def has_marker(run_dir: Path) -> bool:
    marker = run_dir / MARKER
    return marker.is_file() and not marker.is_symlink()


def made_by_this_project(run_dir: Path) -> bool:
    """The run folder holds our marker, or (made by a version before the marker) a config.yaml naming this run."""
    if has_marker(run_dir):
        return True
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(saved, dict) and isinstance(saved.get("run"), dict) and saved["run"].get("name") == run_dir.name


def holds_results(run_dir: Path) -> bool:
    """Anything a run would lose: a file under checkpoints/ or attempts/, or a metrics row."""
    for sub in ("checkpoints", ATTEMPTS):
        folder = run_dir / sub
        if folder.is_dir() and any(folder.iterdir()):
            return True
    metrics = run_dir / "metrics.csv"
    if not metrics.is_file():
        return False
    with open(metrics, newline="") as f:
        return any(True for _ in csv.DictReader(f))


def is_reusable(run_dir: Path) -> bool:
    """Left by a start that failed before training: ours (marker), no checkpoint, no metrics row."""
    return has_marker(run_dir) and not holds_results(run_dir)


def is_empty(run_dir: Path) -> bool:
    """Nothing in it, or only an empty checkpoints/ folder (what a failed start of a version before the marker left)."""
    entries = list(run_dir.iterdir())
    if not entries:
        return True
    only = entries[0]
    return (len(entries) == 1 and only.name == "checkpoints" and only.is_dir() and not only.is_symlink()
            and not any(only.iterdir()))


def check_run_dir(root_dir: str, name: str, overwrite: bool) -> Path:
    """root_dir/name when a new run may start there (absent, empty, left by a failed start, or to be overwritten and
    made by the project); a RunFolderError otherwise. Writes nothing, so train() asks before preparing data."""
    run_dir = run_dir_path(root_dir, name)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderError(f"run folder {run_dir} is a file: choose another run.name")
    if run_dir.is_dir() and not is_empty(run_dir) and not is_reusable(run_dir):
        if not overwrite:
            raise RunFolderError(
                f"run folder {run_dir} already exists: choose another run.name, or set run.overwrite=true to "
                "delete it and start again"
            )
        if not made_by_this_project(run_dir):
            raise RunFolderError(
                f"run folder {run_dir} was not made by lit-pretrain (no {MARKER} marker, no config.yaml naming the "
                "run): run.overwrite deletes only run folders the project made; move it away or choose another run.name"
            )
    return run_dir


class Claim:
    """A run folder held by this start: an exclusive flock on its marker, from the claim to release() (or the
    process's end, whatever ends it: the kernel drops the lock with the process). Another start finds the folder
    in use (in_use) and is refused, where before two starts at the same moment both passed the "already exists"
    check and wrote into one folder."""

    def __init__(self, run_dir: Path, lock=None):
        self.run_dir, self._lock = run_dir, lock
        self.aside: Optional[Path] = None  # claim_run_dir(restart=True): where the earlier attempt's files went

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file drops its flock
            self._lock = None


@contextlib.contextmanager
def _claiming(root_dir: str):
    """Claims of run folders under root_dir one at a time: an exclusive flock on root_dir/.lit-pretrain-claims, held
    for the milliseconds a claim takes (check, delete, make, mark, hold). A lock file, not the folder itself: flock
    on NFS locks files opened for writing only."""
    Path(root_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(root_dir) / CLAIMS_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def in_use(run_dir: Path) -> bool:
    """Whether a live start holds the run folder (a Claim on its marker)."""
    if not has_marker(run_dir):
        return False
    with open(run_dir / MARKER, "a") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False  # closing the probe dropped the lock it took


def refuse_in_use(run_dir: Path) -> None:
    if in_use(run_dir):
        raise _in_use_error(run_dir)


def _in_use_error(run_dir: Path) -> RunFolderError:
    return RunFolderError(f"run folder {run_dir} is in use by another start of run.name={run_dir.name} (it holds the "
                          f"lock on {MARKER}): wait for that run to end, or choose another run.name")


def _hold(run_dir: Path) -> Claim:
    lock = open(run_dir / MARKER, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise _in_use_error(run_dir) from None
    return Claim(run_dir, lock)


def claim_run_dir(root_dir: str, name: str, overwrite: bool, resume: bool = False, restart: bool = False) -> Claim:
    """On rank 0: make root_dir/name with its checkpoints/ folder and our marker, and hold it (Claim); or, with
    `resume`, hold the existing folder as it is. Other ranks get the path unheld. Check, delete, make and hold run
    under one lock (_claiming), so of starts at the same moment exactly one gets the folder and the others a
    RunFolderError. An existing folder is refused unless check_run_dir allows it; a non-empty allowed one is deleted
    first; one in use by another start is refused always. With `restart` (run.resume=auto in a folder of ours that
    holds no checkpoint) its files are set aside in attempts/<n>/ (Claim.aside) and the folder is held as new."""
    run_dir = run_dir_path(root_dir, name)
    if not is_primary_process():
        return Claim(run_dir)
    with _claiming(root_dir):
        refuse_in_use(run_dir)
        if restart:
            aside = set_aside_attempt(root_dir, run_dir)
            (run_dir / "checkpoints").mkdir()
            claim = _hold(run_dir) if has_marker(run_dir) else Claim(run_dir)
            claim.aside = aside
            return claim
        if resume:
            (run_dir / "checkpoints").mkdir(exist_ok=True)
            # A folder of a version before the marker holds none: held by nothing then, as it was.
            return _hold(run_dir) if has_marker(run_dir) else Claim(run_dir)
        check_run_dir(root_dir, name, overwrite)
        if run_dir.is_dir() and not is_empty(run_dir):
            remove_run_dir(root_dir, run_dir)
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        marker = {"lit_pretrain": "run folder", "name": name, "created_unix": round(time.time(), 3)}
        (run_dir / MARKER).write_text(json.dumps(marker) + "\n")
        return _hold(run_dir)


def set_aside_attempt(root_dir: str, run_dir: Path) -> Path:
    """Move every entry of the run folder but its marker and attempts/ into attempts/<n>/ (n the first free number
    from 1), on rank 0 under the claims lock: renames inside the run folder, nothing deleted or copied. The run
    folder and attempts/ are checked to lie inside root_dir and not to be links (paths.confined, symlinks
    resolved); an entry that is a link is moved as the link. Returns attempts/<n>."""
    run_dir = confined(root_dir, run_dir, "run folder")
    attempts = confined(run_dir, run_dir / ATTEMPTS, "attempts folder")
    attempts.mkdir(exist_ok=True)
    n = 1
    while (attempts / str(n)).exists() or (attempts / str(n)).is_symlink():
        n += 1
    aside = attempts / str(n)
    aside.mkdir()
    for entry in sorted(run_dir.iterdir()):
        if entry.name not in (MARKER, ATTEMPTS):
            os.rename(entry, aside / entry.name)
    return aside


def create_run_dir(root_dir: str, name: str, overwrite: bool) -> Path:
    """claim_run_dir for a start that does not train (tools, tests): the folder made, its claim released."""
    claim = claim_run_dir(root_dir, name, overwrite)
    claim.release()
    return claim.run_dir


def remove_run_dir(root_dir: str, run_dir: Path) -> None:
    """Delete a run folder: only inside root_dir, never through a link, only one the project made."""
    safe_rmtree(run_dir, root_dir, made_by_this_project, "run folder")


def remove_failed_start(root_dir: str, run_dir: Path) -> bool:
    """After a start that failed: delete the run folder this process made if it holds no checkpoint and no metrics
    row (a retry would otherwise be refused with "already exists"). Returns whether it was deleted; it never raises,
    so the error that stopped the start is the one reported."""
    if not is_primary_process() or run_dir.is_symlink() or not run_dir.is_dir() or not is_reusable(run_dir):
        return False
    try:
        remove_run_dir(root_dir, run_dir)
    except OSError:  # RunFolderError included: the folder stays, which is always safe
        return False
    return True


def read_metrics(path: Path) -> List[Dict[str, float]]:
    """Rows of Lightning's metrics.csv with the empty cells dropped and numbers parsed."""
    if not path.is_file():
        return []
    with open(path) as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


def series(rows: List[Dict[str, float]], key: str) -> List[tuple]:
    return [(int(r["step"]), r[key]) for r in rows if key in r and "step" in r]


def plot_loss_curve(rows: List[Dict[str, float]], out: Path, unigram_entropy: Optional[float] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label in (("train/loss", "train"), ("val/loss", "validation")):
        points = series(rows, key)
        if points:
            ax.plot(*zip(*points), label=label, marker="o" if key == "val/loss" else None)
    if unigram_entropy is not None:
        ax.axhline(unigram_entropy, color="grey", linestyle="--", label="unigram entropy")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def write_summary(run_dir: Path, summary: dict) -> None:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}
    (run_dir / "summary.json").write_text(json.dumps(clean, indent=2) + "\n")
