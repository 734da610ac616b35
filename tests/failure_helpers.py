"""Fault injection for the failure tests (tests/test_multinode.py), loaded into runs through `callbacks.extra`. Test
code only: nothing in lit_pretrain reads these."""

import os
import signal
import time
from pathlib import Path
from typing import Optional

from lightning.pytorch.callbacks import Callback


class RankFault(Callback):
    """At the start of optimizer step `step` + 1 (global_step == step, first micro-batch) on global rank `rank`:
    KILL or STOP this process; or SLEEP `seconds` at the end of that micro-batch (a rank that hangs after its
    step, e.g. reading the next batch, while its peers wait in the next step's collective). With `once` (a file
    path), only when the file does not exist yet (it is created, its time is the fault's), so a restarted run goes
    past the step; without, every attempt fails."""

    def __init__(self, step: int, rank: int = 1, action: str = "KILL", seconds: float = 600.0,
                 once: Optional[str] = None):
        self.step, self.rank, self.action, self.seconds, self.once = step, rank, action, seconds, once

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.action != "SLEEP":
            self.fault(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.action == "SLEEP":
            self.fault(trainer)

    def fault(self, trainer):
        if trainer.global_step != self.step or trainer.global_rank != self.rank:
            return
        if self.once is not None:
            try:
                Path(self.once).touch(exist_ok=False)
            except FileExistsError:
                return
        if self.action == "SLEEP":
            time.sleep(self.seconds)
        else:
            os.kill(os.getpid(), getattr(signal, f"SIG{self.action}"))
