"""The optimizer, torch only: parameter groups (weight decay and learning-rate factors by parameter kind), the one
optimizer builder (AdamW, Muon with AdamW, SGD; ZeRO stage 1 included), loading a saved state into one process,
and global-norm gradient clipping.

Everything that builds the optimizer (the module, `checkpoints.load_optimizer_state`, the benchmarks, the tests) builds
it here, so the groups, hyperparameters and kernel of a run and of its readers cannot drift apart. No Lightning and
no process group: torch.distributed's optimizer wrapper is imported only when ZeRO stage 1 asks for it (importing
it costs ~2 s on the 2-core machine).
"""

import fnmatch
from typing import Dict, Iterable, List, Optional, Union

import torch
from torch import nn

from lit_pretrain.model.init import mup_lr_scale
from lit_pretrain.schema import PARAM_KINDS, OptimConfig

KERNELS = ("fused", "foreach")
# The group key that sends a group to Muon. Not "muon": ZeroRedundancyOptimizer copies its constructor keywords
# (MuonWithAdamW's `adamw` and `muon` settings) into every group as defaults, so a "muon" key is on every group there.
MUON_FLAG = "use_muon"


def is_muon_group(group: dict) -> bool:
    """A group Muon updates: MUON_FLAG, or `"muon": True` in a state saved before the flag was renamed."""
    return bool(group.get(MUON_FLAG)) or group.get("muon") is True


def param_kind(module: nn.Module, module_name: str, p: torch.Tensor, tied_head: bool = False) -> str:
    """The kind of parameter p of `module` (its owner, named module_name in the model): embeddings, head, hidden,
    norms or biases.

    An embedding (and a head tied to it) is "embeddings"; the untied output head "head"; any other matrix of a
    Linear "hidden"; a Linear's vector and the attention sinks (logit biases) "biases"; everything else (norm
    gains and biases) "norms"."""
    if isinstance(module, nn.Embedding) or tied_head:
        return "embeddings"
    if getattr(module, "sink", False):  # model.attention_sinks: additive biases of the attention logits
        return "biases"
    if getattr(module, "expert", False):  # model.moe's stacked expert matrices (lit_pretrain/model/moe.py ExpertLinear)
        return "hidden"
    if isinstance(module, nn.Linear):
        if p.ndim < 2:
            return "biases"
        return "head" if module_name.split(".")[-1] == "lm_head" else "hidden"
    return "norms"


def _named_kinds(model: nn.Module):
    """(name, parameter, kind) of every trainable parameter once, in `model.parameters()` order."""
    owners = {}
    for mname, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), (module, mname))
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(False)}
    seen = set()
    for name, p in model.named_parameters():  # yields a tied tensor once, under its first name
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        module, module_name = owners[id(p)]
        yield name, p, param_kind(module, module_name, p, tied_head=id(p) in embedding_ids)


def _decayed(kind: str, name: str, optim: OptimConfig) -> bool:
    rules = optim.no_weight_decay
    return kind not in rules and not any(fnmatch.fnmatchcase(name, r) for r in rules if r not in PARAM_KINDS)


def _uses_muon(kind: str, optim: OptimConfig) -> bool:
    # Muon for the blocks' matrices only: embeddings, head, norms and biases stay on AdamW (Jordan et al. 2024).
    return optim.name == "muon" and kind == "hidden"


