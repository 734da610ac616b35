"""Weighted mixtures of sources (data.sources): which source each global window slot draws from, and which window.

The run's data order is one global sequence of window slots (slot i is trained in global step i // samples_per_step,
read by rank i % W inside its micro-batch, as in datamodule.GlobalOrderSampler). Slot i's source is a pure function
of (i, weights, schedule): never of the world size, so 1 and 2 processes see the same global batches.

Interleave: each phase of the schedule turns its weights into integer slot counts a_k per period of P = sum a_k
(about 2^16) slots, and orders one period by deadlines: source k's j-th slot of the period sits at (j + 1/2) / a_k
of it (the Sainte-Laguë / Webster divisor sequence), ties to the lower source index. Every prefix of a phase then
holds each source within a couple of slots of its exact share (tests/data/test_mixture.py measures the bound), so even
one global batch carries the mix, unlike independent random draws whose error grows as sqrt(n).

Windows: the c-th slot of source k (c counted over the whole run) is position c mod N_k of permutation
c div N_k of its N_k train windows, seeded by (seed, source name, that epoch). So the per-source draw counts at a
slot are all the state a resume needs, and they too are a pure function of the slot (TrainLoader.state_dict
records them, and a resume checks them).

A stage on a new mixture (data.sources changed on resume, docs/data.md "Annealing on a new mixture") begins its own
interleave at the checkpoint's slot: `MixtureOrder.rebase` takes that slot and each source's draws so far, so a
source named before continues at its next unseen window, a new one starts at its first, and one the stage leaves out
is carried (MixtureSampler.carried) for a later stage that names it again, as OLMo 2's mid-training stage (Team OLMo
2024, §4) keeps its pretraining mixture resumable.
"""

import hashlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import Dataset, Sampler

from lit_pretrain.errors import ConfigError, DataError

PERIOD = 1 << 16  # slots per interleave period: weights are kept to 1/65,536 of the whole


def slot_counts(weights: Sequence[float]) -> np.ndarray:
    """Integer slots per period for each source: weights over their sum × PERIOD, rounded; a positive weight never
    rounds down to no slot at all."""
    w = np.asarray(weights, dtype=np.float64)
    counts = np.rint(w / w.sum() * PERIOD).astype(np.int64)
    counts[(w > 0) & (counts == 0)] = 1
    return counts


def interleave(counts: np.ndarray) -> np.ndarray:
    """Source index of each slot of one period (length counts.sum()), in deadline order (module docstring)."""
    ids = np.repeat(np.arange(len(counts)), counts)
    j = np.concatenate([np.arange(c) for c in counts])
    # (2j+1)/(2a) with both below 2^18: two different fractions differ by more than float64's spacing near 1, and
    # equal fractions round alike, so the float order is the exact rational order on every machine.
    key = (2 * j + 1) / (2.0 * counts[ids])
    return ids[np.lexsort((ids, key))].astype(np.int32)


