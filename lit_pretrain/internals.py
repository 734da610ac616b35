"""Every private Lightning and torch name the project relies on, in one place, each behind a small named function or
mixin whose docstring says what it reaches, why no public API does it, and the versions it was verified on.

An upgrade that renames or changes one of them fails tests/test_internals.py (one test per entry below, naming the
version and the function) instead of a run. pyproject.toml bounds `lightning` to the versions those tests pass on;
verified: lightning 2.6.6, torch 2.13.0. Nothing here is imported at module load (`show` and `--help` start fast):
each function imports what it reaches.
"""

from typing import Any, Callable, Dict, List, Tuple

VERIFIED = "lightning 2.6.6, torch 2.13.0"


# Private classes and functions used as they are, imported when first asked for: name -> (module, its name there).
# SubprocessScriptLauncher: Lightning's local launcher (launch/launcher.py subclasses it); Lightning exports no
# public one. checkpoint_wrapper, CheckpointWrapper, CheckpointImpl: the activation-checkpointing wrapper whose
# state-dict hooks keep plain parameter names (torchtitan and Lightning's FSDP policy use it too); torch has it only
# under torch.distributed.algorithms._checkpoint. tree_leaves: torch's pytree flattening (what torch.compile and
# DTensor use), no public path.
LAZY = {
    "SubprocessScriptLauncher": ("lightning.pytorch.strategies.launchers.subprocess_script",
                                 "_SubprocessScriptLauncher"),
    "checkpoint_wrapper": ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper"),
    "CheckpointWrapper": ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointWrapper"),
    "CheckpointImpl": ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointImpl"),
    "tree_leaves": ("torch.utils._pytree", "tree_leaves"),
}


def __getattr__(name: str):
    if name in LAZY:
        import importlib

        module, attr = LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Lightning's Trainer and its loops


def logger_connector(trainer) -> Any:
    """The Trainer's `_logger_connector`, whose `log_metrics(metrics, step=None)` every `self.log` row and every
    logger row Lightning writes goes through: the one place to choose the step a row is tagged with
    (runs/step_axis.py). Lightning has no public hook for the step of a logged row."""
    return trainer._logger_connector


def dump_checkpoint(trainer, weights_only: bool = False) -> Dict[str, Any]:
    """The dict `trainer.save_checkpoint` would write (loops, callbacks, module and strategy hooks), without writing it:
    `Trainer._checkpoint_connector.dump_checkpoint`. The sharded save writes the tensors itself and needs only this
    dict; `save_checkpoint` always goes to the strategy's checkpoint_io."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=weights_only)


def batches_completed_in_epoch(trainer) -> int:
    """How many batches of this epoch the fit loop has completed (`fit_loop.epoch_loop.batch_progress.current
    .completed`); 0 at an epoch's first batch. `trainer.fit_loop.batch_idx` counts fetched batches, not completed."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.completed


def saved_batch_progress(fit_loop_state: Dict[str, Any]) -> Dict[str, Any]:
    """In a checkpoint's `loops.fit_loop`: the epoch loop's batch counts (`current`/`total`: ready, started, processed,
    completed; `is_last_batch`), the form resume/checkpointing.py rewrites. The loop state's layout is Lightning's own;
    no public API reads or writes it."""
    return fit_loop_state["epoch_loop.batch_progress"]


def saved_epoch_loop_state(fit_loop_state: Dict[str, Any]) -> Dict[str, Any]:
    """In a checkpoint's `loops.fit_loop`: the epoch loop's own state (`_batches_that_stepped`: the step the loggers
    tag rows with)."""
    return fit_loop_state["epoch_loop.state_dict"]


def attached_trainer(module) -> Any:
    """The Trainer `module` is attached to, or None: `LightningModule._trainer`. The public `module.trainer` raises
    when none is attached, and the callers must work on a bare module too."""
    return module._trainer


def csv_writer_made(logger) -> Any:
    """The CSVLogger's metrics writer if it has made one, else None (`_experiment`): its `experiment` property makes
    one, deleting an existing metrics.csv, so a subclass that keeps the file must know before asking
    (resume/metrics_csv.py)."""
    return logger._experiment


