"""Small shared pieces of the stability callbacks: JSON files in the run folder, and rows gathered from every rank."""

import json
import math
from pathlib import Path
from typing import List

import torch


def json_safe(obj):
    """JSON has no NaN or Inf: write them as the strings "nan", "inf", "-inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj


def write_json(trainer, filename: str, obj) -> None:
    """Write `obj` into the run folder (`trainer.default_root_dir`), from global rank 0 only."""
    if trainer.is_global_zero:
        path = Path(trainer.default_root_dir) / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(json_safe(obj), indent=1) + "\n")


def gather_rows(trainer, row: List[float]) -> List[List[float]]:
    """Every rank's row, in rank order: a collective, so call it only where every rank does (an agreed decision)."""
    local = torch.tensor(row, dtype=torch.float64, device=trainer.strategy.root_device)
    gathered = trainer.strategy.all_gather(local)
    return (gathered.unsqueeze(0) if gathered.dim() == 1 else gathered).cpu().tolist()
