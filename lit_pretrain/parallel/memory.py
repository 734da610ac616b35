"""What a rank actually holds, counted from its tensors: model state per rank and activations saved for backward.

These are measurements, not formulas: they are what a memory planner's per-device bytes are checked against.
Conventions (the same for every strategy):

- A tensor is counted by the bytes of its storage, each storage once. So a DTensor shard counts its local
  storage, including the padding FSDP2 adds to make dim 0 divisible by the world size; views into one buffer
  (FSDP2's reduce-scatter output, a bucket) count the buffer once; a tied embedding/head counts once.
- `rank_state_bytes`: parameters (local shards under FSDP), gradients (`.grad` of those parameters), optimizer
  state (every tensor in the state of the optimizer this rank steps: under ZeRO stage 1 the local optimizer of
  its own share). Not counted: DDP's gradient communication buckets, FSDP2's transient all-gather and
  reduce-scatter buffers, the learning-rate scheduler, buffers such as the RoPE tables.
- `gathered_param_bytes`: under FSDP, the all-gathered (unsharded) parameters held at the moment of the call;
  call it when the forward has ended and backward not started to get what ZeRO stage 2 vs 3 hold during backward.
- `SavedActivations`: bytes of tensors autograd saves for backward during a forward (saved-tensor hooks), without
  parameters and buffers, plus the inputs that activation-checkpointed blocks keep for their recomputation and the
  op outputs a selectively checkpointed block keeps in its cache (the saved matmul and attention outputs).
"""

from typing import Dict, Iterable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (local shards for DTensors); empty storages count 0."""
    seen: Dict[int, int] = {}
    for t in tensors:
        local = _local(t)
        storage = local.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _unwrap_optimizer(optimizer) -> torch.optim.Optimizer:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    local = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer keeps its share in a local optimizer
    return local if isinstance(local, torch.optim.Optimizer) else optimizer


def optimizer_state_tensors(optimizer) -> list:
    state = _unwrap_optimizer(optimizer).state
    return [v for per_param in state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]


def rank_state_bytes(module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, int]:
    """{"param_bytes", "grad_bytes", "optimizer_bytes"} this rank holds now (see the module docstring).

    Under FSDP call it between steps (after the optimizer step), when parameters are sharded: parameters that
    are gathered at the time of the call are the unsharded views, counted by `gathered_param_bytes` instead.
    """
    params = list(module.parameters())
    sharded = is_fsdp(module)
    return {
        "param_bytes": storage_bytes(p for p in params if isinstance(p, DTensor) or not sharded),
        "grad_bytes": storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer_bytes": storage_bytes(optimizer_state_tensors(optimizer)) if optimizer is not None else 0,
    }


def is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def gathered_param_bytes(module: nn.Module) -> int:
    """Under FSDP2: bytes of the all-gathered parameters currently held (FSDP2 registers the unsharded tensors in
    place of the DTensor shards while they are gathered). 0 for a module that is not sharded."""
    if not is_fsdp(module):
        return 0
    return storage_bytes(p for p in module.parameters() if not isinstance(p, DTensor))


class SavedActivations:
    """Context manager: bytes of the activations a forward pass leaves saved for backward.

    Every tensor autograd saves passes through the pack hook; parameters (leaves that require grad, or views of
    them) and the module's buffers are not activations and are skipped. Inside an activation-checkpointed block
    the checkpoint's own hooks take over and keep nothing; what the block keeps is its input, recorded by a
    forward pre-hook on the wrapper. A selectively checkpointed block also keeps the outputs its op policy saves,
    outside autograd's saved tensors (torch.utils.checkpoint's cache): read from that cache when the forward ends.
    Storages are counted once and kept referenced until exit, so a freed and reused address cannot be counted twice.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.storages: Dict[int, torch.UntypedStorage] = {}
        self._handles = []
        self._caches: list = []
        self._policies: list = []

    @property
    def bytes(self) -> int:
        return sum(s.nbytes() for s in self.storages.values())

    def _record(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or isinstance(t, DTensor):
            return
        base = t._base if t._base is not None else t
        if (base.is_leaf and base.requires_grad) or _storage_key(t) in self._buffers:
            return
        storage = t.untyped_storage()
        if storage.nbytes():
            self.storages.setdefault(storage.data_ptr(), storage)

    def _record_inputs(self, _module: nn.Module, args: tuple) -> None:
        for a in args:
            self._record(a)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._record(t)
        return t

    def __enter__(self) -> "SavedActivations":
        from lit_pretrain.parallel.activation_checkpointing import is_checkpointed, selective_policy

        self._buffers = {_storage_key(b) for b in self.model.buffers()}
        for m in self.model.modules():
            if is_checkpointed(m):
                self._handles.append(m.register_forward_pre_hook(self._record_inputs))
            policy = selective_policy(m)
            if policy is not None:
                policy.recorder = self._caches.append
                self._policies.append(policy)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from lit_pretrain.internals import tree_leaves

        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for policy in self._policies:
            policy.recorder = None
        self._policies.clear()
        # {op: {call index: outputs or a recompute marker}}: the outputs are wrapped, each leaf's tensor in `.val`
        for cache in self._caches:
            for entries in cache.values():
                for entry in entries.values():
                    for leaf in tree_leaves(entry):
                        self._record(getattr(leaf, "val", None))
        self._caches.clear()
