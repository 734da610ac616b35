"""Token shards → per-rank, deterministic batches of (x, y) next-token pairs.

A sample is a window of seq_len + 1 tokens, taken with stride seq_len inside one shard (windows never cross shards,
so no shard boundary has to be stitched): x = w[:-1], y = w[1:]. Windows span document boundaries; the EOD id marks
them.

The training order is one global sequence, the same for any number of ranks: epoch e is a permutation of all
train windows seeded by (seed, e), cut to a multiple of world_size * micro_batch_size. Rank r of W reads global
positions r, r + W, r + 2W, ..., so global step k reads positions [k*B*W, (k+1)*B*W) across the ranks: exactly the
batch a single process with a W-times larger micro-batch reads. Hence under data parallelism the set of windows per
optimizer step does not depend on W, and a position in the run is one number, the global samples consumed.
"""

import bisect
import dataclasses
import hashlib
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from lit_pretrain.data.mixture import MixtureOrder, MixtureSampler, MixtureWindows
from lit_pretrain.data.packing import PackedWindows, packing_report
from lit_pretrain.data.permutation import CHUNK, BlockTable, FeistelPermutation
from lit_pretrain.data.preparation.prepare import prepare
from lit_pretrain.data.pretokenized import is_pretokenized, open_corpus
from lit_pretrain.data.scheduled import ScheduledOrderSampler
from lit_pretrain.data.shards import SPLITS, TOKENIZER_FILE, check_config, load_manifest, open_shard, verify_shards
from lit_pretrain.data.tokenizer import load_tokenizer, token_byte_lengths
from lit_pretrain.data.train_loader import TrainLoader
from lit_pretrain.data.validation import PaddedWindows, val_batches
from lit_pretrain.errors import DataError
from lit_pretrain.planning.batch_schedule import step_windows
from lit_pretrain.runs.folder import is_primary_process


