"""Plans on our own mesh (tensor, pipeline, HSDP and their compositions with ZeRO): Lightning's
ModelParallelStrategy (its launcher, process-group set-up, CPU and GPU alike) with the 4-D mesh of the plan
(planning/plan.py); the module's `configure_model` applies the plan (parallel.apply.apply_plan) on that mesh.

What it changes in Lightning's step, and why:
- `setup_environment`: builds the (pipeline, data_parallel_replicate, data_parallel_shard, tensor_parallel) mesh.
- `setup`: hands the pipeline runner the accumulation factor; the module's loss runs the schedule (forward and,
  when training, backward: the module's own `backward` hook then does nothing, and it zeroes gradients before an
  accumulation's first micro-batch rather than where Lightning would, after its training step).
- `optimizer_step`: after the closure's last backward and before the callbacks and clipping see the gradients,
  `ParallelModel.sync_gradients` (tied embedding over the pipeline, norms under sequence parallelism, replicas).
- `distributed_sampler_kwargs`: the data-parallel rank and size (replica x shard); tensor- and pipeline-parallel
  ranks of one replica read the same batch; `data_parallel_sum` sums over those ranks only (model.moe's counts).
- checkpoints: with checkpoint.format=single, rank 0 writes one file through `self.checkpoint_io` holding the
  single-process state dict and the optimizer state by parameter name (resume/gathered.py, as plain ZeRO-2/3), so
  it loads into one process or into any other layout; with the sharded format (the default on several processes)
  each rank writes its own share instead (resume/sharded/save.py) and `load_checkpoint` reads a folder into this
  layout (resume/sharded/load.py).
"""

from datetime import timedelta
from typing import Dict, Optional

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from lit_pretrain.internals import setup_process_group
from lit_pretrain.launch.launcher import WatchedLaunch
from lit_pretrain.launch.startup import BoundedStartup
from lit_pretrain.parallel.mesh import build_mesh
from lit_pretrain.planning.plan import ParallelPlan
from lit_pretrain.resume.gathered import GatheredOneFile
from lit_pretrain.resume.sharded.load import ShardedLoad


def full_gpt_on_meta(model_cfg):
    """The single-process GPT's structure (names, order, parameter groups) without memory."""
    from lit_pretrain.model.gpt import GPT

    with torch.device("meta"):
        return GPT(model_cfg)


class MeshStrategy(WatchedLaunch, BoundedStartup, ShardedLoad, GatheredOneFile, ModelParallelStrategy):
    def __init__(self, plan: ParallelPlan, process_group_backend: Optional[str], timeout: timedelta):
        super().__init__(data_parallel_size=plan.data_parallel, tensor_parallel_size=plan.tensor_parallel,
                         save_distributed_checkpoint=False, process_group_backend=process_group_backend,
                         timeout=timeout)
        self.plan = plan

    def setup_environment(self) -> None:
        setup_process_group(self)
        self._device_mesh = build_mesh(self.plan, self.root_device.type)
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def parallel(self):
        """The module's ParallelModel (made by its configure_model through parallel.apply.apply_plan)."""
        return self.lightning_module.parallel

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, int]:
        mesh = self.device_mesh
        shard = mesh["data_parallel_shard"]
        rank = mesh["data_parallel_replicate"].get_local_rank() * shard.size() + shard.get_local_rank()
        return {"num_replicas": self.plan.data_parallel, "rank": rank}

    def data_parallel_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the data-parallel ranks only (replicas x shards), not over the world: tensor-parallel
        ranks of one replica hold the same tokens' values and pipeline stages other layers' (model.moe's routing
        counts, moe.end_step)."""
        from lit_pretrain.parallel.moe_mesh import data_parallel_sum

        mesh = self.device_mesh
        # context-parallel ranks counted the other parts of their sequences
        names = ("data_parallel_replicate", "data_parallel_shard") + (
            ("context_parallel",) if self.plan.context_parallel > 1 else ())
        return data_parallel_sum(tensor, [mesh.get_group(n) for n in names])

    def setup(self, trainer) -> None:
        super().setup(trainer)
        if self.parallel.runner is not None:
            self.parallel.runner.scale = 1.0 / trainer.accumulate_grad_batches

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        def closure_then_sync():
            result = closure()
            self.parallel.sync_gradients()
            return result

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
