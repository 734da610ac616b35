"""The Lightning strategy of a parallel plan (planning/plan.py): a table, nothing else decided here.

The same config runs on CPU (gloo) and on GPUs (nccl): the backend is chosen from the accelerator unless
`strategy.process_group_backend` says otherwise.

| plan | Lightning strategy | what our code adds |
|---|---|---|
| one process | "auto" (one device) | |
| data_parallel_replicate only, zero_stage 0 or 1 | DDPStrategy | ZeRO-1: ZeroRedundancyOptimizer (optim) |
| data_parallel_shard only, zero_stage 2 or 3 | ModelParallelStrategy (resume/gathered.py) | FSDP2 in apply_plan |
| tensor, pipeline, expert, context parallel > 1, or HSDP | MeshStrategy (strategy/mesh_strategy.py) | apply_plan |

Lightning's own FSDPStrategy refuses CPUs and refuses norm-based gradient clipping; ModelParallelStrategy runs
FSDP2 on both and leaves clipping to our module, which reduces the norm over the whole sharded gradient. ZeRO-1
under context parallelism runs on our mesh: its gradient all-reduce, then ZeroRedundancyOptimizer (optim).
"""

from datetime import timedelta
from typing import Optional

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy

from lit_pretrain.launch.launcher import WatchedLaunch
from lit_pretrain.launch.startup import BoundedStartup
from lit_pretrain.planning.plan import ParallelPlan, plan_from
from lit_pretrain.resume.gathered import GatheredOneFile
from lit_pretrain.resume.sharded.load import ShardedLoad
from lit_pretrain.schema import StrategyConfig, TrainerConfig


class ShardedDDPStrategy(WatchedLaunch, BoundedStartup, ShardedLoad, DDPStrategy):
    """Lightning's DDPStrategy (ZeRO-1 included) that also resumes from a sharded folder."""


class VerifiedModelParallelStrategy(WatchedLaunch, BoundedStartup, ShardedLoad, GatheredOneFile, ModelParallelStrategy):
    """Lightning's ModelParallelStrategy (plain ZeRO-2/3) with our mesh strategy's one-file checkpoint
    (resume/gathered.py: checked against its sha256 sidecar on every rank, loaded weights-only, the optimizer state
    by parameter name) and sharded folders (ShardedLoad, resume/sharded/load.py)."""


class PolicyPrecision(Precision):
    """trainer.precision=bf16-mixed when FSDP2's mixed-precision policy casts (plan.mixed_precision_policy): no
    torch.autocast around the step. The policy already gathers bf16 parameters and casts each block's inputs, so
    every matmul runs in bf16; autocast would add a cast-cache lookup to every op and re-cast what it lists as fp32
    ops (on GPUs: softmax, the norms, the loss) in its own way, two precision rules for one step. torchtitan and
    OLMo-core run FSDP2's policy without autocast too (autocast only where there is no FSDP). What must be fp32 is
    fp32 by construction: the norms (model/gpt.py), RoPE's rotation, the loss (model/losses.py), the reduce-scatter
    and the master weights. Named "bf16-mixed", as the run asked, for the MFU's peak and the console."""

    precision = "bf16-mixed"


def build_strategy(strategy: StrategyConfig, trainer: TrainerConfig,
                   plan: Optional[ParallelPlan] = None) -> Strategy | str:
    """The Lightning strategy for `plan` (built from the two sections when not given; a ConfigError for a layout
    the plan refuses)."""
    plan = plan or plan_from(strategy, trainer)
    if plan.world_size == 1 and not plan.uses_fsdp:
        # "auto" lets Lightning pick the one device (CPU or the first GPU) as a SingleDeviceStrategy.
        return "auto"
    config = strategy
    timeout = timedelta(seconds=config.timeout_seconds)
    backend = config.process_group_backend
    if plan.uses_mesh:
        from lit_pretrain.strategy.mesh_strategy import MeshStrategy

        mesh_strategy = MeshStrategy(plan, backend, timeout)
        if plan.mixed_precision_policy:
            mesh_strategy.precision_plugin = PolicyPrecision()
        return watched(mesh_strategy, config)
    if plan.uses_fsdp:
        # Every rank in one data-parallel group (no tensor parallelism). A one-file checkpoint (written by rank 0)
        # is gathered and read back by parameter name, as under our mesh (resume/gathered.py), so it loads into
        # any layout and any layout's file loads here.
        strategy = VerifiedModelParallelStrategy(
            data_parallel_size=plan.world_size, tensor_parallel_size=1, save_distributed_checkpoint=False,
            process_group_backend=backend, timeout=timeout)
    else:
        strategy = ShardedDDPStrategy(process_group_backend=backend, timeout=timeout)
    strategy.plan = plan  # read by PretrainModule.plan (ZeRO-1's optimizer, FSDP's stage)
    if plan.mixed_precision_policy:
        strategy.precision_plugin = PolicyPrecision()
    return watched(strategy, config)


def watched(strategy: Strategy, config: StrategyConfig) -> Strategy:
    """Lightning's local launcher kills every rank soon after one fails; with the watchdog on, it waits for the
    watchdog's report first (launch/launcher.py), a margin past its peer timeout. The world forms within
    strategy.startup_timeout_seconds (launch/startup.py)."""
    if config.peer_failure_timeout_seconds > 0:
        strategy.launch_grace_seconds = config.peer_failure_timeout_seconds + 10.0
    strategy.startup_timeout_seconds = config.startup_timeout_seconds  # launch/startup.py
    return strategy