class ShardWindows(Dataset):
    """The windows of one split's shards. Memmaps open on first use in each process, so the dataset pickles small
    into spawned DataLoader workers (a pickled np.memmap would copy its whole shard). A shard may be a span of a
    file in another format (data/pretokenized.py): its entry then holds the byte "offset" and the "dtype"."""

    def __init__(self, folder, shards: List[Dict], dtype: str, seq_len: int):
        self.paths = [str(Path(folder) / s["file"]) for s in shards]
        self.spans = [(s.get("offset", 0), s["tokens"], s.get("dtype", dtype)) for s in shards]
        self.dtype, self.seq_len = dtype, seq_len
        # A shard of n tokens holds (n - 1) // seq_len windows of seq_len + 1 tokens at stride seq_len.
        counts = [max(0, (s["tokens"] - 1) // seq_len) for s in shards]
        self.starts = [0]
        for c in counts:
            self.starts.append(self.starts[-1] + c)
        self._maps: Dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range [0, {len(self)})")
        shard = bisect.bisect_right(self.starts, index) - 1  # skips shards with no window (equal starts)
        offset = (index - self.starts[shard]) * self.seq_len
        if shard not in self._maps:
            byte_offset, tokens, dtype = self.spans[shard]
            self._maps[shard] = open_shard(self.paths[shard], dtype, byte_offset, tokens, random_access=True)
        window = torch.from_numpy(self._maps[shard][offset : offset + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]  # (T,) inputs, (T,) next-token targets

    def block_windows(self, block_tokens: int) -> torch.Tensor:
        """Window indices of each block of block_tokens consecutive tokens (a multiple of seq_len) of each shard,
        (blocks, block_tokens // seq_len) int64: block j of a shard holds its windows k·j .. k·j + k - 1. A shard's
        n tokens hold (n - 1) // block_tokens blocks (each window reads one token past its block, as past itself)."""
        k = block_tokens // self.seq_len
        rows = []
        for first, (_, tokens, _) in zip(self.starts, self.spans):
            blocks = max(0, (tokens - 1) // block_tokens)
            rows.append(first + torch.arange(blocks * k, dtype=torch.int64).view(blocks, k))
        return torch.cat(rows) if rows else torch.empty(0, k, dtype=torch.int64)

    def block_table(self, block_tokens: int) -> BlockTable:
        """block_windows' rows as a rule, not a table (data.shuffle=feistel): O(shards) memory."""
        k = block_tokens // self.seq_len
        counts = [max(0, (tokens - 1) // block_tokens) for _, tokens, _ in self.spans]
        return BlockTable(np.asarray(self.starts[:-1], dtype=np.int64), np.asarray(counts, dtype=np.int64), k)

    def __getstate__(self):
        return {**self.__dict__, "_maps": {}}


def epoch_seed(seed: int, epoch: int) -> int:
    """A generator seed per (seed, epoch); hashing keeps (seed, epoch + 1) and (seed + 1, epoch) unrelated."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:8], "little") >> 1


class GlobalOrderSampler(Sampler[int]):
    """Rank `rank`'s share of the global training order (see the module docstring)."""

    def __init__(self, num_windows: int, micro_batch_size: int, rank: int, world_size: int, seed: int,
                 blocks=None, samples_per_step: Optional[int] = None, shuffle: str = "stored"):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        # data.shuffle_block_tokens: the permutation is of blocks (rows of window indices), each read in a row; a
        # (blocks, k) tensor, or for data.shuffle=feistel a BlockTable.
        self.blocks, self.shuffle = blocks, shuffle
        if blocks is not None:
            num_windows = blocks.numel() if shuffle == "stored" else len(blocks) * blocks.k
        self.num_windows, self.rank, self.world_size, self.seed = num_windows, rank, world_size, seed
        self.global_batch_size = micro_batch_size * world_size
        # An epoch is a whole number of optimizer steps (samples_per_step: the global windows of one step, the same
        # under every layout), and the remainder of the permutation is skipped. Rounded to the global micro-batch
        # instead, the epoch's length would depend on how the layout splits a step, and its last step would train on
        # part of an accumulation (Lightning steps the optimizer at an epoch's last batch).
        per_step = samples_per_step or self.global_batch_size
        if per_step % self.global_batch_size:
            raise ValueError(f"{per_step} windows per step is not a multiple of the global micro-batch "
                             f"{self.global_batch_size}")
        self.samples_per_epoch = num_windows // per_step * per_step
        self.epoch = 0
        self.start = 0  # global position this epoch's iteration starts from (a resumed epoch starts mid-way)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_order(self, epoch: int) -> torch.Tensor:
        """Window indices of epoch `epoch` in global order (the same for every rank and world size)."""
        if self.shuffle == "feistel":
            return torch.from_numpy(self.windows_at(epoch, np.arange(self.samples_per_epoch)))
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
        if self.blocks is None:
            return torch.randperm(self.num_windows, generator=generator)[: self.samples_per_epoch]
        order = torch.randperm(len(self.blocks), generator=generator)
        return self.blocks[order].flatten()[: self.samples_per_epoch]

    def windows_at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """data.shuffle=feistel: the window index at each global position of epoch `epoch`, computed from the
        position (data/permutation.py), so no order is held."""
        if getattr(self, "_perm_epoch", None) != epoch:
            units = self.num_windows if self.blocks is None else len(self.blocks)
            self._perm, self._perm_epoch = FeistelPermutation(units, epoch_seed(self.seed, epoch)), epoch
        positions = np.asarray(positions, dtype=np.int64)
        if self.blocks is None:
            return self._perm(positions)
        k = self.blocks.k
        return self.blocks.windows(self._perm(positions // k), positions % k)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle == "feistel":
            return self._computed(self.epoch, self.start)
        return iter(self.global_order(self.epoch)[self.start + self.rank :: self.world_size].tolist())

    def _computed(self, epoch: int, start: int) -> Iterator[int]:
        step = CHUNK * self.world_size
        for first in range(start + self.rank, self.samples_per_epoch, step):
            yield from self.windows_at(epoch, np.arange(first, min(first + step, self.samples_per_epoch),
                                                        self.world_size)).tolist()

    def __len__(self) -> int:
        return self.samples_per_epoch // self.world_size


class TokenShardDataModule(L.LightningDataModule):
    """Prepares (or reuses) `data.prepared_dir` and serves its train and validation windows."""

    def __init__(
        self,
        data,
        seq_len: int,
        micro_batch_size: int,
        seed: int,
        val_windows: int,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        accumulate_grad_batches: int = 1,
        new_mixture: bool = False,
        batch_schedule=(),
    ):
        super().__init__()
        for key, value in (("model.seq_len", seq_len), ("trainer.micro_batch_size", micro_batch_size),
                           ("trainer.val_windows", val_windows)):
            if value < 1:
                raise DataError(f"{key}={value} must be at least 1")
        self.data, self.seq_len, self.micro_batch_size = data, seq_len, micro_batch_size
        self.seed, self.val_windows = seed, val_windows
        self._rank, self._world_size = rank, world_size
        self._accumulate = accumulate_grad_batches  # without a Trainer; with one, the Trainer's
        self.new_mixture = new_mixture
        """A resume may begin a new mixture at its checkpoint (data.sources in run.resume_allow_changes: a stage)."""
        self.batch_schedule = list(batch_schedule)
        """trainer.batch_schedule: each step's windows by the step map (data/scheduled.py); []: a fixed batch."""
        self.source_manifests: Optional[List[Dict]] = None
        """A mixture's manifests, one per data.sources entry (None for a single corpus)."""
        self.val_batch_sources: Optional[List[int]] = None
        """A mixture: the source index of each of this rank's validation batches (module.validation_step)."""
        self._manifest: Optional[Dict] = None
        self._packed: Dict[str, PackedWindows] = {}
        self.train_dataset: Optional[ShardWindows] = None
        self.val_dataset: Optional[ShardWindows] = None
        self.train_sampler: Optional[GlobalOrderSampler] = None
        self.train_loader: Optional[TrainLoader] = None
        self.batch_indices: Optional[List[int]] = None
        """Window indices (into the train split) of the micro-batch this rank is training on now."""

    @property
    def prepared_dir(self) -> Path:
        return Path(self.data.prepared_dir)

    def rank_and_world_size(self) -> Tuple[int, int]:
        """From the attached Trainer when there is one, else from the constructor (default: 0 of 1)."""
        if self.trainer is not None:
            # Data-parallel rank and size (tensor- and pipeline-parallel ranks of one replica read the same batch).
            kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None)
            if kwargs:
                return kwargs["rank"], kwargs["num_replicas"]
            return self.trainer.global_rank, self.trainer.world_size
        return self._rank or 0, self._world_size or 1

    @property
    def manifest(self) -> Dict:
        """The prepared folder's manifest; for a mixture, combined_manifest of the sources'."""
        if self._manifest is None:
            if self.data.sources:
                self._use_sources([read_source(cfg) for cfg in source_configs(self.data)])
            else:
                self._manifest = read_source(self.data)
        return self._manifest

    @property
    def vocab_size(self) -> int:
        return self.manifest["tokenizer"]["vocab_size"]

    @property
    def eod_id(self) -> int:
        return self.manifest["tokenizer"]["eod_id"]

    @property
    def tokenizer_path(self) -> Path:
        folder = Path(source_configs(self.data)[0].prepared_dir) if self.data.sources else self.prepared_dir
        return folder / self.manifest["tokenizer"]["file"]

    @property
    def token_bytes(self) -> Optional[np.ndarray]:
        """UTF-8 bytes each token id stands for (tokenizer.token_byte_lengths), read by validation for bits per
        byte; None when the tokenizer is not byte-level. Built once from the vocabulary: no decoding per batch."""
        if not hasattr(self, "_token_bytes"):
            # eos_token=None: the prepared folder's tokens were checked by prepare (data.eos_token may be any).
            self._token_bytes = token_byte_lengths(load_tokenizer(self.tokenizer_path, eos_token=None))
        return self._token_bytes

    @property
    def source_names(self) -> List[str]:
        return [src.name for src in self.data.sources]

    def prepare_data(self) -> None:
        if self._manifest is None:  # once per process: train() prepares before Lightning calls this again
            # Every rank prepares (train() calls this before the launcher starts the others, which then verify and
            # reuse); rank 0 alone says so.
            log = print if is_primary_process() else _silent
            if not self.data.sources:
                self._manifest = open_corpus(self.data) if is_pretokenized(self.data) else prepare(self.data, log=log)
                return
            self._use_sources(prepare_sources(self.data, log))

    def _use_sources(self, manifests: List[Dict]) -> None:
        for i, m in enumerate(manifests[1:], start=1):
            same_tokenizer(m, manifests[0], i)
        self.source_manifests = manifests
        self._manifest = combined_manifest(self.source_names, manifests)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_dataset is not None:  # fit then validate calls setup twice
            return
        if self.data.sources:
            self._use_sources([read_source(cfg, verify=True) for cfg in source_configs(self.data)])
            _, world_size = self.rank_and_world_size()
            self.train_dataset, self.val_dataset = self.windows(self._manifest, world_size)
            return
        manifest = self._manifest = read_source(self.data, verify=True)
        _, world_size = self.rank_and_world_size()
        self.train_dataset, self.val_dataset = self.windows(manifest, world_size)

    def windows(self, manifest: Dict, world_size: int) -> Tuple[ShardWindows, ShardWindows]:
        """The train and validation windows; a DataError when they hold less than one global batch. train() calls
        it before the run folder is made, with the data-parallel size, so such a start leaves nothing behind."""
        if self.data.sources:
            return self._mixture_windows(world_size)
        train = self._train_windows(self.prepared_dir, manifest)
        val = ShardWindows(self.prepared_dir, manifest["splits"]["val"]["shards"], manifest["dtype"], self.seq_len)
        # An epoch is a whole number of optimizer steps (GlobalOrderSampler): the split must hold one step's windows.
        per_step = world_size * self.micro_batch_size * self._accumulate
        step = (f"one optimizer step ({per_step} windows: {world_size} ranks x trainer.micro_batch_size="
                f"{self.micro_batch_size} x {self._accumulate} accumulated, trainer.tokens_per_step / model.seq_len)")
        if len(train) < per_step:
            raise DataError(
                f"the train split has {len(train)} windows of model.seq_len+1={self.seq_len + 1} tokens, fewer than "
                f"{step}: lower model.seq_len or trainer.tokens_per_step, or use a larger corpus"
            )
        block = self.data.shuffle_block_tokens
        if block not in (None, self.seq_len) and len(train.block_windows(block)) * (block // self.seq_len) < per_step:
            raise DataError(
                f"the train split's whole blocks of data.shuffle_block_tokens={block} tokens hold fewer windows than "
                f"{step}: lower data.shuffle_block_tokens, or use a larger corpus")
        if len(val) < 1:  # any number of ranks validates one (validation.py pads the ranks without a window)
            raise DataError(
                f"the validation split has no window of model.seq_len+1={self.seq_len + 1} tokens: lower "
                "model.seq_len or raise data.val_fraction"
            )
        return train, val

    def _train_windows(self, folder, manifest: Dict):
        """One corpus's train windows: concat's (ShardWindows), or data.packing=best_fit's (data/packing.py), built
        once per folder (train() asks before the run folder is made, setup again)."""
        shards, dtype = manifest["splits"]["train"]["shards"], manifest["dtype"]
        if self.data.packing == "concat":
            return ShardWindows(folder, shards, dtype, self.seq_len)
        if str(folder) not in self._packed:
            self._packed[str(folder)] = PackedWindows(folder, shards, dtype, self.seq_len,
                                                      manifest["tokenizer"]["eod_id"], self.data.packing_buffer)
            if is_primary_process():
                print(f"{folder}: {packing_report(self._packed[str(folder)], self.data.packing_buffer)}")
        return self._packed[str(folder)]

    def packing_stats(self) -> Optional[Dict]:
        """data.packing=best_fit: the packing's figures (data/packing.py packing_stats), per source for a mixture
        (by name); None for concat."""
        if self.data.packing == "concat" or self.train_dataset is None:
            return None
        if self.data.sources:
            return {name: part.stats for name, part in zip(self.source_names, self.train_dataset.parts)}
        return self.train_dataset.stats

    def _mixture_windows(self, world_size: int) -> Tuple[MixtureWindows, MixtureWindows]:
        parts = {split: [] for split in SPLITS}
        for i, (cfg, m) in enumerate(zip(source_configs(self.data), self.source_manifests)):
            parts["train"].append(self._train_windows(cfg.prepared_dir, m))
            parts["val"].append(ShardWindows(cfg.prepared_dir, m["splits"]["val"]["shards"], m["dtype"], self.seq_len))
            if len(parts["train"][-1]) < 1 or len(parts["val"][-1]) < 1:
                raise DataError(
                    f"data.sources[{i}] ({cfg.prepared_dir}) has {len(parts['train'][-1])} train and "
                    f"{len(parts['val'][-1])} validation windows of model.seq_len+1={self.seq_len + 1} tokens; it "
                    "needs at least 1 of each: give it more documents or lower model.seq_len")
        keys = [f"data.sources[{i}]" for i in range(len(self.data.sources))]
        limits = [src.max_epochs for src in self.data.sources]
        train = MixtureWindows(parts["train"], keys, limits)
        if len(train) < world_size * self.micro_batch_size:
            raise DataError(
                f"the sources hold {len(train)} train windows of model.seq_len+1={self.seq_len + 1} tokens, fewer than "
                f"one global batch ({world_size} ranks x trainer.micro_batch_size={self.micro_batch_size}): lower "
                "model.seq_len or trainer.micro_batch_size, or use larger sources")
        return train, MixtureWindows(parts["val"], keys)

    def mixture_order(self, samples_per_step: int, train: Optional[MixtureWindows] = None) -> MixtureOrder:
        """The mixture's slot sequence (data/mixture.py) for `samples_per_step` global windows per optimizer step,
        over `train` (default: the train windows of setup)."""
        train = train if train is not None else self.train_dataset
        weights = {src.name: src.weight for src in self.data.sources}
        phases = [(0, list(weights.values()))]
        for phase in self.data.mixture_schedule:
            weights.update(phase.weights)
            phases.append((phase.step, list(weights.values())))
        return MixtureOrder(self.source_names, [len(part) for part in train.parts], phases, samples_per_step,
                            self.seed, [src.max_epochs for src in self.data.sources], train.keys)

    def check_mixture(self, train: Dataset, max_steps: int, samples_per_step: int) -> None:
        """Before the run folder is made (train: the windows() train set): a ConfigError when max_steps would take
        a source past its max_epochs."""
        if self.data.sources:
            self.mixture_order(samples_per_step, train).check_max_epochs(max_steps * samples_per_step)

    def source_progress(self) -> Dict[str, Dict[str, float]]:
        """Per source: tokens and epochs the data order has handed to training (trained batches, and skipped ones),
        over every stage of the run; a source an earlier stage named and this mixture does not: its tokens only."""
        epoch, samples = self.train_loader.position()
        state = self.train_sampler.source_state(epoch, samples)
        out = {name: {"tokens_seen": s["draws"] * self.seq_len, "epochs": s["draws"] / len(part)}
               for (name, s), part in zip(state.items(), self.train_dataset.parts)}
        out.update({name: {"tokens_seen": draws * self.seq_len} for name, draws in self.train_sampler.carried.items()})
        return out

    def train_dataloader(self) -> DataLoader:
        rank, world_size = self.rank_and_world_size()
        accumulate = self.trainer.accumulate_grad_batches if self.trainer is not None else self._accumulate
        samples_per_step = self.micro_batch_size * world_size * accumulate  # global windows per optimizer step
        if self.data.sources:
            self.train_sampler = MixtureSampler(self.mixture_order(samples_per_step), self.micro_batch_size, rank,
                                                world_size)
        else:
            block, shuffle = self.data.shuffle_block_tokens, self.data.shuffle
            blocks = None
            if block not in (None, self.seq_len):
                blocks = (self.train_dataset.block_windows(block) if shuffle == "stored" else
                          self.train_dataset.block_table(block))
            if self.batch_schedule:
                self.train_sampler = self._scheduled_sampler(rank, world_size, accumulate, blocks)
            else:
                self.train_sampler = GlobalOrderSampler(len(self.train_dataset), self.micro_batch_size, rank,
                                                        world_size, self.seed, blocks, samples_per_step, shuffle)
        kwargs = self._loader_kwargs()
        self.train_loader = TrainLoader(self.train_dataset, self.train_sampler, kwargs.pop("batch_size"), **kwargs)
        self.train_loader.new_mixture = self.new_mixture
        return self.train_loader

    def _scheduled_sampler(self, rank: int, world_size: int, accumulate: int, blocks, train=None):
        train = self.train_dataset if train is None else train
        steps = step_windows(self.batch_schedule, self.seq_len, self.micro_batch_size * self.seq_len)
        base = GlobalOrderSampler(len(train), 1, rank, world_size, self.seed, blocks, None, self.data.shuffle)
        return ScheduledOrderSampler(base, steps, accumulate)

    def check_schedule(self, train: Dataset, max_steps: int) -> None:
        """Before the run folder is made (train: the windows() train set): a DataError when trainer.batch_schedule's
        max_steps do not fit in one epoch of the train split (data/scheduled.py)."""
        if not self.batch_schedule or self.data.sources:
            return
        block = self.data.shuffle_block_tokens
        blocks = None if block in (None, self.seq_len) else train.block_table(block)
        sampler = self._scheduled_sampler(0, 1, 1, blocks, train)
        if sampler.steps_per_epoch < max_steps:
            raise DataError(
                f"trainer.batch_schedule: trainer.max_steps={max_steps} steps take {sampler.steps.before(max_steps)} "
                f"windows of model.seq_len={self.seq_len}, and one epoch of the train split holds "
                f"{sampler.num_windows} ({sampler.steps_per_epoch} steps); a run under a batch schedule stays within "
                "one epoch: lower trainer.max_steps or the schedule's batches, or use a larger corpus")

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        # Lightning calls this as training takes each batch (after its prefetch), so the indices are the trained ones.
        if self.trainer is not None and self.trainer.training and self.train_loader is not None:
            self.batch_indices = self.train_loader.take_trained_indices()
        return batch

    def skip_micro_batches(self, micro_batches: int) -> None:
        """Drop this rank's next `micro_batches` training batches (every rank dropping the same number drops one
        contiguous range of the global order); `train_loader.dropped` records which."""
        if self.train_loader is None:
            raise RuntimeError("skip_micro_batches needs the train dataloader: call it during fit")
        self.train_loader.drop(micro_batches)

    def val_dataloader(self) -> DataLoader:
        """This rank's share of the fixed validation set (data/validation.py: trainer.val_windows in all, the same
        for any number of ranks); a mixture's in batches of one source each, so the module can total the loss and
        bytes per source (val_batch_sources)."""
        rank, world_size = self.rank_and_world_size()
        if self.data.sources:
            sizes, offsets = [len(p) for p in self.val_dataset.parts], self.val_dataset.offsets
        else:
            sizes, offsets = [len(self.val_dataset)], [0]
        batches, sources = val_batches(sizes, offsets, self.val_windows, self.micro_batch_size, rank, world_size)
        self.val_batch_sources = sources if self.data.sources else None
        kwargs = self._loader_kwargs()
        kwargs.pop("batch_size")
        return DataLoader(PaddedWindows(self.val_dataset), batch_sampler=batches, **kwargs)

    def _loader_kwargs(self) -> Dict:
        kwargs = {"batch_size": self.micro_batch_size, "num_workers": self.data.num_workers,
                  "pin_memory": self._on_cuda()}
        if self.data.num_workers > 0:
            # Workers outlive an epoch (no restart cost at each validation); 2 batches ahead each hides the
            # memmap reads, which are far faster than a training step.
            kwargs.update(persistent_workers=True, prefetch_factor=2)
        return kwargs

    def _on_cuda(self) -> bool:
        return self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"


def source_configs(data) -> List:
    """Each data.sources entry as a whole data config: data.* with the entry's fields that are set (corpus, paths,
    ...), its prepared folder (data.prepared_dir/<name> when unset), no sources; and, past the first, the first
    source's tokenizer unless data.tokenizer_path names one."""
    out = []
    for src in data.sources:
        changes = {f.name: getattr(src, f.name) for f in dataclasses.fields(src)
                   if hasattr(data, f.name) and getattr(src, f.name) is not None}
        changes.update(prepared_dir=src.prepared_dir or str(Path(data.prepared_dir) / src.name), sources=[],
                       mixture_schedule=[])
        if out and data.tokenizer_path is None:  # (a pretokenized first source needs data.tokenizer_path: schema)
            changes["tokenizer_path"] = str(Path(out[0].prepared_dir) / TOKENIZER_FILE)
        out.append(dataclasses.replace(data, **changes))
    return out


def _silent(*_) -> None:
    pass


def prepare_sources(data, log=print) -> List[Dict]:
    """Prepare (or reuse) every source's folder, the first first (the others may take its tokenizer)."""
    manifests = []
    for i, cfg in enumerate(source_configs(data)):
        if is_pretokenized(cfg):
            manifests.append(open_corpus(cfg))
            continue
        if manifests:
            check_tokenizer(cfg.prepared_dir, manifests[0], i)  # before prepare() calls it a changed file
        manifests.append(prepare(cfg, log=log))
    return manifests


def read_source(cfg, verify: bool = False) -> Dict:
    """The manifest of a corpus already prepared (checked against cfg and its shards when `verify`), or of a
    pretokenized corpus (data/pretokenized.py, checked once per process)."""
    if is_pretokenized(cfg):
        return open_corpus(cfg)
    manifest = load_manifest(cfg.prepared_dir)
    if verify:
        check_config(manifest, cfg, cfg.prepared_dir)
        verify_shards(cfg.prepared_dir, manifest)
    return manifest


def same_tokenizer(manifest: Dict, first: Dict, index: int) -> None:
    """A DataError when data.sources[index] was tokenized by another tokenizer than the first source."""
    sha = manifest["tokenizer"]["sha256"]
    if sha != first["tokenizer"]["sha256"]:
        raise DataError(
            f"data.sources[{index}] was tokenized with another tokenizer ({manifest['tokenizer']['file']}, sha256 "
            f"{sha[:12]}; the first source's is {first['tokenizer']['sha256'][:12]}): all sources share one "
            "tokenizer; give it a new prepared_dir, or data.tokenizer_path for a pretokenized source")


def check_tokenizer(prepared_dir, first: Dict, index: int) -> None:
    """A DataError when data.sources[index]'s prepared folder holds shards of another tokenizer than the first
    source's (compared by the manifests' sha256)."""
    path = Path(prepared_dir) / "manifest.json"
    if not path.is_file():
        return
    sha = load_manifest(prepared_dir)["tokenizer"]["sha256"]
    if sha != first["tokenizer"]["sha256"]:
        raise DataError(
            f"data.sources[{index}].prepared_dir {str(prepared_dir)!r} was prepared with another tokenizer (sha256 "
            f"{sha[:12]}, the first source's is {first['tokenizer']['sha256'][:12]}): all sources share one "
            "tokenizer; give it a new prepared_dir")


def combined_manifest(names: List[str], manifests: List[Dict]) -> Dict:
    """What train() reads of a manifest, for the sources together: the shared tokenizer, every source's shards
    (named <source>/<file>, so the resume check's manifest hash covers them all) and token counts; no unigram
    entropy (the mixture's would need the sources' token counts, which manifests do not keep)."""
    splits = {}
    for split in SPLITS:
        parts = [m["splits"][split] for m in manifests]
        splits[split] = {"documents": sum(p["documents"] for p in parts), "tokens": sum(p["tokens"] for p in parts),
                         "shards": [{**shard, "file": f"{name}/{shard['file']}"}
                                    for name, p in zip(names, parts) for shard in p["shards"]]}
    return {"tokenizer": manifests[0]["tokenizer"], "dtype": manifests[0]["dtype"], "splits": splits,
            "unigram_entropy_nats": None, "deduplication": None, "sources": dict(zip(names, manifests))}
