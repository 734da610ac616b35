"""A GPT as one rank holds it under a ParallelPlan, with the collectives a step needs beyond forward and backward.

`apply_plan` (parallel/apply.py) builds it; the module calls it from `configure_model`, the tests directly.

- `losses` (every micro-batch): how a batch becomes losses on this layout, the module's one loss path
  (parallel/batch_losses.py).
- `sync_gradients` (once per optimizer step, after the last backward of an accumulation): the tied embedding's two
  copies summed over the pipeline; norm weights summed over the tensor-parallel group under sequence parallelism;
  then, without FSDP, every gradient averaged over the data-parallel replicas (DDP's all-reduce), the experts' under
  expert parallelism over the ranks holding the same experts, divided by the data-parallel degree
  (parallel/expert.py). FSDP2 averages its own gradients (reduce-scatter over the shard group, all-reduce over
  replicas for HSDP; the experts' over their own group) inside backward.
- `grad_norm`: the global L2 norm as one process would compute it, each parameter counted once: squares summed over
  this rank's local values (a DTensor's local shard), where a tensor-parallel shard counts on every tensor-parallel
  rank but a parameter replicated over that group only on its rank 0, and the pipeline's tied copy not at all; then
  summed over the FSDP shard, tensor-parallel and pipeline groups; the experts' squares over the expert-parallel
  group (and their FSDP group), and, split along their width by tensor parallelism, over that group like any
  column/row slice. Replicas hold equal gradients after the sync.
- `whole` / `part`: one matrix's whole value from this rank's shard and back, for Muon's Newton–Schulz step
  (optim.whole_matrix_muon_step): FSDP's `full_tensor`, then the tensor-parallel slices gathered.
- `full_state` / `load_full_state` and the optimizer's: layout-independent state by single-process names, gathered
  onto rank 0 (FSDP shards with `full_tensor`, tensor-parallel slices with `tensor.gather`, the routed experts'
  too, then their expert-parallel share, stages by object gather); loading slices a full tensor into this rank's
  share of any layout. ZeRO-1 (under context parallelism): ZeroRedundancyOptimizer's own consolidation, named, and
  each rank loads the state of the tensors it updates.
"""

from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from lit_pretrain.internals import drop_consolidated_state
from lit_pretrain.parallel.batch_losses import StepLosses
from lit_pretrain.parallel.batch_losses import choose as choose_losses
from lit_pretrain.parallel.collectives import all_reduce_flat
from lit_pretrain.parallel.pipeline import is_tied_copy, tied_grad_sync
from lit_pretrain.parallel.tensor import gather, plain_name, plan_of, shard, style_of, sync_partial_grads
from lit_pretrain.planning.plan import MESH_DIMS, ParallelPlan

# FSDP2's shard dimension under context parallelism: data_parallel_shard x context_parallel flattened (torchtitan's
# dp_shard_cp), so the context-parallel ranks, which hold the same weights, each keep a share of them too.
SHARD_CONTEXT = "data_parallel_shard_context"


def build_mesh(plan: ParallelPlan, device_type: str = "cpu") -> DeviceMesh:
    """The (pipeline, data_parallel_replicate, data_parallel_shard, context_parallel, tensor_parallel) mesh, tensor
    ranks innermost; under context parallelism with the flattened SHARD_CONTEXT dimension as well."""
    mesh = init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=MESH_DIMS)
    if plan.context_parallel > 1:
        mesh[("data_parallel_shard", "context_parallel")]._flatten(SHARD_CONTEXT)
    return mesh


