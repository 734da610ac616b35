"""Each private Lightning/torch name lit_pretrain/internals.py reaches still exists and behaves as it did: an upgrade
that changes one fails here, naming the version and the function, instead of in a run."""

import ast
import inspect
import tempfile
import textwrap
from datetime import timedelta

import lightning
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lit_pretrain import internals

VERSIONS = f"lightning {lightning.__version__}, torch {torch.__version__} (verified: {internals.VERIFIED})"


def changed(function: str, what: str) -> str:
    return f"{VERSIONS}: internals.{function} no longer holds: {what}; update lit_pretrain/internals.py"


class Tiny(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("tiny_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.arange(8.0).view(4, 2))
        return torch.utils.data.DataLoader(data, batch_size=1)


class Recorder(lightning.Callback):
    def __init__(self):
        self.completed, self.logged = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.completed.append((batch_idx, internals.batches_completed_in_epoch(trainer)))


@pytest.fixture(scope="module")
def fitted():
    """A CPU Trainer after 3 steps of one 4-batch epoch, its log_metrics calls recorded through the connector."""
    module, recorder = Tiny(), Recorder()
    trainer = lightning.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                                callbacks=[recorder],
                                default_root_dir=tempfile.mkdtemp(dir="/tmp"))
    connector = internals.logger_connector(trainer)
    lightning_log_metrics = connector.log_metrics

    def log_metrics(metrics, step=None):
        recorder.logged.append((dict(metrics), step))
        lightning_log_metrics(metrics, step)

    connector.log_metrics = log_metrics
    assert internals.attached_trainer(module) is None, changed("attached_trainer", "None on a bare module")
    trainer.fit(module)
    return trainer, module, recorder


def test_logger_connector_routes_every_logged_row(fitted):
    trainer, _, recorder = fitted
    params = list(inspect.signature(internals.logger_connector(trainer).log_metrics).parameters)
    assert params == ["metrics", "step"], changed("logger_connector", f"log_metrics(metrics, step) is now {params}")
    rows = [m for m, step in recorder.logged if "tiny_loss" in m and step is None]
    assert len(rows) == 3, changed("logger_connector", f"3 rows of self.log with step=None, got {recorder.logged}")


def test_batches_completed_in_epoch_counts_batches_before_this_one(fitted):
    _, _, recorder = fitted
    assert recorder.completed == [(0, 0), (1, 1), (2, 2)], changed("batches_completed_in_epoch", recorder.completed)


def test_attached_trainer_is_the_fitting_trainer(fitted):
    trainer, module, _ = fitted
    assert internals.attached_trainer(module) is trainer, changed("attached_trainer", "the Trainer after fit")


def test_dump_checkpoint_and_its_loop_state(fitted):
    trainer, _, _ = fitted
    checkpoint = internals.dump_checkpoint(trainer, weights_only=False)
    keys = {"state_dict", "loops", "optimizer_states", "global_step", "epoch", "callbacks"}
    assert keys <= set(checkpoint) and checkpoint["global_step"] == 3, \
        changed("dump_checkpoint", f"keys {sorted(keys)} and global_step 3, got {sorted(checkpoint)}")
    fit_loop = checkpoint["loops"]["fit_loop"]
    progress = internals.saved_batch_progress(fit_loop)
    counts = {"ready": 3, "started": 3, "processed": 3, "completed": 3}
    assert progress["current"] == counts and progress["total"] == counts and progress["is_last_batch"] is False, \
        changed("saved_batch_progress", f"counts {counts} after 3 of 4 batches, got {progress}")
    stepped = internals.saved_epoch_loop_state(fit_loop)["_batches_that_stepped"]
    assert stepped == 3, changed("saved_epoch_loop_state", f"_batches_that_stepped 3, got {stepped}")


# What launch/launcher.py's launch_local_ranks copies, Lightning's observer aside.
LAUNCH_BODY = """
self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
if not self.cluster_environment.creates_processes_externally:
    self._call_children_scripts()
    _launch_process_observer(self.procs)
_set_num_threads_if_needed(num_processes=self.num_processes)
return function(*args, **kwargs)
"""


def test_launch_local_ranks_is_lightnings_launch_body():
    launch = internals.SubprocessScriptLauncher.launch
    tree = ast.parse(textwrap.dedent(inspect.getsource(launch))).body[0]
    body = [s for s in tree.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    theirs = [ast.dump(s) for s in body]
    ours = [ast.dump(s) for s in ast.parse(LAUNCH_BODY).body]
    assert theirs == ours, changed("launch_local_ranks", "_SubprocessScriptLauncher.launch's body changed: "
                                   "copy the new one")


def test_launch_local_ranks_starts_children_then_observes_them(monkeypatch):
    from lightning.pytorch.plugins.environments import LightningEnvironment

    # A LOCAL_RANK left in this worker's environment (by an earlier test) means "launched from outside": no children.
    monkeypatch.delenv("LOCAL_RANK", raising=False)

    launcher = internals.SubprocessScriptLauncher(LightningEnvironment(), num_processes=1, num_nodes=1)
    started, observed = [], []
    monkeypatch.setattr(launcher, "_call_children_scripts", lambda: (started.append(1), setattr(launcher, "procs", [])))
    assert internals.launch_local_ranks(launcher, lambda x, y: x + y, (2,), {"y": 3}, observed.append) == 5
    assert started == [1] and observed == [[]], changed("launch_local_ranks", "children started, then observed")


@pytest.mark.parametrize("name", ["ddp", "zero"])
def test_local_launcher_swap_replaces_lightnings_launcher(name, monkeypatch):
    from lightning.pytorch.plugins.environments import LightningEnvironment

    monkeypatch.delenv("LOCAL_RANK", raising=False)  # else Lightning leaves the launch to whoever set it

    from lit_pretrain.launch.launcher import WatchedLauncher
    from lit_pretrain.schema import StrategyConfig, TrainerConfig
    from lit_pretrain.strategy.build import build_strategy

    strategy = build_strategy(StrategyConfig(name=name), TrainerConfig(devices=2))
    strategy.cluster_environment = LightningEnvironment()
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy._configure_launcher()
    assert type(strategy.launcher) is WatchedLauncher and strategy.launcher.num_processes == 2, \
        changed("LocalLauncherSwap", f"{type(strategy).__name__}._configure_launcher sets _launcher")


@pytest.mark.parametrize("cls, call", [("DDPStrategy", "self.setup_distributed()"),
                                       ("ModelParallelStrategy", "self._setup_distributed()")])
def test_before_process_group_hooks_the_set_up_lightning_calls(cls, call):
    strategy = getattr(lightning.pytorch.strategies, cls)
    assert call in inspect.getsource(strategy.setup_environment), \
        changed("BeforeProcessGroup", f"{cls}.setup_environment calls {call}")


def test_process_group_backend_and_timeout():
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    for strategy in (DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=42)),
                     ModelParallelStrategy(process_group_backend="gloo", timeout=timedelta(seconds=42))):
        got = internals.process_group_backend(strategy), internals.process_group_timeout(strategy)
        assert got == ("gloo", timedelta(seconds=42)), \
            changed("process_group_backend/process_group_timeout", f"{type(strategy).__name__}: {got}")


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp(dir='/tmp')}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_drop_consolidated_state_frees_the_gathered_copy(one_process_group):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = nn.Linear(3, 2)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    opt.consolidate_state_dict(to=0)
    assert len(opt._all_state_dicts) == 1, changed("drop_consolidated_state", "one gathered state per rank")
    opt.state_dict()  # consolidated: readable
    internals.drop_consolidated_state(opt)
    with pytest.raises(RuntimeError, match="consolidate"):
        opt.state_dict()  # the copy is gone (what the next save re-gathers)


