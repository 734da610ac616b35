"""The run folder: created once, never silently overwritten; holds config, metrics, checkpoints, plots, summary."""

import csv
import json
import math
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional

from lit_pretrain.errors import RunFolderError


def is_primary_process() -> bool:
    """True in the process that owns the run folder: global rank 0.

    Lightning's `ddp` launcher re-runs the command for the other ranks with LOCAL_RANK/NODE_RANK set (torchrun and
    SLURM set RANK); those processes must use the folder rank 0 made, not create or reject it.
    """
    return all(os.environ.get(var, "0") == "0" for var in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def create_run_dir(root_dir: str, name: str, overwrite: bool) -> Path:
    run_dir = Path(root_dir) / name
    if not is_primary_process():
        return run_dir
    if run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            raise RunFolderError(
                f"run folder {run_dir} already exists: choose another run.name, or set run.overwrite=true to "
                "delete it and start again"
            )
        shutil.rmtree(run_dir)
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    return run_dir


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