# Lightning's strategies and launchers


def launch_local_ranks(launcher, function: Callable, args, kwargs, observe: Callable[[List[Any]], None]) -> Any:
    """The body of Lightning 2.6's `_SubprocessScriptLauncher.launch` (rank 0 re-runs the command for the other local
    ranks, then runs `function`), with `observe(procs)` in place of Lightning's `_launch_process_observer`, which
    SIGKILLs every rank 5 s after a child fails: Lightning offers no hook to replace that observer."""
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

    launcher.cluster_environment.validate_settings(num_devices=launcher.num_processes, num_nodes=launcher.num_nodes)
    if not launcher.cluster_environment.creates_processes_externally:
        launcher._call_children_scripts()
        observe(launcher.procs)
    _set_num_threads_if_needed(num_processes=launcher.num_processes)
    return function(*args, **kwargs)


class LocalLauncherSwap:
    """Strategy mixin (DDPStrategy, ModelParallelStrategy): where Lightning's `_configure_launcher` picked its local
    `_SubprocessScriptLauncher`, `self.local_launcher()` replaces it. Lightning's strategies take no launcher
    argument. The class mixing it in defines `local_launcher`."""

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if type(self._launcher) is __getattr__("SubprocessScriptLauncher"):
            self._launcher = self.local_launcher()


class BeforeProcessGroup:
    """Strategy mixin: `self.before_process_group()` runs before Lightning's own process-group set-up, which finds
    the group made and goes on. DDPStrategy's set-up is `setup_distributed`, ModelParallelStrategy's the private
    `_setup_distributed`; neither has a hook before `init_process_group`. The class mixing it in defines
    `before_process_group`."""

    def setup_distributed(self) -> None:  # DDPStrategy's
        self.before_process_group()
        super().setup_distributed()

    def _setup_distributed(self) -> None:  # ModelParallelStrategy's
        self.before_process_group()
        super()._setup_distributed()


def setup_process_group(strategy) -> None:
    """ModelParallelStrategy's own process-group set-up (`_setup_distributed`, with BeforeProcessGroup's hook when
    mixed in), for a subclass that replaces `setup_environment`."""
    strategy._setup_distributed()


def process_group_backend(strategy) -> str:
    """The backend the strategy's process group is made with (`_get_process_group_backend`: the configured one, else
    nccl on CUDA and gloo elsewhere); Lightning exposes it only once the group exists."""
    return strategy._get_process_group_backend()


def process_group_timeout(strategy):
    """The collective timeout the strategy was built with (`_timeout`, a timedelta); Lightning has no accessor."""
    return strategy._timeout


# torch


def drop_consolidated_state(optimizer) -> None:
    """Free ZeroRedundancyOptimizer's copy of every rank's state that `consolidate_state_dict` gathered on the target
    rank (`_all_state_dicts`): it is kept until the next consolidation otherwise, a second full optimizer state in
    rank 0's memory. torch offers no call that releases it."""
    optimizer._all_state_dicts = []


