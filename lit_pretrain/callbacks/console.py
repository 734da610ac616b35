"""What a run prints: our lines and real warnings. Known noise of the libraries is dropped by its exact message (never
a whole category or logger), and a progress bar is drawn only on a terminal: in a log file its redraws are one line
of carriage returns per epoch, so there a line every trainer.log_every_n_steps steps (loss, tokens/s, MFU, time left)
and a line per validation say where the run is instead.

Measured on `lit-pretrain train` of the tiny run on 2 processes, non-interactive: Lightning's litlogger
tip, torch's LeafSpec deprecation twice per rank (Lightning 2.6's utilities/_pytree.py still builds a LeafSpec),
three "use sync_dist=True" warnings for val/* values the module had already reduced (module.py now logs them
as reduced), and the bar's redraws. tests/parallel/test_ddp.py checks the console of such a run.
"""

import logging
import re
import sys
import time
import warnings
from typing import List, Optional

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
        losses = ", ".join(f"{key} {float(metrics[key]):.4f}" for key in ("train/loss", "val/loss", "val/ema_loss")
                           if key in metrics)
        print(f"step {trainer.global_step}/{trainer.max_steps}: {losses}", flush=True)


class StepLine(Callback):
    """In a log file, where no bar redraws: one line every `every_n_steps` optimizer steps on rank 0, after step k
    (trainer.global_step, the optimizer steps completed): the step's training loss, tokens/s and MFU since the
    previous line (validation left out, as in callbacks/throughput.py), and the time left at this session's pace.

    Measured at the step's end, printed at the next hook (the next batch, a validation, the end of training): the
    module logs the step's loss in its own on_train_batch_end, which Lightning calls after the callbacks'."""

    def __init__(self, every_n_steps: int):
        self.every_n_steps = max(1, every_n_steps)
        self._peak: Optional[float] = None
        self._flops_per_token: Optional[int] = None
        self._pending: Optional[tuple] = None

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            from lit_pretrain.callbacks.throughput import peak_flops_per_device

            self._peak = peak_flops_per_device(trainer.strategy.root_device, str(trainer.precision))
        model_cfg = getattr(pl_module, "model_cfg", None)
        if model_cfg is not None:  # the whole model's, as ThroughputMonitor counts it: a rank may hold only a part
            from lit_pretrain.model.shapes import flops_per_token

            self._flops_per_token = flops_per_token(model_cfg)
        self._start = self._last = time.perf_counter()
        self._first_step = self._last_step = trainer.global_step
        self._paused, self._paused_at = 0.0, None  # validation seconds since the previous line

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step or step % self.every_n_steps or not trainer.is_global_zero:
            return  # mid-accumulation, or not a line's step
        now = time.perf_counter()
        seconds = now - self._last - self._paused
        if hasattr(pl_module, "tokens_before"):  # trainer.batch_schedule: the steps' own batches
            tokens = pl_module.tokens_before(step) - pl_module.tokens_before(self._last_step)
        else:
            tokens = (step - self._last_step) * getattr(pl_module, "tokens_per_step", 0)
        rate = tokens / seconds if seconds > 0 else 0.0
        fpt = self._flops_per_token
        mfu = rate * fpt / (self._peak * trainer.world_size) if fpt and self._peak else None
        left = (now - self._start) / (step - self._first_step) * (trainer.max_steps - step)
        self._pending = (step, trainer.max_steps, rate, mfu, left)
        self._last, self._last_step, self._paused = now, step, 0.0

    def _emit(self, trainer) -> None:
        if self._pending is not None:
            step, total, rate, mfu, left = self._pending
            self._pending = None
            loss = trainer.callback_metrics.get("train/loss")
            print(step_line(step, total, None if loss is None else float(loss), rate, mfu, left), flush=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._emit(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._emit(trainer)
        self._paused_at = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._paused_at is not None and trainer.state.fn == "fit":
            self._paused += time.perf_counter() - self._paused_at
        self._paused_at = None

    def on_train_end(self, trainer, pl_module) -> None:
        self._emit(trainer)


def step_line(step: int, total: int, loss: Optional[float], tokens_per_s: float, mfu: Optional[float],
              seconds_left: float) -> str:
    """`step 10/200: train/loss 5.1234, 12,345 tokens/s, MFU 31.2%, 2:05 left` (MFU left out where no peak is
    known)."""
    parts = [f"train/loss {loss:.4f}"] if loss is not None else []
    parts.append(f"{tokens_per_s:,.0f} tokens/s")
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    parts.append(f"{duration(seconds_left)} left")
    return f"step {step}/{total}: {', '.join(parts)}"


def duration(seconds: float) -> str:
    """m:ss, or h:mm:ss from an hour."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


def progress_callbacks(progress_bar: bool, refresh_rate: int, stream=None,
                       log_every_n_steps: int = 0) -> List[Callback]:
    """trainer.progress_bar: the bar on a terminal; in a log file a line every `log_every_n_steps` optimizer steps
    (none for 0) and a line per validation; nothing when off."""
    if not progress_bar:
        return []
    stream = stream if stream is not None else sys.stdout
    if stream.isatty():
        return [ProgressBar(refresh_rate=refresh_rate)]
    return [*([StepLine(log_every_n_steps)] if log_every_n_steps else []), ValidationLine()]


def has_bar(callbacks: List[Callback]) -> bool:
    """Whether Lightning should draw a progress bar (its enable_progress_bar)."""
    return any(isinstance(cb, TQDMProgressBar) for cb in callbacks)