def fsdp_dims(plan: ParallelPlan) -> tuple:
    """The mesh dimensions FSDP2 shards (and, with replicas, replicates: HSDP) over under `plan`."""
    shard = SHARD_CONTEXT if plan.context_parallel > 1 else "data_parallel_shard"
    return ("data_parallel_replicate", shard) if plan.data_parallel_replicate > 1 else (shard,)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP shard (a collective over its mesh: every rank holding a shard must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`value` (this rank's tensor-parallel share, whole over FSDP) laid out as `param`: its FSDP shard when `param`
    is a DTensor (sliced locally, no communication: every rank holds the whole value)."""
    if isinstance(param, DTensor):
        return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
    return value


class ParallelModel:
    """The wrapped GPT of one rank and its step collectives (see the module docstring). `mesh` is our 4-D mesh
    (plan.uses_mesh) or None; `runner` the pipeline schedule when pipeline_parallel > 1."""

    def __init__(self, gpt: nn.Module, plan: ParallelPlan, mesh: Optional[DeviceMesh] = None):
        self.gpt, self.plan, self.mesh = gpt, plan, mesh
        self.full_keys = list(gpt.state_dict().keys())  # before pruning: the single-process names and order
        self.tp_plan = plan_of(gpt)  # each linear's tensor-parallel role, read off the model (model/gpt.py marks them)
        self.runner = None
        self.ep = None  # parallel/expert.py ExpertGroups under strategy.expert_parallel (set by apply_plan)
        self.forward_losses = None  # trainer.compile's compiled forward and loss (parallel/compile.py compile_model)
        self.tp = self.pp = self.replicate = self.shard_group = None
        self.cp = None  # parallel/context.py ContextParallel under strategy.context_parallel (set by apply_plan)
        self.cp_group = self.fsdp_group = None
        self.t = self.p = 1
        # How a batch becomes losses (parallel/batch_losses.py): one process's until apply_plan chooses the plan's
        # variant; `runs_backward` when that variant runs the backward itself (the pipeline schedule).
        self._losses, self.runs_backward = choose_losses(self)
        self.tp_rank = 0
        self._styles: Optional[Dict[int, Optional[str]]] = None  # parameter id -> tensor-parallel style (_style)
        if mesh is not None:
            self.tp, self.pp, self.replicate, self.shard_group = (
                mesh.get_group(n) for n in ("tensor_parallel", "pipeline", "data_parallel_replicate",
                                            "data_parallel_shard"))
            self.t, self.p = plan.tensor_parallel, plan.pipeline_parallel
            self.tp_rank = dist.get_rank(self.tp)
            self.cp_group = mesh.get_group("context_parallel")
            # the group FSDP2 shards over (without replicas): data-parallel shard x context-parallel ranks
            self.fsdp_group = mesh.get_group(fsdp_dims(plan)[-1])

    def losses(self, batch, z_loss: float = 0.0, eod_id: Optional[int] = None, training: bool = False) -> StepLosses:
        """The losses of `batch` (inputs, targets: (B, T) each) on this rank, whatever the layout: the one loss path
        of the module's training and validation steps. z_loss: optim.z_loss; eod_id: data.document_masking's
        end-of-document id, or None; training: add the MoE auxiliary losses, and under pipeline parallelism run the
        backward (`runs_backward`)."""
        return self._losses(batch, z_loss, eod_id, training)

    def choose_losses(self) -> None:
        """Pick the loss variant of this plan, once its wrappers are in place (the end of apply_plan)."""
        self._losses, self.runs_backward = choose_losses(self)

    @property
    def vocab_group(self):
        """The tensor-parallel group the head's logits are split over (parallel/vocab.py), for losses.lm_losses;
        None when the head is whole."""
        from lit_pretrain.parallel.vocab import vocab_group

        return vocab_group(self.gpt)

    @property
    def holds_first_stage(self) -> bool:
        return self.runner is None or self.runner.holds_first

    def sync_gradients(self) -> None:
        if self.mesh is None:
            return  # DDP and Lightning's FSDP strategy reduce gradients themselves
        fsdp_shard = (dist.get_rank(self.fsdp_group), dist.get_world_size(self.fsdp_group)) if self.plan.uses_fsdp \
            else None
        tied_grad_sync(self.gpt, self.pp, fsdp_shard, self.t)
        if self.t > 1:
            sync_partial_grads(self.gpt, self.tp)  # QK-norm's weights saw only this rank's heads
        if self.plan.sequence_parallel:
            from lit_pretrain.parallel.sequence import sync_sequence_parallel_grads

            sync_sequence_parallel_grads(self.gpt, self.tp)
        if self.plan.uses_fsdp:
            return  # FSDP2 reduced every gradient, the experts' over their own group (parallel/zero.py)
        named = [(n, local(p.grad)) for n, p in self.gpt.named_parameters() if p.grad is not None]
        if self.ep is not None:  # the experts' over the ranks holding the same experts, / D (parallel/expert.py)
            all_reduce_flat([g for n, g in named if self.is_expert(n)], self.ep.data_group,
                            divide_by=self.ep.data_parallel)
            named = [(n, g) for n, g in named if not self.is_expert(n)]
        if self.plan.data_parallel_replicate > 1:
            all_reduce_flat([g for _, g in named], self.replicate, divide_by=self.plan.data_parallel_replicate)
        # ZeRO-1 on this mesh (context parallelism): the shard ranks' gradients too, averaged as DDP's all-reduce
        if self.plan.data_parallel_shard > 1:
            all_reduce_flat([g for _, g in named], self.shard_group, divide_by=self.plan.data_parallel_shard)
        # Context-parallel ranks: each gradient is of c x its share of the micro-batch's loss (parallel/context.py)
        if self.plan.context_parallel > 1:
            all_reduce_flat([g for _, g in named], self.cp_group, divide_by=self.plan.context_parallel)

    def grad_norm(self, parameters=None) -> torch.Tensor:
        """The pre-clip global norm (StepGuard's norm_fn). Without our mesh: of `parameters` (default: the GPT's),
        FSDP2 DTensor shards reduced to the whole gradient's norm."""
        if self.mesh is None:
            from lit_pretrain.optim.optimizers import grad_norm

            return grad_norm(self.gpt.parameters() if parameters is None else parameters)
        sq = torch.zeros(2, dtype=torch.float32)  # (dense, experts)
        for name, p in self.gpt.named_parameters():
            if p.grad is None or is_tied_copy(name, self.gpt, self.holds_first_stage):
                continue
            if style_of(name, self.tp_plan) is None and self.tp_rank != 0:
                continue  # replicated across tensor-parallel ranks: counted once
            sq[int(self.is_expert(name))] += local(p.grad).detach().float().pow(2).sum()
        # The dense part is whole on each FSDP shard group; the experts are split over the expert-parallel group,
        # and sharded over their own data-parallel group under FSDP (else equal there after the sync).
        dense = [self.fsdp_group] if self.plan.uses_fsdp else []
        experts = [] if self.ep is None else [self.ep.group] + ([self.ep.data_group] if self.plan.uses_fsdp else [])
        for part, groups in ((0, dense), (1, experts)):
            for group in groups:
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(sq[part:part + 1], group=group)
        for group in (self.tp, self.pp):
            if dist.get_world_size(group) > 1:
                dist.all_reduce(sq, group=group)
        return sq.sum().sqrt()

    def is_expert(self, name: str) -> bool:
        """Whether parameter `name` (any wrapper prefix) is split by expert parallelism."""
        if self.ep is None:
            return False
        from lit_pretrain.parallel.expert import is_expert_param

        return is_expert_param(plain_name(name))

    @property
    def shards_matrices(self) -> bool:
        """Whether a rank holds only part of some matrix (ZeRO stages 2/3, tensor parallelism): Muon then needs
        `whole` and `part`."""
        return self.plan.uses_fsdp or self.t > 1

    def _style(self, p: torch.Tensor) -> Optional[str]:
        # By identity: FSDP2 replaced the parameters after __init__, so the map is built at first use (the optimizer
        # step, after apply_plan has finished).
        styles = self._styles
        if styles is None or id(p) not in styles:
            styles = self._styles = {id(q): style_of(n, self.tp_plan) for n, q in self.gpt.named_parameters()}
        return styles[id(p)]

    def whole(self, p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The whole matrix of `value` (laid out like parameter p: an FSDP shard of a tensor-parallel slice), a plain
        tensor on every rank. Collectives over p's FSDP mesh and the tensor-parallel group: all their ranks call it
        for the same parameters in the same order."""
        return gather(full(value), self._style(p), self.tp, self.t)

    def part(self, p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of whole matrix `whole`, as p's local tensor (sliced, no communication)."""
        return local(like(shard(whole, self._style(p), self.tp_rank, self.t), p))

    def _gather_named(self, named: Dict[str, torch.Tensor]) -> Optional[Dict[str, torch.Tensor]]:
        """Full tensors by single-process name on global rank 0 (None elsewhere). Every rank must call it."""
        # Keys are parameter names, or "name\0key" for optimizer state; scalars (AdamW's step) are never sliced.
        # Each whole tensor is gathered on every rank (a collective) but kept, on the CPU, only where it is read:
        # rank 0, and under pipeline parallelism every rank (its stage's part travels by object gather). Without
        # pipeline stages the other ranks then hold one whole tensor at a time on the device, as torch's
        # get_*_state_dict with full_state_dict and cpu_offload does, not the whole state.
        keep = self.p > 1 or dist.get_rank() == 0
        whole = {}
        for k, v in named.items():
            w = self._whole_named(k, v)
            if keep:
                whole[k] = w.cpu()
        parts = [whole]
        if self.p > 1:
            parts = [None] * self.p
            dist.all_gather_object(parts, whole, group=self.pp)
        if dist.get_rank() != 0:
            return None
        merged: Dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)  # the tied copy: equal on both stages, the first stage's kept
        return merged

    def _whole_named(self, key: str, v: torch.Tensor) -> torch.Tensor:
        """The whole value of this rank's share `v` of `key`: FSDP's full tensor, then the tensor-parallel slices
        or the expert-parallel experts gathered (collectives: every rank of those groups calls it in one order)."""
        v = full(v).detach()
        if v.dim() == 0:
            return v
        v = gather(v, style_of(key.split("\0")[0], self.tp_plan), self.tp, self.t)  # routed experts: their width
        if self.is_expert(key.split("\0")[0]):
            return gather(v, "column", self.ep.group, self.ep.degree)  # dim 0: the experts, in expert order
        return v

    def _share(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's share of whole tensor `value` of parameter `name` (before any FSDP sharding): its tensor-
        parallel slice (of its own experts only, under expert parallelism)."""
        if self.is_expert(name):
            value = self.ep.slice(value)
        return shard(value, style_of(name, self.tp_plan), self.tp_rank, self.t)

    def full_like_parameters(self, named: Dict[str, torch.Tensor]) -> Optional[Dict[str, torch.Tensor]]:
        """Tensors laid out like their parameters (single-process names; an FSDP shard a DTensor like its
        parameter), whole, on global rank 0 (None elsewhere), as full_state gathers the weights: the weights' EMA
        (callbacks/ema.py). Every rank calls it with the same names in the same order."""
        return self._gather_named(named)

    def share_like(self, name: str, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """This rank's share of the whole tensor `value` of parameter `name`, laid out as `param` (load_full_state's
        slicing, no communication)."""
        return like(self._share(name, value), param)

    def full_state(self) -> Optional[Dict[str, torch.Tensor]]:
        """The single-process state dict (names and order of the full GPT) on global rank 0, None elsewhere."""
        merged = self._gather_named(self.gpt.state_dict())
        if merged is None:
            return None
        missing = [k for k in self.full_keys if k not in merged]
        assert not missing, f"pipeline stages together lack {missing}"
        return {k: merged[k] for k in self.full_keys}

    def load_full_state(self, state: Dict[str, torch.Tensor]) -> None:
        """Load a single-process state dict (from any layout's checkpoint) into this rank's share, in place."""
        with torch.no_grad():
            for name, t in self.gpt.state_dict().items():
                local(t).copy_(local(like(self._share(name, state[name]), t)))

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> Optional[dict]:
        """Optimizer state by single-process parameter name on rank 0: AdamW's {name: {step, exp_avg, exp_avg_sq}},
        Muon's {name: {momentum_buffer}} (sharded like its parameter, so gathered like it). ZeRO-1 (context
        parallelism): each rank holds the whole state of its own tensors, consolidated by ZeroRedundancyOptimizer."""
        from lit_pretrain.optim.optimizers import local_optimizer

        if local_optimizer(optimizer) is not optimizer:
            return self._zero_optimizer_state(optimizer)
        flat = {}
        for name, p in self.gpt.named_parameters():  # the same order on every rank of a stage
            for key, value in optimizer.state.get(p, {}).items():
                flat[f"{plain_name(name)}\0{key}"] = torch.as_tensor(value)
        merged = self._gather_named(flat)
        if merged is None:
            return None
        out: Dict[str, dict] = {}
        for k, v in merged.items():
            name, key = k.split("\0")
            out.setdefault(name, {})[key] = v
        return out

    def _zero_optimizer_state(self, optimizer) -> Optional[dict]:
        """ZeroRedundancyOptimizer's state by single-process name on rank 0: its own consolidation (what Lightning's
        DDPStrategy saves at ZeRO-1; every rank of its group calls it), whose indices follow its param groups."""
        optimizer.consolidate_state_dict(to=0)  # ZeRO-1's group is the world (plan.check_plan refuses the rest)
        if dist.get_rank() != 0:
            return None
        names = {id(p): plain_name(n) for n, p in self.gpt.named_parameters()}
        order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
        named = {order[i]: {k: torch.as_tensor(v) for k, v in s.items()}
                 for i, s in optimizer.state_dict()["state"].items() if s}
        drop_consolidated_state(optimizer)  # its copy of every rank's state, kept until the next save otherwise
        return named

    def load_full_optimizer_state(self, optimizer: torch.optim.Optimizer, by_name: dict) -> None:
        """Fill `optimizer.state` for this rank's parameters from a by-name state (full_optimizer_state's form); under
        ZeRO-1 the state of the tensors this rank's share of ZeroRedundancyOptimizer updates."""
        from lit_pretrain.optim.optimizers import local_optimizer

        held = local_optimizer(optimizer)
        owned = {id(p) for g in held.param_groups for p in g["params"]}
        for name, p in self.gpt.named_parameters():
            name = plain_name(name)
            state = by_name.get(name)
            if state is None or id(p) not in owned:
                continue
            held.state[p] = {k: like(self._share(name, v).clone(), p) if v.dim() > 0 else v.clone()
                             for k, v in state.items()}