def source_seed(seed: int, name: str, epoch: int) -> int:
    """A generator seed per (run seed, source, epoch of that source), unrelated across any of the three."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}:{epoch}".encode()).digest()[:8], "little") >> 1


class MixtureOrder:
    """The global slot sequence of a mixture: source and window of every slot (module docstring).

    `phases`: [(first optimizer step, weights by source index)], the first at step 0; `samples_per_step`: global
    windows per optimizer step (micro_batch_size × data-parallel size × accumulation), which places the schedule's
    steps on slots; `max_epochs`: per source, passes allowed (None: no limit); `keys`: the config key per source.
    """

    def __init__(self, names: Sequence[str], sizes: Sequence[int], phases: Sequence[Tuple[int, Sequence[float]]],
                 samples_per_step: int, seed: int, max_epochs: Optional[Sequence[Optional[float]]] = None,
                 keys: Optional[Sequence[str]] = None):
        self.names, self.sizes, self.seed = list(names), np.asarray(sizes, dtype=np.int64), seed
        self.samples_per_step = samples_per_step
        self.max_epochs = list(max_epochs) if max_epochs is not None else [None] * len(names)
        self.keys = list(keys) if keys is not None else [f"data.sources[{k}]" for k in range(len(names))]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])  # source k's windows in the concatenated set
        self._declared = [(step * samples_per_step, slot_counts(w)) for step, w in phases]
        self._perms: Dict[Tuple[int, int], np.ndarray] = {}
        self.rebase(0)

    def rebase(self, slot: int, draws: Optional[Sequence[int]] = None) -> None:
        """Begin this mixture at `slot`, each source having been given `draws` slots before it (None: none; a stage
        on a new mixture passes the previous mixture's, module docstring). The weights in force at `slot` start a
        fresh interleave period there; later schedule entries keep their steps."""
        self.first_slot = slot
        self.base_draws = np.zeros(len(self.names), dtype=np.int64) if draws is None else np.asarray(draws, np.int64)
        at = [counts for first, counts in self._declared if first <= slot][-1]
        later = [(first, counts) for first, counts in self._declared if first > slot]
        # (first slot, slots per period per source, one period's sources)
        self.phases = [(first, counts, interleave(counts)) for first, counts in [(slot, at), *later]]

    def _phase_spans(self, start: int, stop: int):
        """(first slot, slots per period, one period's sources, lo, hi) of each phase that [start, stop) meets, with
        [lo, hi) the part of [start, stop) inside it."""
        for p, (first, counts, pattern) in enumerate(self.phases):
            end = self.phases[p + 1][0] if p + 1 < len(self.phases) else None
            lo, hi = max(start, first), stop if end is None else min(stop, end)
            if lo < hi:
                yield first, counts, pattern, lo, hi

    def draws_before(self, slot: int) -> np.ndarray:
        """Slots each source has been given before `slot` (its per-source position in the run; `slot` at or after
        the mixture's first)."""
        out = self.base_draws.copy()
        for first, counts, pattern, _, hi in self._phase_spans(self.first_slot, slot):
            full, rest = divmod(hi - first, len(pattern))
            out += full * counts + np.bincount(pattern[:rest], minlength=len(counts))
        return out

    def sources(self, start: int, stop: int) -> Tuple[np.ndarray, np.ndarray]:
        """(source index, that source's draw count) of every slot in [start, stop); source -1 before the mixture's
        first slot (trained under an earlier stage's mixture: never read again)."""
        src = np.full(stop - start, -1, dtype=np.int64)
        for first, _, pattern, lo, hi in self._phase_spans(start, stop):
            src[lo - start: hi - start] = pattern[(np.arange(lo, hi) - first) % len(pattern)]
        draw = np.zeros_like(src)
        base = self.draws_before(max(start, self.first_slot))
        for k in range(len(self.names)):
            mask = src == k
            draw[mask] = base[k] + np.arange(int(mask.sum()))
        return src, draw

    def windows(self, start: int, stop: int) -> np.ndarray:
        """Indices into the concatenated train windows of slots [start, stop); -(k + 1) where source k would go past
        its max_epochs (MixtureWindows turns that into the error, when and if such a slot is read)."""
        src, draw = self.sources(start, stop)
        out = np.full_like(src, -(len(self.names) + 1))  # MixtureWindows' marker of a slot before this mixture
        epoch = draw // self.sizes[src]
        for k, e in sorted(set(zip(src.tolist(), epoch.tolist())) - {(-1, 0)}):
            mask = (src == k) & (epoch == e)
            out[mask] = self.offsets[k] + self.permutation(k, e)[draw[mask] - e * self.sizes[k]]
        for k, limit in enumerate(self.max_epochs):
            if limit is not None:
                out[(src == k) & (draw >= limit * self.sizes[k])] = -(k + 1)
        return out

    def permutation(self, k: int, epoch: int) -> np.ndarray:
        if (k, epoch) not in self._perms:
            if len(self._perms) > 4 * len(self.names):
                self._perms.clear()  # an epoch's permutations are needed only while its slots are read
            generator = torch.Generator().manual_seed(source_seed(self.seed, self.names[k], epoch))
            self._perms[(k, epoch)] = torch.randperm(int(self.sizes[k]), generator=generator).numpy()
        return self._perms[(k, epoch)]

    def check_max_epochs(self, slots: int) -> None:
        """A ConfigError naming the source's key when its first `slots` slots would pass its max_epochs."""
        draws = self.draws_before(slots)
        for k, limit in enumerate(self.max_epochs):
            if limit is not None and draws[k] > limit * self.sizes[k]:
                raise ConfigError(exhausted_message(self.keys[k], limit, draws[k] / self.sizes[k], slots
                                                    // self.samples_per_step))

    def state(self, slot: int) -> Dict[str, Dict[str, int]]:
        """Per-source draws, epoch and position in that epoch at `slot` (for the resume state and the record)."""
        draws = self.draws_before(slot)
        return {name: {"draws": int(d), "epoch": int(d // n), "position": int(d % n)}
                for name, d, n in zip(self.names, draws, self.sizes)}


def exhausted_message(key: str, limit: float, epochs: float, steps: int) -> str:
    return (f"{key}.max_epochs={limit}: {steps} steps of this mixture take {epochs:.2f} epochs of that source: "
            f"raise {key}.max_epochs, lower its weight, or train fewer steps")


class MixtureWindows(Dataset):
    """The sources' windows (datamodule.ShardWindows each) as one index space, source k's at offsets[k]."""

    def __init__(self, parts: List[Dataset], keys: Optional[List[str]] = None,
                 max_epochs: Optional[List[Optional[float]]] = None):
        self.parts = parts
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).tolist()
        self.keys = keys or [f"data.sources[{k}]" for k in range(len(parts))]
        self.max_epochs = max_epochs or [None] * len(parts)

    def __len__(self) -> int:
        return self.offsets[-1]

    def source_of(self, index: int) -> int:
        return int(np.searchsorted(self.offsets, index, side="right")) - 1

    def __getitem__(self, index: int):
        if index < -len(self.keys):  # MixtureOrder.windows' marker of a slot before a stage's mixture began
            raise DataError("the data order read a slot trained before this stage's mixture began: resume from the "
                            "stage's own checkpoints (run.resume) rather than rewinding past its first step")
        if index < 0:  # MixtureOrder.windows' marker of a slot past the source's max_epochs
            key, limit = self.keys[-index - 1], self.max_epochs[-index - 1]
            raise DataError(f"{key}.max_epochs={limit}: the data order went past that many passes over the source "
                            f"(batches skipped after a loss spike count too): raise {key}.max_epochs or lower its "
                            "weight")
        k = self.source_of(index)
        return self.parts[k][index - self.offsets[k]]


class MixtureSampler(Sampler[int]):
    """GlobalOrderSampler's interface over a MixtureOrder: rank `rank` of `world_size` reads global positions
    rank, rank + W, ... of each epoch. An epoch here is only a stretch of the run's slots (about one pass over all
    sources' windows, a whole number of optimizer steps); the order runs on across epochs without a seam."""

    def __init__(self, order: MixtureOrder, micro_batch_size: int, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.order, self.rank, self.world_size, self.seed = order, rank, world_size, order.seed
        self.global_batch_size = micro_batch_size * world_size
        if order.samples_per_step % self.global_batch_size:
            raise ValueError(f"{order.samples_per_step} windows per step is not a multiple of the global micro-batch "
                             f"{self.global_batch_size}")
        per_step = order.samples_per_step
        self.samples_per_epoch = max(1, int(order.sizes.sum()) // per_step) * per_step
        self.num_windows = int(order.sizes.sum())
        self.epoch = 0
        self.start = 0
        self.carried: Dict[str, int] = {}
        """Draws of sources an earlier stage named and this mixture does not: kept for a later stage that does."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def slot(self, epoch: int, samples: int) -> int:
        """The run's slot index of global position `samples` of epoch `epoch`."""
        return epoch * self.samples_per_epoch + samples

    def global_order(self, epoch: int) -> torch.Tensor:
        first = self.slot(epoch, 0)
        return torch.from_numpy(self.order.windows(first, first + self.samples_per_epoch))

    def __iter__(self) -> Iterator[int]:
        return iter(self.global_order(self.epoch)[self.start + self.rank:: self.world_size].tolist())

    def __len__(self) -> int:
        return self.samples_per_epoch // self.world_size

    def source_state(self, epoch: int, samples: int) -> Dict[str, Dict[str, int]]:
        return self.order.state(self.slot(epoch, samples))

    def resume_state(self, epoch: int, samples: int) -> Dict:
        """What a checkpoint records of the mixture: each source's position, the epoch's length, where this mixture
        began (slot and draws: a stage's resume rebuilds it) and the carried sources' draws."""
        order = self.order
        return {"sources": self.source_state(epoch, samples), "samples_per_epoch": self.samples_per_epoch,
                "mixture_start": {"slot": order.first_slot,
                                  "draws": dict(zip(order.names, order.base_draws.tolist()))},
                "carried": dict(self.carried)}

    def restore(self, state: Dict, new_mixture: bool = False) -> None:
        """Continue from a checkpoint's loader state (TrainLoader.load_state_dict). The mixture it recorded, or this
        config's where it gives the same per-source positions at the checkpoint (a schedule entry changed after its
        step), continues; otherwise, with `new_mixture` (data.sources in run.resume_allow_changes), this mixture
        begins at the checkpoint from each source's draws (module docstring); otherwise the resume is refused."""
        epoch, samples, saved = int(state["epoch"]), int(state["trained_samples"]), state["sources"]
        if "samples_per_epoch" in state:
            # The epoch's length stays the one the run started with, whatever a stage's sources hold: the
            # checkpoint's position within its epoch, and Lightning's count of the epoch's batches, keep meaning.
            per_epoch = int(state["samples_per_epoch"])
            if per_epoch % self.order.samples_per_step:
                raise ConfigError(f"trainer.tokens_per_step: the checkpoint's mixture epoch of {per_epoch} windows is "
                                  f"not a whole number of steps of {self.order.samples_per_step} windows: resume "
                                  "with the checkpoint's trainer.tokens_per_step")
            self.samples_per_epoch = per_epoch
        start = state.get("mixture_start")
        if start is not None and set(start["draws"]) == set(self.order.names):
            self.order.rebase(int(start["slot"]), [int(start["draws"][n]) for n in self.order.names])
        self.carried = {n: int(d) for n, d in state.get("carried", {}).items()}
        now = self.source_state(epoch, samples)
        if now == saved:
            return
        if not new_mixture:
            raise ConfigError(
                f"data.sources / data.mixture_schedule: at the checkpoint the run had drawn {saved}, this config "
                f"gives {now}: set the weights back, or change data.mixture_schedule only after the checkpoint's "
                "step (a stage on a new mixture lists data.sources in run.resume_allow_changes)")
        if "samples_per_epoch" not in state:
            raise ConfigError("data.sources: the checkpoint predates per-source stage positions (its loader state "
                              "has no samples_per_epoch): train a step under its own mixture, then start the stage")
        draws = {**self.carried, **{name: int(s["draws"]) for name, s in saved.items()}}
        self.order.rebase(self.slot(epoch, samples), [draws.get(n, 0) for n in self.order.names])
        self.carried = {n: d for n, d in draws.items() if n not in self.order.names}
        if self.rank == 0:
            each = ", ".join(f"{n} after {draws[n]} windows" if n in draws else f"{n} from its first"
                             for n in self.order.names)
            kept = "".join(f"; {n} kept after {d} windows" for n, d in self.carried.items())
            print(f"data: a new mixture from this checkpoint: {each}{kept}", flush=True)


class MixtureMetrics(Callback):
    """Logs data/<source>/tokens_seen and data/<source>/epochs at the module's logging steps: what the data order
    has handed to training so far (trained batches, plus any a loss-spike rewind skipped)."""

    def on_train_start(self, trainer, pl_module) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._step or not pl_module.logs_at(step):
            return  # mid-accumulation, or not a logging step
        self._step = step
        for name, entry in trainer.datamodule.source_progress().items():
            pl_module.log(f"data/{name}/tokens_seen", float(entry["tokens_seen"]))
            if "epochs" in entry:  # (a source carried from an earlier stage has no size here)
                pl_module.log(f"data/{name}/epochs", float(entry["epochs"]))
