"""Turn the `strategy` config section into a Lightning strategy.

The same config runs on CPU (gloo) and on GPUs (nccl): the backend is chosen from the accelerator unless
`strategy.process_group_backend` says otherwise.
"""

from datetime import timedelta

from lightning.pytorch.strategies import DDPStrategy, Strategy

from lit_pretrain.errors import ConfigError
from lit_pretrain.schema import StrategyConfig, TrainerConfig


def world_size(trainer: TrainerConfig) -> int:
    return trainer.devices * trainer.num_nodes


def build_strategy(strategy: StrategyConfig, trainer: TrainerConfig) -> Strategy | str:
    if strategy.name == "single":
        if world_size(trainer) > 1:
            raise ConfigError(
                f"strategy.name=single runs one process, but trainer.devices={trainer.devices} and "
                f"trainer.num_nodes={trainer.num_nodes}: choose strategy=ddp, or set trainer.devices=1"
            )
        # "auto" lets Lightning pick the one device (CPU or the first GPU) as a SingleDeviceStrategy.
        return "auto"
    if strategy.name == "ddp":
        return DDPStrategy(
            process_group_backend=strategy.process_group_backend,
            timeout=timedelta(seconds=strategy.timeout_seconds),
        )
    raise ConfigError(f"strategy.name={strategy.name!r}: expected single or ddp")

