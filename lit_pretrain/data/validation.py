"""The validation set: one fixed set of windows, the same for any number of processes and any layout.

`trainer.val_windows` counts windows in all (of each source, for a mixture): the first min(val_windows, split size)
windows of the validation split. Data-parallel rank r of W takes windows r, r + W, r + 2W, ... in batches of
micro_batch_size. Every batch is full: where W does not divide the count, or a rank's share does not fill its last
batch, the places left hold a padding window (PAD) whose targets are all IGNORE_INDEX. It is run, so every rank runs
the same number of batches of micro_batch_size windows (FSDP's and tensor parallelism's collectives in the forward
need the same number of forwards on every rank, and a pipeline splits each batch into its micro-batches), but it
predicts nothing, so neither nats nor tokens of it count. The loss is the total nats over the total predicted
tokens of the whole set, each summed across ranks (PretrainModule.validation_step): the same number for any W, up to
the order of the sums.

Before this, trainer.val_batches counted batches per device: 2 processes validated twice the windows 1 process did,
and after resharding a run from 2 processes to 1 its validation loss moved by 0.014 while training losses matched
within 5e-7.
"""

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch.utils.data import Dataset

from lit_pretrain.model.losses import IGNORE_INDEX

PAD = None  # a padding place in a rank's batch (PaddedWindows gives a window that predicts nothing)


def val_batches(sizes: Sequence[int], offsets: Sequence[int], windows: int, micro_batch_size: int, rank: int,
                world_size: int) -> Tuple[List[List[Optional[int]]], List[int]]:
    """This rank's validation batches, each from one source (a single corpus: one source of `sizes[0]` windows at
    offset 0), and the source index of each. Per source k: its first n = min(windows, sizes[k]) windows, rank r
    taking every W-th from r, padded (PAD) to ceil(n / W) rounded up to a whole batch. Every rank gets the same
    number of full batches of each source, in the same order."""
    batches, sources = [], []
    for k, (size, offset) in enumerate(zip(sizes, offsets)):
        n = min(windows, size)
        per_rank = math.ceil(math.ceil(n / world_size) / micro_batch_size) * micro_batch_size
        places = per_rank * world_size
        mine = [offset + i if i < n else PAD for i in range(rank, places, world_size)]
        for i in range(0, len(mine), micro_batch_size):
            batches.append(mine[i: i + micro_batch_size])
            sources.append(k)
    return batches, sources


class PaddedWindows(Dataset):
    """`windows` (a split's ShardWindows or MixtureWindows) with PAD read as a window that predicts nothing: the
    first window's inputs, every target IGNORE_INDEX."""

    def __init__(self, windows: Dataset):
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        if index is PAD:
            x, y = self.windows[0]
            return x, torch.full_like(y, IGNORE_INDEX)
        return self.windows[index]
