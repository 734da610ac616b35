"""The global order read under trainer.batch_schedule: one micro-batch size per optimizer step.

Lightning steps the optimizer every accumulate_grad_batches micro-batches of its epoch (one number per fit), so a
growing batch grows the micro-batch: step s of G_s windows is A micro-batches of G_s / A global windows each, every
data-parallel rank reading G_s / (A·W) of them. Micro-batch j of step s on every rank together is the contiguous
range [before(s) + j·G_s/A, before(s) + (j+1)·G_s/A) of the order (planning/batch_schedule.StepWindows), rank r
reading its positions r, r + W, ... as GlobalOrderSampler's ranks do, so step s holds the windows
[before(s), before(s + 1)) under every layout: another process count or accumulation splits the same windows.

An epoch is the whole steps whose windows fit in it; a run under a schedule stays within one epoch (train() checks
max_steps against it), since Lightning sizes an epoch once per fit and the steps of a later epoch would be others.
"""

from typing import Iterator, List, Tuple

import numpy as np
from torch.utils.data import Sampler

from lit_pretrain.errors import ConfigError
from lit_pretrain.planning.batch_schedule import StepWindows


class ScheduledOrderSampler(Sampler[List[int]]):
    """A GlobalOrderSampler's order (`base`, of global micro-batch 1: its order and its rank's positions) read in
    micro-batches of each step's size: a batch sampler (it yields this rank's window indices of one micro-batch at a
    time)."""

    def __init__(self, base, steps: StepWindows, accumulation: int):
        self.base, self.steps, self.accumulation = base, steps, accumulation
        self.rank, self.world_size, self.shuffle = base.rank, base.world_size, base.shuffle
        self.num_windows = base.num_windows
        self.steps_per_epoch = steps.steps_within(self.num_windows)
        self.samples_per_epoch = steps.before(self.steps_per_epoch)
        self.epoch = 0
        self.start = 0  # global position this epoch's iteration starts from (a resumed epoch starts mid-way)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_order(self, epoch: int):
        return self.base.global_order(epoch)

    def windows_at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        return self.base.windows_at(epoch, positions)

    def micro_span(self, micro_batch: int) -> Tuple[int, int]:
        """(first global position, global windows) of micro-batch `micro_batch` of the epoch."""
        step, j = divmod(micro_batch, self.accumulation)
        size = self.steps.size(step) // self.accumulation
        return self.steps.before(step) + j * size, size

    def micro_at(self, samples: int) -> int:
        """The micro-batch that starts at global position `samples`; a ConfigError where none does."""
        step, offset = self.steps.locate(samples)
        size = self.steps.size(step) // self.accumulation
        if offset % size:
            raise ConfigError(f"the checkpoint's data position ({samples} global windows, {offset} into step "
                              f"{step}) is not a whole number of micro-batches of {size} windows on this layout: "
                              "resume with a trainer.micro_batch_size x devices that divides it")
        return step * self.accumulation + offset // size

    def windows_of(self, epoch: int, micro_batch: int, order=None) -> List[int]:
        """This rank's window indices of micro-batch `micro_batch` (`order`: the epoch's global order, when held)."""
        first, size = self.micro_span(micro_batch)
        positions = first + self.rank + self.world_size * np.arange(size // self.world_size)
        if self.shuffle == "feistel":
            return self.windows_at(epoch, positions).tolist()
        order = self.global_order(epoch) if order is None else order
        return order[positions].tolist()

    def __iter__(self) -> Iterator[List[int]]:
        order = None if self.shuffle == "feistel" else self.global_order(self.epoch)
        for m in range(self.micro_at(self.start), len(self)):
            yield self.windows_of(self.epoch, m, order)

    def __len__(self) -> int:
        return self.steps_per_epoch * self.accumulation
