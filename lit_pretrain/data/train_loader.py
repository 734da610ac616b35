"""The training DataLoader plus the two things a loss-spike rewind needs from the data: which windows each batch
holds, and dropping the next batches so an offending stretch of data is not trained on.

Positions follow the global order of `GlobalOrderSampler`: rank r's micro-batch j of an epoch holds global positions
r + W·(j·B + i), i < B, so micro-batch j on every rank together is the contiguous range [j·B·W, (j+1)·B·W). Dropping
the same n micro-batches on every rank therefore drops one contiguous range of the global order, whatever W is.
"""

from collections import deque
from typing import Deque, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader

from lit_pretrain.data.permutation import CHUNK
from lit_pretrain.errors import ConfigError


class TrainLoader(DataLoader):
    """A DataLoader over a `GlobalOrderSampler` that records the window indices of each batch it hands out and can
    drop batches that have not been handed out yet.

    Drops happen here, where batches leave the loader, not in the sampler: with worker processes the sampler runs
    several batches ahead, and dropping at the consumer side is exact whatever the prefetch depth.
    """

    def __init__(self, dataset, sampler, batch_size: int, **kwargs):
        if hasattr(sampler, "micro_span"):  # trainer.batch_schedule: each step's micro-batch size (data/scheduled.py)
            super().__init__(dataset, batch_sampler=sampler, **kwargs)
        else:
            super().__init__(dataset, sampler=sampler, batch_size=batch_size, drop_last=True, **kwargs)
        self.order = sampler
        """The sampler of the global order (DataLoader's `sampler` is its own default under a batch sampler)."""
        self._base = None
        self._epoch = 0
        self._position = 0  # micro-batches taken from the base iterator this epoch (handed out or dropped)
        self._pending_drop = 0
        self._handed_out: Deque[List[int]] = deque()  # window indices of batches handed out, not yet trained on
        self._order_cache: Dict[int, torch.Tensor] = {}
        self._chunks: Dict[Tuple[int, int], np.ndarray] = {}  # data.shuffle=feistel: (epoch, chunk) → windows
        self.in_flight = 0  # 1 while a checkpoint is taken at the start of a batch that is not trained on yet
        self._resume_samples: Dict[int, int] = {}  # epoch → global samples already trained on (from a checkpoint)
        self.dropped: List[Dict] = []
        """Every drop: {"epoch", "micro_batches", "global_positions": [start, end)} of the global order."""
        self.new_mixture = False
        """A mixture may begin anew at the checkpoint this loader resumes (a stage: MixtureSampler.restore)."""

    def __iter__(self):
        # A resumed epoch starts where the checkpoint's trained samples end (set before the base iterator asks the
        # sampler for its order). Lightning creates a resumed run's iterator before it sets the sampler's epoch
        # (FitLoop.setup_data, then on_advance_start), so the epoch is the checkpoint's, set here: keyed by the
        # sampler's epoch, a run resumed in its second epoch read that epoch from its start again. A checkpoint
        # whose epoch was trained to its end continues with the next epoch, as Lightning's own counts do. The
        # sampler draws its order at the first fetch, after Lightning's set_epoch (its count of finished epochs):
        # the two agree only while the checkpoint's loop counters do (resume/checkpointing.py keeps them so), and
        # `window_indices` reports this loader's epoch either way.
        epoch, start = next(iter(self._resume_samples.items()), (self.order.epoch, 0))
        self._resume_samples.clear()
        if start >= self.order.samples_per_epoch:
            epoch, start = epoch + 1, 0
        self.order.set_epoch(epoch)
        self.order.start = start
        self._base = super().__iter__()
        self._epoch, self._position = self.order.epoch, self._micro_at(start)
        self._handed_out.clear()
        self._order_cache = {k: v for k, v in self._order_cache.items() if k == self._epoch}
        self._drop_pending()
        return self._batches()

    def _batches(self):
        while True:
            try:
                batch = next(self._base)
            except StopIteration:
                return
            self._handed_out.append(self.window_indices(self._epoch, self._position))
            self._position += 1
            yield batch

    def window_indices(self, epoch: int, micro_batch: int) -> List[int]:
        """Dataset indices of this rank's micro-batch `micro_batch` in epoch `epoch`."""
        s, b = self.order, self.batch_size
        if hasattr(s, "micro_span"):
            return s.windows_of(epoch, micro_batch, None if s.shuffle == "feistel" else self._order(epoch))
        if getattr(s, "shuffle", "stored") == "feistel":  # computed per position: no epoch's order held
            return self._computed_indices(epoch, micro_batch * b + np.arange(b)).tolist()
        if epoch not in self._order_cache:
            self._order_cache[epoch] = self.order.global_order(epoch)
        return self._order_cache[epoch][s.rank :: s.world_size][micro_batch * b : (micro_batch + 1) * b].tolist()

    def _order(self, epoch: int):
        if epoch not in self._order_cache:
            self._order_cache[epoch] = self.order.global_order(epoch)
        return self._order_cache[epoch]

    def _span_start(self, micro_batch: int) -> int:
        """Global position where this epoch's micro-batch `micro_batch` starts."""
        if hasattr(self.order, "micro_span"):
            return self.order.micro_span(micro_batch)[0]
        return micro_batch * self.batch_size * self.order.world_size

    def _micro_at(self, samples: int) -> int:
        """The micro-batch of this epoch that starts at global position `samples`."""
        if hasattr(self.order, "micro_at"):
            return self.order.micro_at(samples)
        return samples // (self.batch_size * self.order.world_size)

    def _computed_indices(self, epoch: int, local: np.ndarray) -> np.ndarray:
        """data.shuffle=feistel: the windows at this rank's positions `local` of the epoch (global positions rank +
        W·local), from chunks of CHUNK positions computed at once and the last two kept (one call per batch cost
        a network evaluation per batch, a third of the loader's time at 8 windows a batch)."""
        s, out = self.order, np.empty(len(local), dtype=np.int64)
        chunks = local // CHUNK
        for c in np.unique(chunks).tolist():
            if (epoch, c) not in self._chunks:
                if len(self._chunks) >= 2:
                    self._chunks.pop(next(iter(self._chunks)))
                lo, hi = c * CHUNK, min((c + 1) * CHUNK, len(s))
                self._chunks[(epoch, c)] = s.windows_at(epoch, s.rank + s.world_size * np.arange(lo, hi))
            here = chunks == c
            out[here] = self._chunks[(epoch, c)][local[here] - c * CHUNK]
        return out

    def take_trained_indices(self) -> Optional[List[int]]:
        """Window indices of the oldest batch handed out and not yet claimed: the one being trained on, when called
        once per batch as training consumes it (batches are consumed in the order they are handed out)."""
        return self._handed_out.popleft() if self._handed_out else None

    def drop(self, micro_batches: int) -> None:
        """Drop this rank's next `micro_batches` batches not yet handed out (now, or at the next epoch's start)."""
        if micro_batches < 0:
            raise ValueError(f"cannot drop {micro_batches} micro-batches")
        self._pending_drop += micro_batches
        if self._base is not None:
            self._drop_pending()

    def _drop_pending(self) -> None:
        start = self._position
        while self._pending_drop > 0:
            try:
                next(self._base)
            except StopIteration:
                break  # the rest is dropped from the start of the next epoch
            self._position += 1
            self._pending_drop -= 1
        if self._position > start:
            self.dropped.append({"epoch": self._epoch, "micro_batches": self._position - start,
                                 "global_positions": [self._span_start(start), self._span_start(self._position)]})

    def trained_samples(self) -> int:
        """Global samples of this epoch trained on so far: micro-batches taken minus those prefetched but not yet
        trained on, times the global micro-batch (every rank is at the same micro-batch)."""
        trained = self._position - len(self._handed_out) - self.in_flight
        return self._span_start(trained)

    def mid_epoch(self) -> bool:
        """Whether this epoch has windows left that were not trained on (a prefetched batch is not trained on)."""
        return self._base is not None and 0 < self.trained_samples() < self.order.samples_per_epoch

    def position(self) -> Tuple[int, int]:
        """(epoch, global samples of it trained on so far); before the first batch of a resumed run, the
        checkpoint's."""
        if self._base is None and self._resume_samples:
            return next(iter(self._resume_samples.items()))
        return self._epoch, self.trained_samples()

    def state_dict(self) -> Dict:
        # Lightning saves this with every checkpoint (a stateful loader) and restores it before iterating. Positions
        # are global samples, so a run resumed on another number of ranks continues the same global order.
        pending = self._span_start(self._position + self._pending_drop) - self._span_start(self._position)
        state = {"pending_drop_samples": pending, "dropped": [dict(d) for d in self.dropped],
                 "epoch": self._epoch, "trained_samples": self.trained_samples()}
        if self.window_tokens is not None:  # what a sample is, so a stage at another seq_len can remap by tokens
            state["window_tokens"] = self.window_tokens
        if hasattr(self.order, "resume_state"):  # a mixture: each source's draws, epoch and position there
            state.update(self.order.resume_state(self._epoch, state["trained_samples"]))
        return state

    @property
    def window_tokens(self) -> Optional[int]:
        """Tokens of one sample (model.seq_len); None for a mixture, whose sources' positions are draws."""
        return getattr(self.dataset, "seq_len", None) if not hasattr(self.order, "source_state") else None

    def load_state_dict(self, state: Dict) -> None:
        state = remap_to_window(state, self.window_tokens)
        if hasattr(self.order, "micro_at"):  # trainer.batch_schedule: positions are read through the step map
            trained = int(state["trained_samples"])
            self._pending_drop = self.order.micro_at(trained + state["pending_drop_samples"]) - \
                self.order.micro_at(trained)
            self.dropped = [dict(d) for d in state["dropped"]]
            self._resume_samples = {int(state["epoch"]): trained}
            return
        per_step = self.batch_size * self.order.world_size
        for key in ("pending_drop_samples", "trained_samples"):
            if state[key] % per_step:
                raise ConfigError(
                    f"the checkpoint's data position ({key}={state[key]} global samples) is not a whole number of "
                    f"global micro-batches of {per_step} (trainer.micro_batch_size × devices): resume with a "
                    "micro_batch_size × devices that divides it")
        self._pending_drop = state["pending_drop_samples"] // per_step
        self.dropped = [dict(d) for d in state["dropped"]]
        self._resume_samples = {int(state["epoch"]): int(state["trained_samples"])}
        if hasattr(self.order, "restore"):
            if "sources" not in state:
                raise ConfigError("data.sources: the checkpoint was trained on a single corpus, not this mixture: "
                                  "resume with its data config, or start afresh")
            self.order.restore(state, self.new_mixture)


def remap_to_window(state: Dict, window_tokens: Optional[int]) -> Dict:
    """A loader state saved at another window length (a context-extension stage: model.seq_len changed), in samples
    of `window_tokens`. The order is one stream of tokens at any window length when data.shuffle_block_tokens is a
    multiple of both (datamodule.GlobalOrderSampler), so the position is remapped by its token offset in the epoch:
    trained_samples · old = trained_samples' · new, and the next window starts at the next unseen token."""
    old = state.get("window_tokens", window_tokens)
    if old == window_tokens or window_tokens is None:
        return state
    out = dict(state, window_tokens=window_tokens)
    for key in ("trained_samples", "pending_drop_samples"):
        tokens = state[key] * old
        if tokens % window_tokens:
            raise ConfigError(
                f"model.seq_len={window_tokens}: the checkpoint's data position ({key}={state[key]} windows of "
                f"{old} tokens = {tokens} tokens into epoch {state['epoch']}) is not a whole number of windows of "
                f"{window_tokens} tokens: extend from a checkpoint whose tokens trained divide by the new seq_len "
                "(a step count times trainer.tokens_per_step that does)")
        out[key] = tokens // window_tokens
    return out
