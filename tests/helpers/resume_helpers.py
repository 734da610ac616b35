"""Fault injection for the resume tests, loaded into runs through `callbacks.extra`."""

import json
import os
import signal
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class Fault(Callback):
    """At the start of micro-batch `micro_batch` of optimizer step `step` + 1 (global_step == step), send `signal`:
    KILL to the whole process group (every rank dies at once, as when a node is lost), TERM to this process only,
    INT to the whole process group (a terminal's Ctrl-C reaches every local rank), INT0 to rank 0 only (`kill -INT`).
    `flush` writes the metrics rows first."""

    def __init__(self, step: int, micro_batch: int = 0, signal: str = "KILL", flush: bool = False):
        self.step, self.micro_batch, self.signal, self.flush = step, micro_batch, signal, flush
        self.seen = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        self.seen += 1
        if self.seen - 1 == self.micro_batch:
            if self.flush:  # the metrics rows on disk, as Lightning writes them every 100 steps of a longer run
                for logger in trainer.loggers:
                    logger.save()
            if self.signal == "KILL":
                os.killpg(os.getpgid(0), signal.SIGKILL)
            elif self.signal == "INT":
                if trainer.is_global_zero:
                    os.killpg(os.getpgid(0), signal.SIGINT)
            elif self.signal == "INT0":
                if trainer.is_global_zero:
                    os.kill(os.getpid(), signal.SIGINT)
            elif trainer.is_global_zero:
                os.kill(os.getpid(), signal.SIGTERM)


class RecordIndices(Callback):
    """Appends {"step" (optimizer steps done before it), "rank", "indices"} of every micro-batch to
    `out`.rank<r>.jsonl."""

    def __init__(self, out: str):
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        path = Path(f"{self.out}.rank{trainer.global_rank}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "rank": trainer.global_rank,
                                "indices": trainer.datamodule.batch_indices}) + "\n")


class SlowWrite(Callback):
    """Makes the background writer of sharded checkpoints (resume/sharded/save.py WRITE_DELAY) sleep a minute before
    writing the checkpoint of optimizer step `step`, so that a Fault can kill every rank in the middle of it."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            from lit_pretrain.resume.sharded import save as sharded

            sharded.WRITE_DELAY = 60.0


class Raise(Callback):
    """Raises RuntimeError at the start of optimizer step `step` + 1 (global_step == step): an exception that ends a
    run inside fit."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"injected fault at step {self.step}")


class RecordTokens(Callback):
    """Appends {"step", "rank", "tokens": the micro-batch's input ids (B, T), "ready": Lightning's count of the
    epoch's micro-batches, this one included} of every micro-batch to
    `out`.rank<r>.jsonl, and saves the model's weights as training starts to `out`.start.pt (rank 0): what a
    context-extension stage starts from and reads (tests/parallel/test_context_extension.py); a resumed attempt keeps
    the first attempt's."""

    def __init__(self, out: str):
        self.out = out

    def on_train_start(self, trainer, pl_module):
        if trainer.is_global_zero and not Path(f"{self.out}.start.pt").exists():
            import torch

            torch.save({k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}, f"{self.out}.start.pt")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with open(f"{self.out}.rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "rank": trainer.global_rank, "tokens": batch[0].tolist(),
                                "ready": trainer.fit_loop.epoch_loop.batch_progress.current.ready}) + "\n")