def local_shape_and_offset(global_shape, mesh, placements):
    """(local shape, global offset) of this rank's shard of a DTensor of `global_shape` on `mesh` with `placements`:
    `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`, what DCP's planner uses; the public
    DTensor API gives the local tensor but not where it sits."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(global_shape, mesh, placements)


def muon_parts():
    """(adjust_lr, zeropower_via_newtonschulz) of torch.optim.Muon (`torch.optim._muon`): the learning-rate scaling by
    a matrix's shape and the Newton-Schulz orthogonalization, which the distributed Muon step (optim/optimizers.py)
    runs on whole matrices. torch.optim.Muon exposes only its step."""
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    return _adjust_lr, _zeropower_via_newtonschulz


def fsdp_mixed_precision_policy(module) -> Any:
    """The MixedPrecisionPolicy an FSDP2 module (`fully_shard`'s) was given (`_get_fsdp_state()._mp_policy`); FSDP2
    does not expose it. The GPU bench reports the dtype a run really computed in from it."""
    return module._get_fsdp_state()._mp_policy


# torch.save's format, written without torch.save (resume/verified.py, resume/sharded/tools.py)


def zip_file_writer(f) -> Any:
    """torch.save's zip writer over the binary file `f`, without each entry's CRC-32 (`torch._C.PyTorchFileWriter(f,
    compute_crc32=False, alignment)`), as torch.save builds it; torch.save has no option to skip the CRC."""
    import torch

    return torch._C.PyTorchFileWriter(f, False, storage_alignment())


def write_records(obj: Any, zip_file) -> None:
    """torch.save's records of `obj` (data.pkl, the storages, version, alignment, byte order) into `zip_file`, with
    torch's default pickle module and protocol: `torch.serialization._save`, torch.save's body after it opened its
    writer."""
    import pickle

    import torch

    torch.serialization._save(obj, zip_file, pickle, torch.serialization.DEFAULT_PROTOCOL, False)


def storage_alignment() -> int:
    """The alignment of storages in a torch.save file (`torch.serialization._get_storage_alignment`, 64)."""
    import torch

    return torch.serialization._get_storage_alignment()


def untyped_storage_dtypes() -> Any:
    """The dtypes torch.save writes as untyped storages (`torch.storage._new_dtypes`: uint16 and the newer ones),
    rebuilt with `rebuild_tensor(untyped=True)`; the others are typed storages."""
    import torch

    return torch.storage._new_dtypes()


def typed_storage_class(dtype) -> Any:
    """The typed storage class torch.save names for `dtype` (FloatStorage for float32:
    `torch.storage._dtype_to_storage_type_map`)."""
    import torch

    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


def rebuild_tensor(untyped: bool) -> Callable:
    """The function torch.save's pickle calls to rebuild a tensor (`torch._utils._rebuild_tensor_v3` for untyped
    storages, which takes the dtype, else `_rebuild_tensor_v2`)."""
    import torch

    return torch._utils._rebuild_tensor_v3 if untyped else torch._utils._rebuild_tensor_v2


def typed_storage_record(storage) -> Tuple[Any, Any, Any, int]:
    """(untyped storage, its identity, storage class, size in elements) of a TypedStorage, what torch.save's
    persistent id of it holds (`_untyped_storage`, `_cdata`, `_pickle_storage_type`, `_size`)."""
    import torch

    untyped = storage._untyped_storage
    return untyped, untyped._cdata, getattr(torch, storage._pickle_storage_type()), storage._size()


def untyped_storage_identity(storage) -> int:
    """An untyped storage's identity (`_cdata`, its C++ address), what torch.save keys its records by."""
    return storage._cdata


# torch's fake process group, fake tensors and memory tracker: `lit-pretrain simulate` (lit_pretrain/simulate/)


def init_fake_process_group(rank: int, world_size: int) -> None:
    """torch.distributed initialized on torch's fake backend ("fake"): every group forms and every collective returns
    at once, moving nothing, so one process plays rank `rank` of `world_size`. The store is
    `torch.testing._internal.distributed.fake_pg.FakeStore` (importing that module registers the backend); torch
    has no public fake backend, and torchtitan's dry-run mode (COMM_MODE=fake_backend) uses the same one."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def fake_tensor_mode() -> Any:
    """A `torch._subclasses.fake_tensor.FakeTensorMode` under which tensors carry shape, dtype and device but no
    storage (allow_non_fake_inputs: `to_empty` reads the meta tensors the model was built with). torch exposes it
    only under torch._subclasses."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def memory_tracker() -> Any:
    """`torch.distributed._tools.mem_tracker.MemTracker` (a dispatch mode that counts the bytes of every storage made
    or touched in its context by kind: parameters, buffers, gradients, activations, temporaries, optimizer state;
    what torchtitan's memory estimation uses), changed in two private places for the simulation:

    - the peak is kept per device only (`_update_peak_stats`): its per-module peaks cost a pass over every module
      at every op, minutes for a 32-layer model, and nothing here reads them;
    - what DTensor's sharding propagation makes is not counted (`ShardingPropagator._propagate_tensor_meta_non_
      cached`, patched while the tracker is entered): it infers an op's output by running it on empty tensors of
      the GLOBAL shape, which under our FakeTensorMode look like allocations. Counted, they made the first AdamW
      step's state look like the unsharded model's (docs/large-runs.md); on a GPU they never touch its memory;
    - a root module may run forward again before the step ends (`_pre_fw_hook`): a pipeline schedule runs each
      stage once per micro-batch, where the tracker would refuse a second iteration's forward."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    class Tracker(MemTracker):
        def __init__(self):
            super().__init__()
            self._shape_only = 0

        def _update_peak_stats(self, peak_state) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot["Total"]:
                    self._peak_mem[device] = snapshot["Total"]
                    self._peak_mem_snap[device] = dict(snapshot)

        def _pre_fw_hook(self, module, inputs) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw and \
                    set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}:
                del self.memory_tracking[module]  # a root's next forward: a pipeline schedule's next micro-batch
            super()._pre_fw_hook(module, inputs)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self._shape_only:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def __enter__(self):
            original = self._propagate = ShardingPropagator._propagate_tensor_meta_non_cached
            tracker = self

            def propagate(*args, **kwargs):
                tracker._shape_only += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    tracker._shape_only -= 1

            ShardingPropagator._propagate_tensor_meta_non_cached = propagate
            return super().__enter__()

        def __exit__(self, *exc):
            ShardingPropagator._propagate_tensor_meta_non_cached = self._propagate
            return super().__exit__(*exc)

    return Tracker()


def peak_by_kind(tracker) -> Dict[str, int]:
    """{kind: bytes} of `tracker`'s (memory_tracker) snapshot at its peak, summed over devices, with "Total": the
    kinds are `_MemRefType` members (str enums: "Parameter", "Gradient", "Activation", "Temp", "Optstate", ...)."""
    out: Dict[str, int] = {}
    for snapshot in tracker.get_tracker_snapshot("peak").values():
        for kind, size in snapshot.items():
            out[str(getattr(kind, "value", kind))] = out.get(str(getattr(kind, "value", kind)), 0) + size
    return out


def dispatch_mode_class() -> Any:
    """`torch.utils._python_dispatch.TorchDispatchMode`, the base of a mode that sees every aten and c10d op (the
    collective counter of lit_pretrain/simulate/collectives.py); public in use, private in path."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def group_name_to_ranks(group_name: str) -> List[int]:
    """The global ranks of the process group a functional collective names (`_c10d_functional` ops carry the group
    by name): `distributed_c10d._resolve_process_group`, then its ranks; torch resolves names only privately."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_process_group_ranks(_resolve_process_group(group_name))


def pipeline_stage_shapes(stage, inputs: Tuple[Any, ...], outputs: Tuple[Any, ...]) -> None:
    """Give a built `torch.distributed.pipelining.PipelineStage` its input and output tensors' metadata, as its
    constructor's `input_args`/`output_args` would: the schedule's first step then skips the shape inference that
    sends each stage's output shapes to the next as pickled objects (`_send_meta`/`_recv_meta`, object collectives),
    which torch's fake backend cannot carry. The stage keeps what it was given in `_user_meta` (a `_StageMeta`),
    set here after the build so the one `apply_plan` builds the stages of a simulation and of a run alike. The stage
    then checks every micro-batch's inputs and outputs against them (`_runtime_validate`, on by default only at
    TORCH_DISTRIBUTED_DEBUG=DETAIL): a stated shape or dtype that the stage does not compute fails its step."""
    from torch.distributed.pipelining._utils import _StageMeta, extract_tensor_metas

    stage._user_meta = _StageMeta(inputs=extract_tensor_metas(tuple(inputs)),
                                  outputs=extract_tensor_metas(tuple(outputs)))
    stage._runtime_validate = True
