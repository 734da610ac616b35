"""A CSV metrics logger that continues a resumed run's metrics.csv, so the file holds each step once.

On resume the rows logged after the checkpoint (by the run that was killed) are cut, and the writer starts from the
file's header; Lightning's own writer deletes an existing file when it starts (and would otherwise rewrite it with
only the columns it has seen).
"""

import csv
import os
from io import StringIO
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger

from lit_pretrain.resume.atomic import atomic_write_bytes


def cut_after(path: Path, last_step: int) -> int:
    """Keep the rows of `path` whose step is at most `last_step` (atomically); return how many were cut."""
    if not path.is_file():
        return 0
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames or [], list(reader)
    kept = [r for r in rows if r.get("step") in (None, "") or int(float(r["step"])) <= last_step]
    out = StringIO()
    writer = csv.DictWriter(out, fieldnames=header)  # csv's \r\n rows, as Lightning writes them
    writer.writeheader()
    writer.writerows(kept)
    atomic_write_bytes(path, out.getvalue().encode())
    return len(rows) - len(kept)


class ResumableCSVLogger(CSVLogger):
    @property
    def experiment(self):
        if self._experiment is not None:
            return self._experiment
        # Lightning's writer deletes an existing metrics.csv when it is created: keep the rows and put them back.
        path = Path(self.log_dir) / "metrics.csv"
        kept = path.read_bytes() if path.is_file() else None
        writer = super().experiment
        if kept is not None and hasattr(writer, "metrics_keys"):  # ranks other than 0 get a dummy writer
            atomic_write_bytes(path, kept)
            with open(path, newline="") as f:
                writer.metrics_keys = list(csv.DictReader(f).fieldnames or [])
        return writer
