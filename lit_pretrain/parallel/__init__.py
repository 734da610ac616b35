"""How work is split across devices: config → Lightning strategy. Wraps the plain model from outside."""

from typing import Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lit_pretrain.model_config import GPTConfig
from lit_pretrain.schema import StrategyConfig


def parallelize(model: nn.Module, model_cfg: GPTConfig, strategy: StrategyConfig,
                mesh: Optional[DeviceMesh] = None, compile: bool = False) -> nn.Module:
    """Wrap the GPT in place in torchtitan's order: activation checkpointing, compile (regional, when `compile`),
    then FSDP (ZeRO stages 2 and 3).

    DDP (and ZeRO stage 1's DDP) wraps the module later, in Lightning's strategy; a stage-1 optimizer is chosen in
    the module's configure_optimizers. Idempotent: Lightning may call configure_model again (e.g. trainer.validate).
    """
    from lit_pretrain.parallel.activation_checkpointing import apply_activation_checkpointing
    from lit_pretrain.parallel.strategies import uses_fsdp
    from lit_pretrain.parallel.zero import shard_model

    apply_activation_checkpointing(model, model_cfg.activation_checkpointing, model_cfg.activation_checkpointing_k)
    if compile:
        from lit_pretrain.parallel.compile import check_toolchain, compile_blocks

        check_toolchain()
        compile_blocks(model)
    if uses_fsdp(strategy):
        if mesh is None:
            raise ValueError(f"strategy.zero_stage={strategy.zero_stage} needs a device mesh: "
                             "run it under the strategy build_strategy returns")
        shard_model(model, mesh, strategy.zero_stage)
    return model
