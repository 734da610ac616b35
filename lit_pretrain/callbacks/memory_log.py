"""Callback: at the first optimizer step every rank measures what it holds; rank 0 writes memory.json and a table.

Measured in the run itself, on the real strategy, batch and activation checkpointing policy (see memory.py for
exactly what each number counts). One step is enough: model state and saved activations do not change size.
"""

import json
from pathlib import Path

import lightning as L
import torch.distributed as dist

from lit_pretrain.parallel.memory import SavedActivations, gathered_param_bytes, rank_state_bytes
from lit_pretrain.planning.batch import layout_line
from lit_pretrain.planning.plan import DEGREE_KEYS


def layout_record(plan, preset: str) -> dict:
    """memory.json's account of what ran: the layout the plan applied, every degree (a preset's name alone, e.g. ddp
    for a context-parallel run started from strategy=ddp, hides the split), and the preset the config started from."""
    return {"strategy": layout_line(plan), "strategy_preset": preset, "zero_stage": plan.zero_stage,
            **{k: getattr(plan, k) for k in (*DEGREE_KEYS, "expert_parallel")}}


FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "gathered_param_bytes", "saved_activation_bytes")


class MemoryAccounting(L.Callback):
    def __init__(self, run_dir: Path, describe: dict):
        self.run_dir, self.describe = Path(run_dir), describe
        self._meter, self._in_step, self.ranks = None, {}, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.ranks is None and self._meter is None and not self._in_step:
            self._meter = SavedActivations(pl_module.model).__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        if self._meter is None:
            return
        self._meter.__exit__(None, None, None)
        # Forward has ended, backward has not begun: the parameters FSDP keeps gathered for backward are held now.
        self._in_step = {"saved_activation_bytes": self._meter.bytes,
                         "gathered_param_bytes": gathered_param_bytes(pl_module.model)}
        self._meter = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.ranks is not None or trainer.global_step < 1 or not self._in_step:
            return
        mine = {"rank": trainer.global_rank, **rank_state_bytes(pl_module.model, trainer.optimizers[0]),
                **self._in_step}
        ranks = [None] * trainer.world_size
        if dist.is_available() and dist.is_initialized():
            dist.all_gather_object(ranks, mine)
        else:
            ranks = [mine]
        self.ranks = ranks
        if trainer.is_global_zero:
            (self.run_dir / "memory.json").write_text(json.dumps({**self.describe, "ranks": ranks}, indent=2) + "\n")
            print(table(ranks))


def table(ranks: list) -> str:
    head = "rank " + " ".join(f"{f:>24}" for f in FIELDS)
    rows = [f"{r['rank']:>4} " + " ".join(f"{r[f]:>24,}" for f in FIELDS) for r in ranks]
    return "\nbytes held per rank at the first optimizer step (parallel/memory.py says what each counts)\n" + \
        "\n".join([head, *rows])


