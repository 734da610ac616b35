"""What a run prints: our lines and real warnings. Known noise of the libraries is dropped by its exact message (never
a whole category or logger), and a progress bar is drawn only on a terminal: in a log file its redraws are one line
of carriage returns per epoch, so there a line per validation says where the run is instead.

Measured on `lit-pretrain train` of the tiny run on 2 processes, non-interactive (issue 31): Lightning's litlogger
tip, torch's LeafSpec deprecation twice per rank (Lightning 2.6's utilities/_pytree.py still builds a LeafSpec),
three "use sync_dist=True" warnings for val/* values the module had already reduced (module.py now logs them
as reduced), and the bar's redraws. tests/test_ddp.py checks the console of such a run.
"""

import logging
import re
import sys
import warnings
from typing import List

from lightning.pytorch.callbacks import Callback, TQDMProgressBar

# (message regex, category) of warnings that are the libraries' business, not the run's.
NOISE_WARNINGS = [
    # torch deprecated LeafSpec; lightning.pytorch.utilities._pytree builds one at every loop start, on every rank.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
]
# Info lines Lightning logs through its rank-zero logger: advertisements for its cloud products.
NOISE_INFO = re.compile(r"💡 Tip: For seamless cloud")
RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return NOISE_INFO.match(record.getMessage()) is None


def quiet() -> None:
    """Drop the known noise in this process (each rank runs it: the launcher re-runs the command)."""
    for message, category in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    logger = logging.getLogger(RANK_ZERO_LOGGER)
    if not any(isinstance(f, _DropNoise) for f in logger.filters):
        logger.addFilter(_DropNoise())


class ProgressBar(TQDMProgressBar):
    """Lightning's bar without `v_num` (the logger's version, here the tail of "tensorboard": "oard")."""

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


class ValidationLine(Callback):
    """One line per validation on rank 0, for a log file: the step and the losses (where a bar would redraw)."""

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking or trainer.state.fn != "fit":
            return  # trainer.validate after fit: the run's report follows at once
        metrics = trainer.callback_metrics
        losses = ", ".join(f"{key} {float(metrics[key]):.4f}" for key in ("train/loss", "val/loss") if key in metrics)
        print(f"step {trainer.global_step}/{trainer.max_steps}: {losses}", flush=True)


def progress_callbacks(progress_bar: bool, refresh_rate: int, stream=None) -> List[Callback]:
    """trainer.progress_bar: the bar on a terminal, one line per validation otherwise; nothing when off."""
    if not progress_bar:
        return []
    stream = stream if stream is not None else sys.stdout
    return [ProgressBar(refresh_rate=refresh_rate)] if stream.isatty() else [ValidationLine()]


def has_bar(callbacks: List[Callback]) -> bool:
    """Whether Lightning should draw a progress bar (its enable_progress_bar)."""
    return any(isinstance(cb, TQDMProgressBar) for cb in callbacks)
