"""Fault injection for the failure tests (tests/launch/test_multinode.py), loaded into runs through `callbacks.extra`.
Test code only: nothing in lit_pretrain reads these."""

import os
import signal
import time
from pathlib import Path
from typing import Optional

from lightning.pytorch.callbacks import Callback


class RankFault(Callback):
    """On global rank `rank`, at optimizer step `step`: KILL or STOP this process at the start of step `step` + 1
    (global_step == step, first micro-batch); or SLOW_READ: from the end of step `step` on, reading a training
    sample sleeps `seconds` (a data read that hangs: the peers go on into the next step and wait for this rank in
    its first collective). With `once` (a file path), only when the file does not exist yet (it is created, its time
    is the fault's), so a restarted run goes past the step; without, every attempt fails."""

    def __init__(self, step: int, rank: int = 1, action: str = "KILL", seconds: float = 600.0,
                 once: Optional[str] = None):
        self.step, self.rank, self.action, self.seconds, self.once = step, rank, action, seconds, once

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.action != "SLOW_READ" and self.due(trainer):
            if self.action == "TERM_SUPERVISOR":  # the scheduler's SIGTERM, to the process the user started
                os.kill(os.getppid(), signal.SIGTERM)
            else:
                os.kill(os.getpid(), getattr(signal, f"SIG{self.action}"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.action == "SLOW_READ" and self.due(trainer):
            dataset, seconds = trainer.datamodule.train_loader.dataset, self.seconds

            def slow(self, index):
                time.sleep(seconds)
                return type(self).__mro__[1].__getitem__(self, index)

            # Special methods are looked up on the type: a subclass with a slow __getitem__ for this instance only.
            dataset.__class__ = type("SlowRead", (type(dataset),), {"__getitem__": slow})

    def due(self, trainer) -> bool:
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return False
        if self.once is not None:
            try:
                Path(self.once).touch(exist_ok=False)
            except FileExistsError:
                return False
        return True


class StepClock(Callback):
    """Prints `step-clock <global_step> <unix time>` on rank 0 after every micro-batch (for the measurements of
    tests/helpers/measure_failures.py)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            print(f"step-clock {trainer.global_step} {time.time():.3f}", flush=True)