def param_groups(model: nn.Module, optim: Union[OptimConfig, float, None] = None,
                 lr_scale: Optional[Dict[str, float]] = None, weight_decay: Optional[float] = None) -> List[dict]:
    """Parameter groups: one per (optimizer, weight decay, learning-rate factor), all in `model.parameters()` order.

    Which parameters decay is optim.no_weight_decay's; by default norm gains, biases and embeddings are left
    undecayed (GPT-3 §B and nanoGPT's `configure_optimizers` do the same): decaying a norm gain or an embedding
    pulls it toward zero without regularizing any function of inputs; a tied embedding/head matrix is an
    embedding. The group list depends on the config alone, never on which parameters a model (or a pipeline
    stage) holds, so a saved state's group positions mean the same on every rank and layout; the default gives
    today's two groups (decayed, then the rest). `optim` may be a bare weight decay, or `weight_decay` given
    instead (the default rules).
    A group with a learning-rate factor other than 1 (optim.lr_multipliers, times `lr_scale`: init.mup_lr_scale)
    carries "lr" and "lr_multiplier"; a muon group "use_muon": True (MUON_FLAG). `lr_scale`: extra factors by
    kind; None takes μP's from the model's config (init.mup_lr_scale).
    """
    if not isinstance(optim, OptimConfig):
        optim = OptimConfig(weight_decay=float(weight_decay if optim is None else optim))
    if lr_scale is None:  # μP's Adam rates come with the model's own config (model.init)
        lr_scale = mup_lr_scale(getattr(model, "cfg", None))
    factors = {k: optim.lr_multipliers.get(k, 1.0) * (lr_scale or {}).get(k, 1.0) for k in PARAM_KINDS}
    patterns = any(r not in PARAM_KINDS for r in optim.no_weight_decay)

    def key(kind: str, decay: bool):
        return (_uses_muon(kind, optim), not decay, factors[kind])

    # Order: every possible key from the config, decayed groups first (the order checkpoints already hold).
    keys = [key(k, True) for k in PARAM_KINDS if k not in optim.no_weight_decay]
    keys += [key(k, False) for k in PARAM_KINDS if k in optim.no_weight_decay or patterns]
    keys = sorted(dict.fromkeys(keys), key=lambda k: k[1])  # stable: decayed keys first
    members: Dict[tuple, list] = {k: [] for k in keys}
    for name, p, kind in _named_kinds(model):
        members[key(kind, _decayed(kind, name, optim))].append(p)
    groups = []
    for (muon, undecayed, factor), params in members.items():
        group = {"params": params, "weight_decay": 0.0 if undecayed else optim.weight_decay}
        if factor != 1.0:
            group.update(lr=optim.lr_peak * factor, lr_multiplier=factor)
        if muon:
            group[MUON_FLAG] = True
        groups.append(group)
    return groups


def is_dtensor(t: torch.Tensor) -> bool:
    """A DTensor (FSDP2 shard, DTensor tensor parallelism), told by its method rather than by importing DTensor
    (torch.distributed.tensor costs seconds to import where nothing is sharded)."""
    return hasattr(t, "full_tensor")