def test_local_shape_and_offset(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (1,))
    got = internals.local_shape_and_offset(torch.Size([5, 3]), mesh, [Shard(0)])
    assert tuple(got[0]) == (5, 3) and tuple(got[1]) == (0, 0), changed("local_shape_and_offset", got)
    t = torch.distributed.tensor.distribute_tensor(torch.ones(5, 3), mesh, [Shard(1)])
    assert tuple(internals.local_shape_and_offset(t.shape, t.device_mesh, t.placements)[0]) == (5, 3)


def test_muon_parts_compose_to_torch_muon_step():
    adjust_lr, zeropower = internals.muon_parts()
    assert adjust_lr(0.1, "original", torch.Size([16, 4])) == pytest.approx(0.2), changed("muon_parts", "sqrt(A/B)")
    assert adjust_lr(0.1, "match_rms_adamw", torch.Size([16, 4])) == pytest.approx(0.08), \
        changed("muon_parts", "0.2·sqrt(max(A, B))")
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(8, 4))
    p.grad = torch.randn(8, 4)
    before = p.detach().clone()
    opt = torch.optim.Muon([p], lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False)
    g = opt.param_groups[0]
    ortho = zeropower(p.grad, g["ns_coefficients"], g["ns_steps"], g["eps"])
    ours = before.add(ortho, alpha=-adjust_lr(0.1, g["adjust_lr_fn"], p.shape))  # as Muon adds its bf16 update
    opt.step()
    assert torch.equal(p.detach(), ours), changed("muon_parts", "one Muon step is p - adjust_lr * zeropower(grad)")


