"""Strategy config → Lightning strategy."""

from datetime import timedelta

import pytest
from lightning.pytorch.strategies import DDPStrategy

from lit_pretrain.errors import ConfigError
from lit_pretrain.parallel.strategies import build_strategy, world_size
from lit_pretrain.schema import StrategyConfig, TrainerConfig


def test_single_is_one_process():
    assert build_strategy(StrategyConfig(name="single"), TrainerConfig()) == "auto"


def test_single_refuses_several_devices_and_says_what_to_choose():
    with pytest.raises(ConfigError, match=r"strategy\.name=single .*trainer\.devices=2.*choose strategy=ddp"):
        build_strategy(StrategyConfig(name="single"), TrainerConfig(devices=2))


def test_ddp_carries_backend_and_timeout():
    strategy = build_strategy(StrategyConfig(name="ddp", process_group_backend="gloo", timeout_seconds=42),
                              TrainerConfig(devices=2))
    assert isinstance(strategy, DDPStrategy)
    assert strategy.process_group_backend == "gloo"
    assert strategy._timeout == timedelta(seconds=42)


def test_world_size_counts_nodes():
    assert world_size(TrainerConfig(devices=4, num_nodes=3)) == 12