def adamw_kernel(params: Iterable[torch.Tensor], zero_stage: Optional[int] = None) -> str:
    """AdamW's implementation: "fused" (one kernel over all tensors, about 3x faster than foreach on this CPU: 22-27
    ms -> 7.5-7.9 ms per step of the default model's 5.3M parameters, measured on a loaded 2-core machine) for plain
    tensors; "foreach" for DTensor shards (ZeRO stages 2 and 3, or any DTensor parameter), the path PyTorch's FSDP2
    tests cover. ZeRO stage 1 keeps plain tensors, so it stays fused."""
    sharded = zero_stage in (2, 3) or any(is_dtensor(p) for p in params)
    return "foreach" if sharded else "fused"


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the groups marked MUON_FLAG, AdamW on the rest, as one optimizer: one list of param groups (in
    param_groups' order, which the schedule and optim/named_state.py read) and one state,
    shared with the two torch optimizers that do the work. Its state dict is the base Optimizer's over all groups,
    so it saves, loads and resumes like AdamW's (Muon's state is a momentum_buffer per matrix, laid out like it).

    `layout`: where the matrices are sharded (ZeRO stages 2/3, tensor parallelism), an object with `whole(p, t)`
    (the whole matrix of p's shard t, on every rank of p's groups: a collective) and `part(p, m)` (this rank's part
    of whole matrix m, as p's local tensor), e.g. parallel.mesh.ParallelModel; then Muon's step is
    `whole_matrix_muon_step`. None: every matrix is whole on this rank (one process, DDP, ZeRO-1, pipeline stages),
    and torch.optim.Muon steps it."""

    def __init__(self, groups: List[dict], adamw: dict, muon: dict, layout=None):
        flagged = [g for g in groups if is_muon_group(g)]
        self._adamw = torch.optim.AdamW([g for g in groups if not is_muon_group(g)] or [{"params": []}], **adamw)
        self._muon = torch.optim.Muon(flagged or [{"params": []}], **muon)
        self._layout = layout
        super().__init__(groups, {})  # the children filled each group's settings in place
        self._link()

    def _link(self) -> None:
        # load_state_dict replaces both the group dicts and the state: point the children at the current ones.
        self._adamw.param_groups = [g for g in self.param_groups if not is_muon_group(g)]
        self._muon.param_groups = [g for g in self.param_groups if is_muon_group(g)]
        self._adamw.state = self._muon.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._link()
        if self._layout is None:
            self._muon.step()
        else:
            for group in self._muon.param_groups:
                whole_matrix_muon_step(group, self.state, self._layout)
        self._adamw.step()
        return loss


def whole_matrix_muon_step(group: dict, state, layout) -> None:
    """torch.optim.Muon's step (torch/optim/_muon.py, `_single_tensor_muon`) on sharded matrices: the momentum,
    the Nesterov blend, weight decay and the update are elementwise, so they run on this rank's shard (the
    momentum_buffer stays sharded like the parameter); only Newton–Schulz needs the whole matrix, gathered per
    matrix (`layout.whole`) and orthogonalized on every rank of its groups, each then keeping its own part.

    Every rank computes the same whole-matrix iteration (Liu et al. 2025, "Muon is Scalable for LLM Training",
    its Distributed Muon: DP gather, TP gather, Newton–Schulz, keep the local partition) rather than one owner
    rank per matrix sending the result back (owner-centric designs such as DMuon, 2026): one collective per matrix
    instead of a gather and a scatter, no balancing of matrices over owners, and the same bits on every rank (the
    layouts' step equals one process's exactly: tests/parallel/test_mesh_parallel.py). The cost is the iteration's FLOPs
    repeated on each rank of a matrix's groups, small next to forward and backward at this project's sizes; at
    large data-parallel degrees the owner-centric split is the one to build. torch.optim.Muon alone would run on
    FSDP's DTensors through DTensor's own matmul redistribution (collectives inside every iteration, and bits that
    differ from one process's: measured 4.4e-4 on weights after one step) and orthogonalize tensor-parallel slices
    as if they were matrices. The learning-rate adjustment reads the whole matrix's shape, as one process would.
    """
    from lit_pretrain.internals import muon_parts

    _adjust_lr, _zeropower_via_newtonschulz = muon_parts()

    lr, momentum = float(group["lr"]), group["momentum"]
    for p in group["params"]:
        if p.grad is None:
            continue
        grad, st = p.grad, state[p]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = st["momentum_buffer"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        whole = layout.whole(p, update)
        ortho = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
        local = p.to_local() if is_dtensor(p) else p
        local.mul_(1 - lr * group["weight_decay"])
        local.add_(layout.part(p, ortho), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], whole.shape))


def build_optimizer(model: nn.Module, optim: OptimConfig, zero_stage: Optional[int] = None,
                    kernel: Optional[str] = None, lr_scale: Optional[Dict[str, float]] = None,
                    layout=None) -> torch.optim.Optimizer:
    """The run's optimizer (optim.name) over `param_groups(model, optim, lr_scale)` with optim's lr_peak (the
    schedule scales each group's own rate), betas and eps. adamw at ZeRO stage 1 is wrapped in
    ZeroRedundancyOptimizer, so each rank keeps the state of its share of the tensors only (call it inside the
    process group); stages 2 and 3 need no wrapper: FSDP2's parameters are DTensor shards already, so AdamW's state
    is sharded too. `kernel`: AdamW's "fused" or "foreach"; None chooses by adamw_kernel. `lr_scale`: extra
    learning-rate factors by parameter kind (init.mup_lr_scale). `layout`: muon's whole-matrix gather where the
    plan shards matrices (a parallel.mesh.ParallelModel; see MuonWithAdamW), ignored where it shards none.
    """
    groups = param_groups(model, optim, lr_scale)
    kernel = kernel or adamw_kernel((p for g in groups for p in g["params"]), zero_stage)
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS} or None")
    adamw = {"lr": optim.lr_peak, "betas": (optim.beta1, optim.beta2), "eps": optim.eps, kernel: True}
    if optim.name == "sgd":
        cls, kwargs = torch.optim.SGD, {"lr": optim.lr_peak, "momentum": optim.momentum, "foreach": True}
    elif optim.name == "muon":
        muon = {"lr": optim.lr_peak, "momentum": optim.momentum, "nesterov": True,
                "adjust_lr_fn": optim.muon_adjust_lr}
        # ZeRO-1 gives each rank whole tensors, so its local MuonWithAdamW needs no layout.
        cls, kwargs = MuonWithAdamW, {"adamw": adamw, "muon": muon}
        if zero_stage != 1 and layout is not None and getattr(layout, "shards_matrices", False):
            return MuonWithAdamW(groups, adamw, muon, layout)
    else:
        cls, kwargs = torch.optim.AdamW, adamw
    if zero_stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **kwargs)
    return cls(groups, **kwargs)


build_adamw = build_optimizer  # the name callers used before optim.name; it builds whatever optim.name says


def adamw_with_state(model: nn.Module, optim: OptimConfig, state: dict) -> torch.optim.Optimizer:
    """A one-process optimizer (optim.name's) over `model` holding a saved state dict numbered by position in the
    groups, as torch's `Optimizer.load_state_dict` reads it (a checkpoint's by-name state numbered so:
    optim/named_state.py to_positions).

    The groups are rebuilt as training builds them. The saved group settings (lr, kernel flags) replace the built
    ones, as `Optimizer.load_state_dict` always does.
    """
    optimizer = build_optimizer(model, optim)
    optimizer.load_state_dict(state)
    return optimizer


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose state this rank holds: ZeRO stage 1 keeps its shard in a wrapped local optimizer."""
    # By class name: importing torch.distributed.optim to compare classes costs ~2 s where nothing is sharded.
    wrapper = any(c.__name__ == "ZeroRedundancyOptimizer" for c in type(optimizer).__mro__)
    return optimizer.optim if wrapper else optimizer


def full_norm(grads: List[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of a list of gradients, as a tensor (no host sync); sharded DTensor gradients (FSDP2, DTensor
    tensor parallelism) are reduced to the norm of the whole gradient, as `torch.nn.utils.clip_grad_norm_` does."""
    norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True) if grads else torch.zeros(())
    if is_dtensor(norm):  # a DTensor with a partial placement: one all-reduce
        norm = norm.full_tensor()
    return norm


def grad_norm(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of the gradients of `parameters` (those without one count as zero); see full_norm."""
    return full_norm([p.grad for p in parameters if p.grad is not None])


def clip_by_global_norm(parameters: Iterable[torch.Tensor], max_norm: float,
                        norm: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rescale all gradients by one factor so their global L2 norm is at most max_norm; return the pre-clip norm.

    One factor for the whole gradient, never per-value clamping. Under FSDP (ZeRO stages 2 and 3) the norm is that
    of the whole, sharded gradient (`full_norm`), so every rank rescales by the same factor (as torchtitan's
    clipping does). `norm`: the pre-clip norm when already computed this step (under tensor or pipeline
    parallelism it must be, by the layout's own reduction). With max_norm <= 0 nothing is changed.
    """
    grads = [p for p in parameters if p.grad is not None]
    if norm is None:
        norm = full_norm([p.grad for p in grads])
    if max_norm > 0:
        # One call per device mesh: under expert parallelism the experts' FSDP2 shards live on their own mesh, and
        # a foreach op over DTensors of two meshes is refused (the factor is the same for all).
        by_mesh: dict = {}
        for p in grads:
            by_mesh.setdefault(id(getattr(p, "device_mesh", None)), []).append(p)
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm
