"""The sharded checkpoint of a distributed run: every rank writes what it holds, any layout reads it back.

Format (the folder `checkpoints/step0000012/`, /work/notes/i17_contract.md; manifest, verification and the safe
`.metadata` reader in resume/sharded/format.py): torch.distributed.checkpoint (DCP) files keyed by single-process
names, `model.<name>` and `optim.<name>.<state key>`, with the single-process (global) shapes; `trainer_state.pt`
(rank 0's Lightning checkpoint without model and optimizer tensors); `rank{r:05d}.pt` per rank; `manifest.json` last.

How a rank says what it holds, without gathering: every tensor becomes a `Chunk`, its local tensor and where that
lies in the global tensor (offsets per dim). An FSDP2 shard (a DTensor) gives its offsets from its placements
(compute_local_shape_and_global_offset: Shard(0), HSDP's Replicate x Shard); our tensor-parallel slices are plain
tensors, so their offset along the split dim is tp_rank x slice (planning/sharding.py SHARD_DIM); both compose, since
FSDP2 shards the TP slice along dim 0. Expert parallelism's experts are the rows [rank·E/P, (rank+1)·E/P) of the
(E, ...) stack, and under tensor parallelism a slice of their width (dim 1 of the gate/up stacks, 2 of the down
stack: SHARD_DIM's expert styles), which FSDP2 shards further over the experts' own data-parallel group. DCP's
planner then writes each chunk once: chunks with the same offsets
(replicated tensors, data-parallel replicas, the tied embedding on two pipeline stages) are written by one rank
only (DCP's dedup_save_plans). Loading builds the same chunks for the target layout and DCP reads every overlap from
whichever saved chunks hold it: that is the resharding, for any pair of layouts, with no arithmetic (bitwise).

Asynchronous save (`checkpoint.async_save`): the local tensors are copied (the staging, 1/world of the state on each
rank), then a background thread writes them, hashes each rank's own files, gathers the hashes and, on rank 0, writes
the manifest, points `latest` at the folder and applies retention, in that order; the collectives of the writer run
on a process group of their own (gloo), so they never interleave with training's. The next save, the end of
training and a preemption wait for the writer.

Every save is written into a hidden sibling, `.step0000012.saving`, and renamed to `step0000012` only once its
manifest is written: a crash mid-save leaves no step folder (the previous checkpoint stays the newest valid one),
and a complete checkpoint of the same step (a run resumed from an earlier step saves it again) stays whole until
its replacement is, as the one-file format's atomic rename keeps a step file. The replaced folder is renamed aside
to `.step0000012.replaced`, then deleted; the next save tidies what a crash left of these (`_tidy`).
"""

import concurrent.futures
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from lit_pretrain.errors import DataError
from lit_pretrain.internals import dump_checkpoint
from lit_pretrain.resume.sharded.manifest import TRAINER_STATE

MODEL, OPTIM = "model.", "optim."
# The weights' EMA (callbacks/ema.py): `ema.<name>` in a folder, laid out like `model.<name>`; in a one-file checkpoint
# the whole tensors by single-process parameter name under EMA_KEY.
EMA, EMA_KEY = "ema.", "ema_weights"
SAVING, REPLACED = ".saving", ".replaced"
HIDDEN_STEP_DIR = re.compile(r"^\.(step\d{7,})(\.saving|\.replaced)$")  # staging_folder's and _install's names
SHARDED_KEY = "lit_pretrain_sharded"  # set in the dict load_checkpoint returns: model and optimizer already loaded
WRITE_DELAY = 0.0  # seconds the background writer sleeps before writing: a test hook for a crash mid-write


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


class Chunk:
    """One rank's piece of a global tensor: `local` holds [offsets, offsets + local.shape) of a tensor of `size`.
    DCP treats it like a DTensor through the _Checkpointable hooks; an empty piece (an FSDP shard of padding only)
    writes and reads nothing."""

    def __init__(self, local: torch.Tensor, size: Sequence[int], offsets: Sequence[int]):
        self.local, self._size, self.offsets = local, torch.Size(size), torch.Size(offsets)

    def size(self) -> torch.Size:
        return self._size

    def _chunk(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.shape)

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        if self.local.numel() == 0 and len(self._size) > 0:
            return []
        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=self._chunk(),
                                                      properties=TensorProperties.create_from_tensor(self.local),
                                                      size=self._size))]

    def __create_chunk_list__(self) -> list:
        return [] if self.local.numel() == 0 and len(self._size) > 0 else [self._chunk()]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self.local


def _planners():
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    class ChunkSavePlanner(DefaultSavePlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def lookup_object(self, index):
            return self.state_dict[index.fqn].local

    class ChunkLoadPlanner(DefaultLoadPlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            # The default one first replaces every value that is not a tensor (our chunks) with None.
            self.original_state_dict = self.state_dict = state_dict
            self.metadata, self.is_coordinator = metadata, is_coordinator

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn].local

    return ChunkSavePlanner, ChunkLoadPlanner


# What this rank holds, as chunks of single-process tensors.

def _tp(par):
    return (par.tp_rank, par.t) if par is not None and par.mesh is not None else (0, 1)


def chunk_of(name: str, t: torch.Tensor, par) -> Chunk:
    """`t` (this rank's value of single-process tensor `name`, a parameter or a state shaped like it) as a Chunk."""
    from lit_pretrain.planning.sharding import SHARD_DIM, style_of

    if t.dim() == 0:
        return Chunk(t.detach(), (), ())
    if hasattr(t, "full_tensor"):  # an FSDP2 shard: its offsets in the (TP-local) tensor from its placements
        from lit_pretrain.internals import local_shape_and_offset

        _, offsets = local_shape_and_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
    else:
        offsets, local = [0] * t.dim(), t
    size, offsets = list(t.shape), list(offsets)
    tp_rank, tp = _tp(par)
    style = style_of(name, par.tp_plan) if tp > 1 else None  # par: a ParallelModel whenever tp > 1
    if style is not None:
        dim = SHARD_DIM[style]
        offsets[dim] += tp_rank * size[dim]
        size[dim] *= tp
    ep = getattr(par, "ep", None)
    if ep is not None and par.is_expert(name):  # this rank's E/P experts: rows [rank·E/P, ...) of the (E, ...) stack
        offsets[0] += ep.rank * size[0]
        size[0] *= ep.degree
    return Chunk(local.detach(), size, offsets)


def model_chunks(gpt, par) -> Dict[str, Chunk]:
    """The GPT's state dict as this rank holds it (live tensors: loading into them loads the model in place)."""
    from lit_pretrain.planning.sharding import plain_name

    return {MODEL + plain_name(k): chunk_of(plain_name(k), v, par) for k, v in gpt.state_dict().items()}


def _owned(gpt, optimizer):
    """(single-process name, parameter) of the parameters whose optimizer state this rank keeps."""
    from lit_pretrain.optim.optimizers import local_optimizer
    from lit_pretrain.planning.sharding import plain_name

    held = {id(p) for g in local_optimizer(optimizer).param_groups for p in g["params"]}
    return [(plain_name(n), p) for n, p in gpt.named_parameters() if id(p) in held]


def optimizer_chunks(gpt, optimizer, par) -> Dict[str, Chunk]:
    """The optimizer state this rank keeps (ZeRO-1: its own tensors; FSDP: its shards), keyed optim.<name>.<key>."""
    from lit_pretrain.optim.optimizers import local_optimizer

    state = local_optimizer(optimizer).state
    out = {}
    for name, p in _owned(gpt, optimizer):
        for key, value in state.get(p, {}).items():
            if torch.is_tensor(value):
                out[f"{OPTIM}{name}.{key}"] = chunk_of(name, value, par)
    return out


def optimizer_targets(gpt, optimizer, par, saved: Dict[str, torch.Size]) -> Dict[str, Chunk]:
    """Empty optimizer state for this rank's parameters, shaped as saved (a parameter's shape, or a scalar such as
    AdamW's step), installed in the optimizer; loading into the chunks fills it."""
    from lit_pretrain.optim.optimizers import local_optimizer

    state = local_optimizer(optimizer).state
    out = {}
    for name, p in _owned(gpt, optimizer):
        prefix = f"{OPTIM}{name}."
        entry = {}
        for key in (k for k in saved if k.startswith(prefix) and "." not in k[len(prefix):]):
            scalar = len(saved[key]) == 0
            entry[key[len(prefix):]] = torch.zeros((), dtype=torch.float32) if scalar else torch.zeros_like(p.detach())
        if entry:
            state[p] = entry
            out.update({prefix + k: chunk_of(name, v, par) for k, v in entry.items()})
    return out


# Lightning's checkpoint dict without the model and optimizer tensors.

def param_names(module) -> List[List[str]]:
    """Per optimizer group, the single-process parameter names in the optimizer's order (optim/named_state.py)."""
    from lit_pretrain.optim.named_state import single_process_names

    return single_process_names(module.model_cfg, module.optim_cfg).groups


def trainer_state(trainer) -> Dict[str, Any]:
    """trainer.save_checkpoint's dict with no model or optimizer tensors: the strategy's gathering hooks are
    bypassed for this call (every rank calls it: callbacks such as RankState gather their small states)."""
    strategy = trainer.strategy
    module = trainer.lightning_module
    saved = strategy.__dict__.get("lightning_module_state_dict"), strategy.__dict__.get("optimizer_state")
    strategy.lightning_module_state_dict = lambda: {k: v for k, v in module.state_dict().items()
                                                   if not k.startswith(MODEL)}
    strategy.optimizer_state = lambda optimizer: {}
    try:
        checkpoint = dump_checkpoint(trainer, weights_only=False)
    finally:
        for attr, value in zip(("lightning_module_state_dict", "optimizer_state"), saved):
            if value is None:
                del strategy.__dict__[attr]
            else:
                setattr(strategy, attr, value)
    names = param_names(module)
    groups, index = [], 0
    for group_names, group in zip(names, strategy.optimizers[0].param_groups):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(index, index + len(group_names)))})
        index += len(group_names)
    checkpoint["optimizer_states"] = [{"state": {}, "param_groups": groups}]
    checkpoint["param_names"] = names
    return checkpoint


# Writing.

_GROUP: Dict[str, Any] = {}


def checkpoint_group():
    """A gloo process group over the whole world for the checkpoint's own collectives (DCP's plan exchange, the
    hashes), so a background write never interleaves with training's collectives; None without a process group.
    Made at the first save, which every rank reaches at the same step."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if "group" not in _GROUP:
        _GROUP["group"] = dist.new_group(backend="gloo")
    return _GROUP["group"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _own_files(folder: Path, rank: int, written: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Size and sha256 of the files this rank wrote (its DCP data files and rank file; rank 0 also `.metadata` and
    trainer_state.pt): the records taken while writing them (`written`), the file read back only where there is
    none (or its size differs from what was written)."""
    from lit_pretrain.atomic import file_sha256

    names = [p.name for p in folder.glob(f"__{rank}_*.distcp")] + [rank_file(rank)]
    if rank == 0:
        names += [".metadata", TRAINER_STATE]
    out = {}
    for n in sorted(names):
        size, record = (folder / n).stat().st_size, written.get(n)
        sha = record["sha256"] if record is not None and record["bytes"] == size else file_sha256(folder / n)
        out[n] = {"bytes": size, "sha256": sha}
    return out


def _save_files(folder: Path, chunks: Dict[str, Chunk], group, manifest: Dict[str, Any], on_complete,
                written: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
    """DCP's write of every rank's chunks into `folder`'s staging folder, hashed as they are written, then this
    rank's folder fsync, then the hashes gathered, then (rank 0) the manifest, the rename to `folder` and
    `on_complete`. `written`: the records of the files this rank wrote before (_save_torch's)."""
    from torch.distributed.checkpoint import save as dcp_save

    from lit_pretrain.atomic import fsync_dir
    from lit_pretrain.resume.sharded.format import write_manifest
    from lit_pretrain.resume.sharded.writer import HashingFileSystemWriter

    final, folder = folder, staging_folder(folder)
    if WRITE_DELAY:
        time.sleep(WRITE_DELAY)
    save_planner, _ = _planners()
    writer = HashingFileSystemWriter(folder)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp_save(chunks, storage_writer=writer, planner=save_planner(), process_group=group, no_dist=group is None)
    # Every file of this rank was fsynced as it was written; one fsync of the folder makes their names durable
    # before the manifest can list them (rank 0's manifest write fsyncs the folder once more, after itself).
    fsync_dir(folder)
    rank = _rank()
    files = _own_files(folder, rank, {**(written or {}), **writer.records})
    if group is not None:
        every: List[Optional[dict]] = [None] * _world()
        dist.all_gather_object(every, files, group=group)
        files = {k: v for part in every for k, v in part.items()}
    if rank == 0:
        write_manifest(folder, files=files, **manifest)
        _install(folder, final)
        if on_complete is not None:
            on_complete()


class ShardedSaver:
    """Writes sharded checkpoints of one run; with `async_save`, in a background thread, one save in flight at most.
    Every rank calls `save` at the same step and `wait` before the run ends."""

    def __init__(self, async_save: bool = False):
        self.async_save = async_save
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._future: Optional[concurrent.futures.Future] = None
        self.last_stall: Optional[float] = None  # seconds the last save kept training waiting

    def wait(self) -> None:
        """Block until the save in flight (if any) has written its manifest; re-raise its error."""
        future, self._future = self._future, None
        if future is not None:
            future.result()

    def save(self, trainer, folder: Path, step: int, layout: Dict[str, Any], on_complete=None) -> None:
        from lit_pretrain.resume.verified import META_KEY

        started = time.perf_counter()
        self.wait()
        checkpoint = trainer_state(trainer)
        module = trainer.lightning_module
        optimizer = trainer.strategy.optimizers[0]
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        chunks = {**model_chunks(module.model, module.parallel),
                  **optimizer_chunks(module.model, optimizer, module.parallel)}
        for callback in trainer.callbacks:  # a callback's own tensors sharded like the weights (callbacks/ema.py)
            if hasattr(callback, "checkpoint_chunks"):
                chunks.update(callback.checkpoint_chunks(trainer))
        if self.async_save:  # the staging: a copy of this rank's share, so training may change the originals
            chunks = {k: Chunk(c.local.clone(), c.size(), c.offsets) for k, c in chunks.items()}
        group, rank = checkpoint_group(), _rank()
        _prepare_folder(folder, rank, group)
        written = _save_torch(checkpoint if rank == 0 else None, folder, rank)
        manifest = {"step": step, "meta": checkpoint.get(META_KEY, {}), "layout": layout, "world_size": _world()}
        if self.async_save:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sharded-checkpoint")
            self._future = self._pool.submit(_save_files, folder, chunks, group, manifest, on_complete, written)
        else:
            _save_files(folder, chunks, group, manifest, on_complete, written)
        self.last_stall = time.perf_counter() - started


def staging_folder(folder: Path) -> Path:
    """Where the save of the step folder `folder` is written until it is complete (module docstring)."""
    return folder.with_name(f".{folder.name}{SAVING}")


def _prepare_folder(folder: Path, rank: int, group) -> None:
    """Rank 0 tidies the checkpoints folder and makes `folder`'s empty staging folder, then every rank may write
    into it (_save_torch and _save_files take `folder` and write into its staging folder)."""
    if rank == 0:
        from lit_pretrain.errors import RunFolderError
        from lit_pretrain.paths import confined

        if folder.exists() or folder.is_symlink():
            confined(folder.parent, folder, "checkpoint folder")  # refuses a link: its target is not ours to replace
            if not folder.is_dir():
                raise RunFolderError(f"checkpoint folder {folder} is a file, not a folder: refusing to replace it; "
                                     "move it away or choose another run.root_dir")
        _tidy(folder.parent)
        staging_folder(folder).mkdir(parents=True)
    if group is not None:
        dist.barrier(group=group)


def _remove(path: Path) -> None:
    from lit_pretrain.paths import safe_rmtree

    safe_rmtree(path, path.parent, lambda p: HIDDEN_STEP_DIR.match(p.name) is not None, "checkpoint folder")


def _tidy(root: Path) -> None:
    """What a save cut short left, with no save in flight (every rank waited for its last): staging folders go
    (none was complete and renamed); a replaced folder goes once its replacement is in place, and is renamed back
    where the crash fell between _install's two renames, so a complete checkpoint is never lost."""
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        named = HIDDEN_STEP_DIR.match(path.name)
        if named is None or path.is_symlink() or not path.is_dir():
            continue
        step_folder = root / named.group(1)
        if named.group(2) == REPLACED and not (step_folder.exists() or step_folder.is_symlink()):
            os.rename(path, step_folder)
        else:
            _remove(path)


def _install(staging: Path, folder: Path) -> None:
    """Rename the complete staging folder to `folder`; a folder already there (a complete or cut-short save of the
    same step) is renamed aside first and deleted once the new one is in place (module docstring)."""
    from lit_pretrain.atomic import fsync_dir

    aside = folder.with_name(f".{folder.name}{REPLACED}")
    replaced = folder.is_dir()  # a real folder: _prepare_folder refused a link or a file of this name
    if replaced:
        if aside.exists() or aside.is_symlink():
            _remove(aside)
        os.rename(folder, aside)
    os.rename(staging, folder)
    fsync_dir(folder.parent)  # both renames durable before the old checkpoint goes
    if replaced:
        _remove(aside)


def _save_torch(checkpoint: Optional[dict], folder: Path, rank: int) -> Dict[str, Dict[str, Any]]:
    """This rank's rank file (and rank 0's trainer_state.pt) in `folder`'s staging folder, each hashed as it is
    written; returns their records. Their folder's fsync is _save_files' (one per rank and save)."""
    from lit_pretrain.atomic import HashingWriter, atomic_open
    from lit_pretrain.resume.rank_state import capture

    records = {}
    for name, obj in ((rank_file(rank), {"rng": capture()}), (TRAINER_STATE, checkpoint)):
        if obj is None:
            continue
        with atomic_open(staging_folder(folder) / name, sync_folder=False) as f:
            writer = HashingWriter(f)
            torch.save(obj, writer)
        records[name] = writer.record()
    return records


# Reading into a layout.

def reader(folder: Path, check_sha256: bool = True):
    """The verified reader of a folder (resume/sharded/format.py): manifest checked on construction, `.metadata`
    read with the restricted unpickler. check_sha256=False where rank 0 has just hashed every file."""
    from lit_pretrain.resume.sharded.format import VerifiedFileSystemReader

    return VerifiedFileSystemReader(folder, check_sha256=check_sha256)


def saved_shapes(storage) -> Dict[str, torch.Size]:
    """Every tensor of the checkpoint with its single-process shape, from `.metadata`."""
    return {k: md.size for k, md in storage.read_metadata().state_dict_metadata.items() if hasattr(md, "size")}


def _check_targets(folder: Path, targets: Dict[str, Chunk], saved: Dict[str, torch.Size]) -> None:
    for key, chunk in targets.items():
        if key not in saved:
            raise DataError(f"checkpoint {folder} holds no {key}: it was written for another model (or by another "
                            "program); resume from a checkpoint of this model")
        if saved[key] != chunk.size():
            raise DataError(f"checkpoint {folder}: {key} has shape {tuple(saved[key])} there but "
                            f"{tuple(chunk.size())} in this model: the checkpoint is of another model shape; set the "
                            "model section back to the checkpoint's, or start afresh")


def load(storage, targets: Dict[str, Chunk]) -> None:
    """Fill `targets` (this rank's chunks of the target layout) from the checkpoint `storage` (a `reader`): DCP
    reads every overlap. Every rank of the process group calls it (none: one process)."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException

    folder = Path(storage.path)
    _check_targets(folder, targets, saved_shapes(storage))
    _, load_planner = _planners()
    group = checkpoint_group()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp_load(targets, storage_reader=storage, planner=load_planner(), process_group=group,
                     no_dist=group is None)
    except CheckpointException as err:  # DCP wraps what a rank raised: the first cause, as one line
        causes = [getattr(f, "exc", f) for f in err.failures.values()]
        raise DataError(f"checkpoint {folder} cannot be loaded ({causes[0] if causes else err})") from None


def load_model(storage, gpt, par) -> None:
    """The GPT's weights (this rank's share under `par`, a ParallelModel or None) from the checkpoint, in place."""
    storage = reader(storage) if isinstance(storage, (str, Path)) else storage
    load(storage, model_chunks(gpt, par))


def load_optimizer(storage, gpt, par, optimizer, checkpoint: dict) -> None:
    """This rank's optimizer state from the checkpoint, and the saved group settings (lr, betas, ...)."""
    from lit_pretrain.optim.optimizers import local_optimizer

    storage = reader(storage) if isinstance(storage, (str, Path)) else storage
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    load(storage, optimizer_targets(gpt, optimizer, par, saved_shapes(storage)))
    saved = (checkpoint.get("optimizer_states") or [{}])[0].get("param_groups", [])
    for opt in {id(optimizer): optimizer, id(local_optimizer(optimizer)): local_optimizer(optimizer)}.values():
        if len(opt.param_groups) == len(saved):
            for group, saved_group in zip(opt.param_groups, saved):
                group.update({k: v for k, v in saved_group.items() if k != "params"})


def read_trainer_state(folder: Path) -> Dict[str, Any]:
    """trainer_state.pt (verified with the rest of the folder first by the caller), weights-only."""
    try:
        return torch.load(folder / TRAINER_STATE, map_location="cpu", weights_only=True)
    except Exception as err:
        raise DataError(f"checkpoint {folder / TRAINER_STATE} cannot be read as a weights-only file ({err})") from None


def as_single_checkpoint(folder: Path) -> Dict[str, Any]:
    """The folder as a one-file checkpoint holds it (single-process state dict under `model.`, the optimizer state
    by parameter name: optim/named_state.py; the weights' EMA under EMA_KEY), in one process without a process
    group: what load_gpt / load_optimizer_state and a one-process resume read. The whole state passes through memory."""
    from lit_pretrain.resume.sharded.format import VerifiedFileSystemReader, load_sharded_full

    storage = VerifiedFileSystemReader(folder)  # verifies the whole folder first (trainer_state.pt included)
    weights = load_sharded_full(folder, MODEL, storage)
    checkpoint = read_trainer_state(folder)
    checkpoint["state_dict"] = {**checkpoint.get("state_dict", {}), **{MODEL + k: v for k, v in weights.items()}}
    checkpoint["optimizer_states"] = [named_optimizer_state(checkpoint, load_sharded_full(folder, OPTIM), folder)]
    if any(k.startswith(EMA) for k in storage.read_metadata().state_dict_metadata):
        checkpoint[EMA_KEY] = load_sharded_full(folder, EMA, storage)
    checkpoint.pop("param_names", None)
    return checkpoint


def named_optimizer_state(trainer: Dict[str, Any], flat: Dict[str, Any], folder: Path) -> Dict[str, Any]:
    """The by-name optimizer state of a folder (optim/named_state.py) from its trainer_state.pt's groups and
    `param_names` (per group, the names in its order) and `flat`, its `optim.<name>.<key>` entries without `optim.`
    (tensors, or stand-ins for them: resume/sharded/tools.py streams them); state keys (step, exp_avg, ...) have no
    dot."""
    groups = trainer.get("param_names") or []
    state: Dict[str, Dict[str, Any]] = {}
    for key, value in flat.items():
        name, state_key = key.rsplit(".", 1)
        state.setdefault(name, {})[state_key] = value
    unknown = set(state) - {n for names in groups for n in names}
    if unknown:
        raise DataError(f"checkpoint file {folder / TRAINER_STATE}: its param_names lack {sorted(unknown)[:3]}, which "
                        "have optimizer state in the shards: it was not written by this project")
    saved = (trainer.get("optimizer_states") or [{}])[0].get("param_groups", [])
    return {"state": {n: state[n] for names in groups for n in names if n in state},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
                             for g, names in zip(saved, groups)]}
