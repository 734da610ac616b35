"""A CSV metrics logger that continues a resumed run's metrics.csv, so the file holds each step once.

On resume the rows written after the checkpoint (by the run that was killed) are cut, and the writer starts from the
file's header; Lightning's own writer deletes an existing file when it starts (and would otherwise rewrite it with
only the columns it has seen).
"""

import csv
from io import StringIO
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_pretrain.atomic import atomic_write_bytes
from lit_pretrain.internals import csv_writer_made


def data_rows(path: Path) -> int:
    """Rows of a metrics.csv, header excluded (0 when there is none yet)."""
    if not path.is_file():
        return 0
    with open(path, newline="") as f:
        return sum(1 for _ in csv.DictReader(f))


def keep_first_rows(path: Path, rows: int) -> int:
    """Keep the header and the first `rows` rows of `path` (atomically); return how many rows were cut.

    Rows, not steps, mark the checkpoint: every row is tagged with the optimizer steps completed
    (runs/step_axis.py), but several rows share a step (the train row, validation, the monitors' rows) and a
    row written after the checkpoint can carry its step (a monitor's flush at the end of a preempted run), so only
    the count flushed before the checkpoint is exact.
    """
    if not path.is_file():
        return 0
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header, all_rows = reader.fieldnames or [], list(reader)
    if len(all_rows) <= rows:
        return 0
    out = StringIO()
    writer = csv.DictWriter(out, fieldnames=header)  # csv's \r\n rows, as Lightning writes them
    writer.writeheader()
    writer.writerows(all_rows[:rows])
    atomic_write_bytes(path, out.getvalue().encode())
    return len(all_rows) - rows


class ResumableCSVLogger(CSVLogger):
    def metrics_path(self) -> Path:
        return Path(self.log_dir) / "metrics.csv"

    @property
    def experiment(self):
        if csv_writer_made(self) is not None:
            return csv_writer_made(self)
        if rank_zero_only.rank != 0:
            # Other ranks get Lightning's dummy writer: they must not read the file rank 0 is putting back (a race
            # seen under strategy=tensor: rank 1 read metrics.csv while rank 0's writer had deleted it).
            return super().experiment
        # Lightning's writer deletes an existing metrics.csv when it is created: keep the rows and put them back.
        path = Path(self.log_dir) / "metrics.csv"
        kept = path.read_bytes() if path.is_file() else None
        writer = super().experiment
        if kept is not None:
            atomic_write_bytes(path, kept)
            with open(path, newline="") as f:
                writer.metrics_keys = list(csv.DictReader(f).fieldnames or [])
        return writer
