"""(N, D, C, loss) points from run folders (their summary.json) or from a CSV, for fitting scaling laws.

Conventions: N counts all parameters (`params`, Hoffmann et al. 2022); D is tokens trained on; C is training FLOPs.
From a run, C = flops_per_token × tokens_seen (PaLM appendix B, what the run really spent); from a CSV without a
compute column, C = 6·N·D, and without a tokens column, D = C / (6·N) (as Besiroglu et al. 2024 derive D from
Hoffmann et al.'s Figure 4).
"""

import csv
import json
import math
from pathlib import Path
from typing import Dict, List

from lit_pretrain.errors import DataError
from lit_pretrain.runs.state import is_finished

# Accepted CSV headers for each column, first match wins. `Model Size`/`Training FLOP` are Epoch's extraction.
COLUMNS = {
    "N": ("N", "params", "Model Size"),
    "D": ("D", "tokens", "tokens_seen"),
    "C": ("C", "flops", "Training FLOP"),
    "loss": ("loss", "final_val_loss"),
}


def load_points(sources: List[str]) -> List[Dict]:
    """Points from each source: a run folder, a folder of run folders, or a CSV file."""
    points: List[Dict] = []
    for source in sources:
        path = Path(source)
        if path.is_file() and path.suffix.lower() == ".csv":
            points.extend(read_csv(path))
        elif path.is_dir() and (path / "summary.json").is_file():
            points.append(read_summary(path / "summary.json"))
        elif path.is_dir():
            summaries = sorted(path.glob("*/summary.json"))
            if not summaries:
                raise DataError(f"{path} holds no summary.json and no run folders with one: pass finished run "
                                "folders (runs/<name>) or a CSV with columns N, D or C, loss")
            points.extend(read_summary(s) for s in summaries)
        else:
            raise DataError(f"{path} is neither a run folder nor a .csv file: pass runs/<name> folders or a CSV")
    if len(points) < 5:
        raise DataError(f"{len(points)} points from {', '.join(sources)}: a law with 5 coefficients needs at least 5")
    return points


def read_summary(path: Path) -> Dict:
    s = json.loads(path.read_text())
    if not is_finished(s):  # a partial run's loss is not the law's loss at its tokens (run_state.py)
        raise DataError(f"{path}: the run is {s.get('status')} at step {s.get('steps')} of {s.get('max_steps')}, "
                        "not finished: train it to the end (run.resume=auto) or leave its folder out")
    missing = [k for k in ("params", "flops_per_token", "tokens_seen", "final_val_loss") if s.get(k) is None]
    if missing:
        raise DataError(f"{path} lacks {missing}: the run did not finish with a validation loss; train it to the "
                        "end or leave its folder out")
    n, d = float(s["params"]), float(s["tokens_seen"])
    return _point(path.parent.name, n, d, float(s["flops_per_token"]) * d, float(s["final_val_loss"]), str(path))


def read_csv(path: Path) -> List[Dict]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        cols = {key: next((c for c in names if c in header), None) for key, names in COLUMNS.items()}
        if cols["N"] is None or cols["loss"] is None or (cols["D"] is None and cols["C"] is None):
            raise DataError(f"{path}: columns {header} lack parameters ({'/'.join(COLUMNS['N'])}), loss "
                            f"({'/'.join(COLUMNS['loss'])}) and tokens or compute ({'/'.join(COLUMNS['D'])} or "
                            f"{'/'.join(COLUMNS['C'])})")
        points = []
        for i, row in enumerate(reader, start=2):
            try:
                n, loss = float(row[cols["N"]]), float(row[cols["loss"]])
                d = float(row[cols["D"]]) if cols["D"] else None
                c = float(row[cols["C"]]) if cols["C"] else None
            except (TypeError, ValueError):
                raise DataError(f"{path}, line {i}: a value is missing or not a number") from None
            d = d if d is not None else c / (6 * n)
            c = c if c is not None else 6 * n * d
            points.append(_point(f"{path.name}:{i}", n, d, c, loss, str(path)))
    return points


def _point(name: str, n: float, d: float, c: float, loss: float, source: str) -> Dict:
    if not all(math.isfinite(v) and v > 0 for v in (n, d, c, loss)):
        raise DataError(f"{source} ({name}): N={n}, D={d}, C={c}, loss={loss}; all must be positive and finite")
    return {"name": name, "N": n, "D": d, "C": c, "loss": loss}