def test_every_lazy_name_resolves():
    for name, (module, attr) in internals.LAZY.items():
        try:
            getattr(internals, name)
        except (ImportError, AttributeError) as err:
            pytest.fail(changed(name, f"{module}.{attr} is gone ({err})"))


def test_checkpoint_wrapper_keeps_plain_names_and_gradients():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    wrapped = internals.checkpoint_wrapper(nn.Sequential(nn.Linear(4, 4), nn.GELU()),
                                           checkpoint_impl=internals.CheckpointImpl.NO_REENTRANT)
    wrapped.load_state_dict(plain.state_dict())
    assert isinstance(wrapped, internals.CheckpointWrapper) and list(wrapped.state_dict()) == ["0.weight", "0.bias"], \
        changed("checkpoint_wrapper", f"plain state-dict names, got {list(wrapped.state_dict())}")
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    wrapped(x).sum().backward()
    grads = [p.grad for p in wrapped.parameters()]
    assert all(torch.equal(a.grad, b) for a, b in zip(plain.parameters(), grads)), \
        changed("checkpoint_wrapper", "recomputed gradients equal the plain module's")


def test_tree_leaves_flattens_nested_containers():
    a, b = torch.zeros(1), torch.ones(1)
    leaves = internals.tree_leaves({"x": [a, (b,)], "y": 3})
    assert len(leaves) == 3 and leaves[0] is a and leaves[1] is b and leaves[2] == 3, \
        changed("tree_leaves", "[a, b, 3] in order")


def test_csv_writer_made_is_none_until_the_writer_is_made(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(tmp_path)
    assert internals.csv_writer_made(logger) is None, changed("csv_writer_made", "None before `experiment`")
    writer = logger.experiment
    assert internals.csv_writer_made(logger) is writer, changed("csv_writer_made", "the writer `experiment` made")


def test_fsdp_mixed_precision_policy(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    module = fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)), mp_policy=policy)
    got = internals.fsdp_mixed_precision_policy(module)
    assert got == policy, changed("fsdp_mixed_precision_policy", f"the policy given, got {got}")


def torch_save_records(obj) -> dict:
    """The entries of torch.save's zip file of `obj`, by name without the archive folder."""
    import io
    import zipfile

    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as zf:
        return {n.split("/", 1)[1]: zf.read(n) for n in zf.namelist()}


def test_torch_save_format_pieces():
    import io
    import pickle

    obj = {"f": torch.arange(3, dtype=torch.float32), "u": torch.tensor([0, 1, 2]).to(torch.uint16)}
    records = torch_save_records(obj)
    assert records[".storage_alignment"] == str(internals.storage_alignment()).encode(), \
        changed("storage_alignment", f"torch.save's .storage_alignment, got {records['.storage_alignment']}")
    found, pids = [], []

    class Probe(pickle.Unpickler):
        def find_class(self, module, name):
            found.append((module, name))
            return (lambda *a: None) if module == "torch._utils" else super().find_class(module, name)

        def persistent_load(self, pid):
            pids.append(pid)

    Probe(io.BytesIO(records["data.pkl"])).load()
    rebuilders = {("torch._utils", internals.rebuild_tensor(untyped=u).__name__) for u in (False, True)}
    assert rebuilders <= set(found), changed("rebuild_tensor", f"torch.save calls {rebuilders}, found {found}")
    storages = [pid[1] for pid in pids]
    assert storages == [internals.typed_storage_class(torch.float32), torch.UntypedStorage], \
        changed("typed_storage_class", f"FloatStorage then UntypedStorage, got {storages}")
    dtypes = internals.untyped_storage_dtypes()
    assert torch.uint16 in dtypes and torch.float32 not in dtypes, changed("untyped_storage_dtypes", dtypes)


