"""Turn the `strategy` config section into a Lightning strategy.

The same config runs on CPU (gloo) and on GPUs (nccl): the backend is chosen from the accelerator unless
`strategy.process_group_backend` says otherwise.

| strategy | Lightning strategy | what our module adds |
|---|---|---|
| single | "auto" (one device) | |
| ddp | DDPStrategy | |
| zero, zero_stage=1 | DDPStrategy | ZeroRedundancyOptimizer (`parallel.zero.build_adamw`) |
| zero, zero_stage=2, 3 | ModelParallelStrategy (all ranks data parallel; verified loads) | FSDP2 in `configure_model` |
| tensor, pipeline | MeshStrategy (parallel/mesh_strategy.py) | tensor/pipeline wrappers, data-parallel all-reduce |

Lightning's own FSDPStrategy refuses CPUs and refuses norm-based gradient clipping; ModelParallelStrategy runs
FSDP2 on both and leaves clipping to our module, which reduces the norm over the whole sharded gradient.
"""

from datetime import timedelta

from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy

from lit_pretrain.errors import ConfigError
from lit_pretrain.resume.verified import verify
from lit_pretrain.schema import StrategyConfig, TrainerConfig

# Precisions Lightning's ModelParallelStrategy accepts (lightning/pytorch/trainer/connectors/accelerator_connector.py).
FSDP_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


def world_size(trainer: TrainerConfig) -> int:
    return trainer.devices * trainer.num_nodes


def zero_stage(strategy: StrategyConfig) -> int | None:
    """The ZeRO stage a config asks for, or None when no state is sharded (single, ddp)."""
    return strategy.zero_stage if strategy.name == "zero" else None


def uses_fsdp(strategy: StrategyConfig) -> bool:
    return zero_stage(strategy) in (2, 3)


class VerifiedModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy loads a one-file checkpoint with its own torch.load, not through
    checkpoint_io: check the file against its sha256 sidecar first on every rank, and load it weights-only."""

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        path = self.broadcast(checkpoint_path)
        verify(path)
        return super().load_checkpoint(path, weights_only=True)


def build_strategy(strategy: StrategyConfig, trainer: TrainerConfig) -> Strategy | str:
    if strategy.name == "single":
        if world_size(trainer) > 1:
            raise ConfigError(
                f"strategy.name=single runs one process, but trainer.devices={trainer.devices} and "
                f"trainer.num_nodes={trainer.num_nodes}: choose strategy=ddp, or set trainer.devices=1"
            )
        # "auto" lets Lightning pick the one device (CPU or the first GPU) as a SingleDeviceStrategy.
        return "auto"
    timeout = timedelta(seconds=strategy.timeout_seconds)
    if strategy.name == "ddp" or (strategy.name == "zero" and strategy.zero_stage == 1):
        return DDPStrategy(process_group_backend=strategy.process_group_backend, timeout=timeout)
    if strategy.name == "zero":
        if trainer.precision not in FSDP_PRECISIONS:
            raise ConfigError(
                f"trainer.precision={trainer.precision} is not supported with strategy.name=zero and "
                f"strategy.zero_stage={strategy.zero_stage} (FSDP2 under Lightning's ModelParallelStrategy): "
                f"choose one of {', '.join(FSDP_PRECISIONS)}"
            )
        # Every rank in one data-parallel group (no tensor parallelism). A consolidated checkpoint (one file,
        # written by rank 0) reads back like any other strategy's: the full state dict is gathered without the
        # FSDP1 full-state-dict path that crashes on CPU (shared/CPU-DISTRIBUTED.md).
        return VerifiedModelParallelStrategy(
            data_parallel_size=world_size(trainer), tensor_parallel_size=1, save_distributed_checkpoint=False,
            process_group_backend=strategy.process_group_backend, timeout=timeout,
        )
    if strategy.name in ("tensor", "pipeline"):  # our wrappers on one (pipeline, data, tensor) mesh
        from lit_pretrain.parallel.layout import Layout
        from lit_pretrain.parallel.mesh_strategy import MeshStrategy

        t, p = strategy.tensor_parallel, strategy.pipeline_parallel
        return MeshStrategy(strategy, Layout(world_size(trainer) // (t * p), t, p), timeout)
    raise ConfigError(f"strategy.name={strategy.name!r}: expected single, ddp, zero, tensor or pipeline")
