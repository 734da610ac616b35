"""Strategy config → Lightning strategy."""

import json
import tempfile
from datetime import timedelta

import lightning
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lit_pretrain.errors import ConfigError
from lit_pretrain.internals import process_group_timeout
from lit_pretrain.launch.launcher import WatchedLauncher
from lit_pretrain.parallel.zero import zero_partition
from lit_pretrain.planning.plan import plan_from
from lit_pretrain.schema import StrategyConfig, TrainerConfig
from lit_pretrain.strategy.build import build_strategy


def test_single_is_one_process():
    assert build_strategy(StrategyConfig(name="single"), TrainerConfig()) == "auto"


def test_single_refuses_several_devices_and_says_what_to_choose():
    with pytest.raises(ConfigError, match=r"strategy\.name=single .*trainer\.devices=2.*choose strategy=ddp"):
        build_strategy(StrategyConfig(name="single"), TrainerConfig(devices=2))


def test_ddp_forms_its_process_group_with_the_backend_and_timeout(tmp_path, monkeypatch):
    """The configured backend and timeout reach the process group a run forms (through the bounded start-up), and
    Lightning's launcher is the one that waits for the watchdog: one rank, in this process."""
    for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)  # Lightning sets them; monkeypatch restores them after
    strategy = build_strategy(StrategyConfig(name="ddp", process_group_backend="gloo", timeout_seconds=42),
                              TrainerConfig(devices=2))
    assert isinstance(strategy, DDPStrategy) and strategy.startup_timeout_seconds is not None
    seen = {}

    class Group(lightning.Callback):
        def on_train_start(self, trainer, pl_module):
            group = dist.group.WORLD
            # torch has no public getter for a group's timeout: its backend's options hold it.
            seen.update(backend=dist.get_backend(group), world=dist.get_world_size(group),
                        timeout=group._get_backend(torch.device("cpu")).options._timeout)

    trainer = lightning.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[Group()], default_root_dir=tmp_path)
    try:
        trainer.fit(BoringModel())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert type(strategy.launcher) is WatchedLauncher
    assert seen == {"backend": "gloo", "world": 1, "timeout": timedelta(seconds=42)}


def test_world_size_counts_nodes():
    # The plan's degrees multiply to devices x num_nodes: ddp's replicas take all 12 processes.
    plan = plan_from(StrategyConfig(name="ddp"), TrainerConfig(devices=4, num_nodes=3))
    assert (plan.world_size, plan.data_parallel_replicate) == (12, 12)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_2_and_3_are_fsdp2_over_one_data_parallel_group(stage):
    strategy = build_strategy(StrategyConfig(name="zero", zero_stage=stage, timeout_seconds=42),
                              TrainerConfig(devices=4, num_nodes=2))
    assert isinstance(strategy, ModelParallelStrategy)
    # All 8 ranks shard the model (no tensor parallelism), and checkpoints are one consolidated file.
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (8, 1)
    assert strategy._save_distributed_checkpoint is False
    assert process_group_timeout(strategy) == timedelta(seconds=42)


@pytest.mark.slow
def test_zero_1_is_ddp_with_a_sharded_optimizer(tmp_path):
    """ZeRO-1 is DDP whose optimizer state is split: on 2 processes each rank holds the state of its own share of
    the parameters, the shares disjoint and together every parameter (ZeroRedundancyOptimizer's partition)."""
    import torch.multiprocessing as mp

    from tests.helpers.strategy_workers import optimizer_state_names

    strategy = build_strategy(StrategyConfig(name="zero", zero_stage=1), TrainerConfig(devices=2))
    assert isinstance(strategy, DDPStrategy) and strategy.plan.zero_stage == 1
    mp.start_processes(optimizer_state_names, nprocs=2, join=True, start_method="spawn",
                       args=(2, f"file://{tmp_path}/pg", strategy.plan.zero_stage, str(tmp_path)))
    held = [set(json.loads((tmp_path / f"{rank}.json").read_text())) for rank in range(2)]
    from lit_pretrain.model.config import GPTConfig
    from lit_pretrain.model.gpt import GPT

    gpt = GPT(GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=2, seq_len=8))
    every = {n for n, _ in gpt.named_parameters()}
    assert held[0] and held[1] and not held[0] & held[1] and held[0] | held[1] == every


def test_zero_refuses_a_precision_fsdp_cannot_run():
    with pytest.raises(ConfigError, match=r"trainer\.precision=16-mixed .*strategy\.zero_stage=3.*bf16-mixed"):
        build_strategy(StrategyConfig(name="zero", zero_stage=3), TrainerConfig(devices=2, precision="16-mixed"))


@pytest.mark.parametrize("name, stage, expected", [("single", None, 0), ("ddp", None, 0), ("tensor", None, 0),
                                                   ("zero", None, 3), ("zero", 1, 1), ("ddp", 2, 2)])
def test_zero_stage_defaults_by_preset_and_the_key_wins(name, stage, expected):
    devices = 2 if name != "single" else 1
    strategy = StrategyConfig(name=name, zero_stage=stage, tensor_parallel=2 if name == "tensor" else 1)
    assert plan_from(strategy, TrainerConfig(devices=devices)).zero_stage == expected


def test_compositions_run_under_the_mesh_strategy():
    from lit_pretrain.strategy.mesh_strategy import MeshStrategy

    for strategy, devices in [(StrategyConfig(name="tensor", tensor_parallel=2, zero_stage=3), 4),
                              (StrategyConfig(name="zero", data_parallel_replicate=2), 4)]:
        built = build_strategy(strategy, TrainerConfig(devices=devices))
        assert isinstance(built, MeshStrategy) and built.plan.world_size == devices


def test_zero_partition_is_greedy_by_size_across_groups():
    # By hand: group 0 largest first: 10 → rank 0 (tie: lowest rank), 6 → rank 1, 5 → rank 1 (6 < 10); totals
    # 10 | 11. Group 1 continues from those totals: 4 → rank 0 (10 < 11), 3 → rank 1 (11 < 14).
    assert zero_partition([[5, 10, 6], [3, 4]], 2) == [[[1], [2, 0]], [[1], [0]]]


def test_zero_partition_matches_zero_redundancy_optimizer():
    """Our pure function against torch's own partition of the GPT's groups. The partition depends on the sizes
    and the world size alone, so torch's is asked for 2 ranks inside a 1-process group (no processes to start)."""
    import torch.distributed as dist

    from lit_pretrain.model.config import GPTConfig
    from lit_pretrain.model.gpt import GPT
    from lit_pretrain.optim.optimizers import build_adamw, param_groups
    from lit_pretrain.schema import OptimConfig

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
    try:
        model = GPT(GPTConfig(vocab_size=513, n_layers=2, d_model=64, n_heads=4, seq_len=16))
        groups = param_groups(model, 0.1)
        opt = build_adamw(model, OptimConfig(weight_decay=0.1), zero_stage=1)  # the ZeroRedundancyOptimizer
        opt.world_size = 2  # partition for 2 ranks from the same sizes
        opt._partition_parameters_cache = []
        theirs = opt._partition_parameters()
        ours = zero_partition([[p.numel() for p in g["params"]] for g in groups], 2)
        for rank in range(2):
            for g, group in enumerate(groups):
                assert [id(p) for p in theirs[rank][g]["params"]] == [id(group["params"][i]) for i in ours[g][rank]]
    finally:
        dist.destroy_process_group()