def test_zip_file_writer_and_write_records_make_a_file_torch_load_reads():
    import io

    obj = {"f": torch.arange(3, dtype=torch.float32), "u": torch.tensor([0, 1, 2]).to(torch.uint16), "n": 7}
    buf = io.BytesIO()
    zip_file = internals.zip_file_writer(buf)
    internals.write_records(obj, zip_file)
    zip_file.write_end_of_file()
    back = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    same = [back[k].dtype == obj[k].dtype and torch.equal(back[k].int(), obj[k].int()) for k in "fu"]
    assert back["n"] == 7 and all(same), \
        changed("zip_file_writer/write_records", "torch.load reads back what was written")


def test_typed_storage_record():
    t = torch.arange(3, dtype=torch.float32)
    untyped = t.untyped_storage()
    typed = torch.storage.TypedStorage(wrap_storage=untyped, dtype=torch.float32, _internal=True)
    got_untyped, identity, storage_class, size = internals.typed_storage_record(typed)
    got = (identity, storage_class, size)
    assert got == (internals.untyped_storage_identity(untyped), torch.FloatStorage, 3) \
        and got_untyped.data_ptr() == untyped.data_ptr(), changed("typed_storage_record", got)


def test_fake_process_group_fake_tensors_and_group_names():
    """init_fake_process_group, fake_tensor_mode, group_name_to_ranks, dispatch_mode_class: a 4-rank world in this
    process whose collectives return at once, a module made fake from the meta device, a group found by name."""
    import torch.distributed as dist

    internals.init_fake_process_group(2, 4)
    try:
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (2, 4, "fake")
        group = dist.new_group([1, 2])
        assert internals.group_name_to_ranks(group.group_name) == [1, 2]
        seen = []

        class Seen(internals.dispatch_mode_class()):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(str(func))
                return func(*args, **(kwargs or {}))

        with Seen():
            dist.all_reduce(torch.ones(2), group=group)
        assert "c10d.allreduce_.default" in seen
        with torch.device("meta"):
            linear = torch.nn.Linear(1024, 1024)
        with internals.fake_tensor_mode():
            linear.to_empty(device="cpu")
            out = linear(torch.ones(3, 1024))
        assert type(linear.weight).__name__ == "FakeTensor" and out.shape == (3, 1024)
    finally:
        dist.destroy_process_group()


def test_pipeline_stage_shapes_are_kept_and_checked():
    """pipeline_stage_shapes: a built PipelineStage keeps the stated input and output metadata (what its
    input_args/output_args would give) and checks each micro-batch against them."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    internals.init_fake_process_group(0, 2)
    try:
        stage = PipelineStage(torch.nn.Linear(4, 4), 0, 2, torch.device("cpu"))
        x = torch.empty(2, 3, 4, device="meta")
        internals.pipeline_stage_shapes(stage, (x,), (x.to(torch.bfloat16),))
        assert [(m.shape, m.dtype) for m in stage._user_meta.inputs + stage._user_meta.outputs] == \
            [((2, 3, 4), torch.float32), ((2, 3, 4), torch.bfloat16)]
        assert stage._runtime_validate
    finally:
        dist.destroy_process_group()


def test_memory_tracker_counts_by_kind_and_not_dtensor_shape_inference():
    """memory_tracker and peak_by_kind: the peak by kind of a forward and an AdamW step, and a DTensor op's shape
    inference (global-shape empty tensors) left out: a (4096, 64) parameter sharded over 4 counts its (1024, 64)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    internals.init_fake_process_group(0, 4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        fake = internals.fake_tensor_mode()
        with fake:
            weight = torch.nn.Parameter(distribute_tensor(torch.empty(4096, 64), mesh, [Shard(0)],
                                                          src_data_rank=None))
            weight.grad = distribute_tensor(torch.empty(4096, 64), mesh, [Shard(0)], src_data_rank=None)
            optimizer = torch.optim.AdamW([weight], foreach=True)
        tracker = internals.memory_tracker()
        with fake, tracker:
            optimizer.step()  # the first: exp_avg and exp_avg_sq made (zeros_like over a DTensor: shape inference)
        peak = internals.peak_by_kind(tracker)
        shard = 1024 * 64 * 4
        # two moments and foreach's one temporary (sqrt of exp_avg_sq) at most, plus the fp32 step scalar; counted
        # with the global-shape inference (torch's own MemTracker) it reads 15 shards
        assert 2 * shard <= peak["Optstate"] <= 3 * shard + 4, peak
    finally:
        dist.destroy_process_group()
