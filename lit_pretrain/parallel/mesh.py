"""Tensor × pipeline × data parallelism on one device mesh (pipeline, data_parallel, tensor_parallel), applied to a
plain GPT from outside, without Lightning (the strategy in mesh_strategy.py calls it; tests call it directly).

What a step needs beyond the wrapped forward/backward, each a collective on an explicit group:
- `sync_gradients`: the tied embedding's two copies summed over the pipeline, under sequence parallelism the norms'
  partial gradients summed over the tensor-parallel group, then every gradient averaged over the data-parallel
  group (DDP's all-reduce, done once per optimizer step, after accumulation).
- `grad_norm`: the global L2 norm, as one process would compute it: squares summed over this rank's parameters,
  where a tensor-parallel shard counts on every tensor-parallel rank but a replicated parameter (norms, embedding,
  head) only on tensor-parallel rank 0, and the tied copy on the last stage not at all; then summed over the
  tensor-parallel and pipeline groups. Data-parallel replicas hold equal gradients after the sync.
- `full_state` / `load_full_state`: layout-independent state: tensors by their single-process names, gathered
  from tensor-parallel shards and pipeline stages onto rank 0; loading slices them into the current layout.
  AdamW moments have their parameter's shape and are gathered the same way.
"""

from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lit_pretrain.parallel.layout import MESH_DIMS, Layout
from lit_pretrain.parallel.pipeline import PipelineRunner, is_tied_copy, tied_grad_sync
from lit_pretrain.parallel.sequence import sync_sequence_parallel_grads
from lit_pretrain.parallel.tensor import apply_tensor_parallel, gather, plain_name, shard, style_of


def build_mesh(layout: Layout, device_type: str = "cpu") -> DeviceMesh:
    return init_device_mesh(device_type, (layout.pipeline_parallel, layout.data_parallel, layout.tensor_parallel),
                            mesh_dim_names=MESH_DIMS)


class MeshParallel:
    """The GPT as this rank holds it under (p, d, t), with the step's collectives (see the module docstring)."""

    def __init__(self, gpt: nn.Module, mesh: DeviceMesh, strategy_cfg):
        self.gpt, self.mesh = gpt, mesh
        self.tp, self.dp, self.pp = (mesh.get_group(n) for n in ("tensor_parallel", "data_parallel", "pipeline"))
        self.t, self.d, self.p = (dist.get_world_size(g) for g in (self.tp, self.dp, self.pp))
        self.tp_rank = dist.get_rank(self.tp)
        self.full_keys = list(gpt.state_dict().keys())  # before pruning: the single-process names and order
        self.runner: Optional[PipelineRunner] = None
        if self.p > 1:
            pc = strategy_cfg.pipeline
            self.runner = PipelineRunner(gpt, self.pp, pc.schedule, pc.micro_batches, pc.stages_per_rank)
        # strategy.sequence_parallel (absent from older strategy configs: off)
        self.sequence_parallel = bool(getattr(strategy_cfg, "sequence_parallel", False)) and self.t > 1
        if self.t > 1:
            apply_tensor_parallel(gpt, self.tp, sequence_parallel=self.sequence_parallel)

    @property
    def holds_first_stage(self) -> bool:
        return self.runner is None or self.runner.holds_first

    def sync_gradients(self) -> None:
        tied_grad_sync(self.gpt, self.pp)
        if self.sequence_parallel:
            sync_sequence_parallel_grads(self.gpt, self.tp)
        if self.d == 1:
            return
        grads = [p.grad for p in self.gpt.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=self.dp)
        flat /= self.d
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def grad_norm(self) -> torch.Tensor:
        sq = torch.zeros((), dtype=torch.float32)
        for name, p in self.gpt.named_parameters():
            if p.grad is None or is_tied_copy(name, self.gpt, self.holds_first_stage):
                continue
            if style_of(name) is None and self.tp_rank != 0:
                continue  # replicated across tensor-parallel ranks: counted once
            sq += p.grad.detach().float().pow(2).sum()
        dist.all_reduce(sq, group=self.tp)
        dist.all_reduce(sq, group=self.pp)
        return sq.sqrt()

    def _gather_named(self, local: Dict[str, torch.Tensor]) -> Optional[Dict[str, torch.Tensor]]:
        """Full tensors by single-process name on global rank 0 (None elsewhere). Every rank must call it."""
        full = {k: gather(v.detach(), style_of(k), self.tp, self.t) for k, v in local.items()}
        parts = [None] * self.p
        dist.all_gather_object(parts, full, group=self.pp)
        if dist.get_rank() != 0:
            return None
        merged: Dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)  # the tied copy: equal on both stages, the first stage's kept
        return merged

    def full_state(self) -> Optional[Dict[str, torch.Tensor]]:
        """The single-process state dict (names and order of the full GPT) on global rank 0, None elsewhere."""
        merged = self._gather_named(self.gpt.state_dict())
        if merged is None:
            return None
        missing = [k for k in self.full_keys if k not in merged]
        assert not missing, f"pipeline stages together lack {missing}"
        return {k: merged[k] for k in self.full_keys}

    def load_full_state(self, full: Dict[str, torch.Tensor]) -> None:
        """Load a single-process state dict (from any layout's checkpoint) into this rank's share, in place."""
        own = self.gpt.state_dict()
        with torch.no_grad():
            for name, t in own.items():
                t.copy_(shard(full[name], style_of(name), self.tp_rank, self.t))

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer, prefix: str = "") -> Optional[dict]:
        """AdamW state by single-process parameter name ({name: {step, exp_avg, exp_avg_sq}}) on rank 0."""
        names = {id(p): plain_name(n) for n, p in self.gpt.named_parameters()}  # as in state_dict()
        local = {f"{names[id(p)]}\0{key}": torch.as_tensor(value)
                 for p, state in optimizer.state.items() for key, value in state.items()}
        full = {k: gather(v.detach(), style_of(k.split("\0")[0]) if v.dim() > 0 else None, self.tp, self.t)
                for k, v in local.items()}
        parts = [None] * self.p
        dist.all_gather_object(parts, full, group=self.pp)
        if dist.get_rank() != 0:
            return None
        out: Dict[str, dict] = {}
        for part in parts:
            for k, v in part.items():
                name, key = k.split("\0")
                out.setdefault(prefix + name, {}).setdefault(key, v)
        return out

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, by_name: dict, prefix: str = "") -> None:
        """Fill `optimizer.state` for this rank's parameters from a by-name state (full_optimizer_state's form)."""
        for name, p in self.gpt.named_parameters():
            name = plain_name(name)
            state = by_name.get(prefix + name)
            if state is None:
                continue
            optimizer.state[p] = {k: shard(v, style_of(name), self.tp_rank, self.t).clone() if v.dim() > 0
                                  else v.clone() for k, v in state.items()}
