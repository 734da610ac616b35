"""The mixture-of-experts MLP (model.moe) as a plain `nn.Module`: router, routed experts as one grouped matmul,
shared experts, and the load-balancing side (auxiliary loss, router z-loss, DeepSeek-V3's bias).

Knows nothing of Lightning or distribution. Each forward leaves its differentiable auxiliary losses in
`last_losses` (PretrainModule adds `moe_loss(model)` to the task loss) and adds its routing counts, detached, to the
`load` buffer; `end_step(model, reduce)` (called once per optimizer step from outside, with the strategy's sum over
the data-parallel ranks) moves the bias and keeps the step's statistics for the MoE monitor
(callbacks/moe_monitor.py). The dropless path reads no tensor on the host; a capacity (a boolean mask) and
expert parallelism (the all-to-all's split sizes) do, as their shapes depend on the routing.

Experts: `moe_kernels.swiglu_experts`, one autograd Function over the token copies sorted by expert whose every
product is one `torch.nn.functional.grouped_mm` for all the experts (no padding; on CPU one MKL GEMM per expert on
its rows) with a hand-written backward, never a Python loop over experts (bench case `moe_grouped_vs_loop`: one
forward + backward of 4096 copies, 8 experts, d 256, width 352, against the per-expert loop: 0.99x in a quiet run
on 2 threads, 1.04x in CPU time on one; the GEMMs, near the cores' peak in both, bound it: moe_kernels.py says
why). In fp32 it gives the per-expert loop's values (tests/model/test_moe_kernels.py).
"""

import math
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lit_pretrain.model.config import GPTConfig, ModuleSpec
from lit_pretrain.model.moe_kernels import swiglu_experts


class ExpertLinear(nn.Module):
    """The stacked weights (E, out, in) of E bias-free linears, one per expert; `expert` marks it for the
    initializer and the optimizer (a "hidden" matrix, decayed); `tensor_parallel` its split from the table
    (expert_column | expert_row), which parallel/moe_mesh.py applies from outside."""

    expert = True

    def __init__(self, spec: ModuleSpec):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(spec.shape))
        self.residual_projection = spec.residual_projection
        self.tensor_parallel = spec.tensor_parallel


class Experts(nn.ModuleDict):
    """The routed experts' stacked weights `w_gate`, `w_up` (E, f, d) and `w_down` (E, d, f), a dict as before (the
    names stay `mlp.experts.w_gate.weight`, ...), with a forward so that a wrapper hooked on it sees every use: FSDP2
    under expert parallelism shards these over their own data-parallel group and gathers them in its pre-forward
    hook (parallel/zero.py). Under expert parallelism this rank holds only its E/P experts (parallel/expert.py)."""

    def forward(self, xs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """SwiGLU of every expert held here on xs (M, d), rows sorted by expert, expert e's rows ending at
        offsets[e] (int32, cumulative) -> (M, d)."""
        return swiglu_experts(xs, offsets, self["w_gate"].weight, self["w_up"].weight, self["w_down"].weight)


def _linear(spec: ModuleSpec) -> nn.Linear:
    out_features, in_features = spec.shape
    linear = nn.Linear(in_features, out_features, bias=False)
    linear.tensor_parallel, linear.residual_projection = spec.tensor_parallel, spec.residual_projection
    return linear


def assignment_counts(expert_of: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert (num_experts,) of the experts chosen (N*k,)."""
    return torch.bincount(expert_of, minlength=num_experts)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts plus optional shared experts, for block `layer` (its table rows `mlp.*`)."""

    def __init__(self, cfg: GPTConfig, layer: int):
        super().__init__()
        spec, moe = cfg.block_modules(layer), cfg.moe
        self.cfg, self.layer = moe, layer
        self.router = _linear(spec["mlp.router"])
        self.experts = Experts({n: ExpertLinear(spec[f"mlp.experts.{n}"]) for n in ("w_gate", "w_up", "w_down")})
        self.shared = nn.ModuleDict({n: _linear(spec[f"mlp.shared.{n}"]) for n in ("w_gate", "w_up", "w_down")}) \
            if moe.num_shared_experts else None
        E = moe.num_experts
        # DeepSeek-V3's balancing bias: state, not a parameter (no gradient, no optimizer); persistent so a resumed
        # run routes as the interrupted one did.
        if moe.bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(E))
        else:
            self.expert_bias = None
        # Assignments per expert (before any capacity drop), dropped assignments and the auxiliary and z losses,
        # summed over the forwards of this optimizer step: [E counts..., dropped, total, aux, z, forwards]. A plain
        # tensor, not a buffer: DDP broadcasts buffers from rank 0 before each forward, which would overwrite the
        # other ranks' counts mid-accumulation.
        self.load: Optional[torch.Tensor] = None
        self.last_losses: Optional[torch.Tensor] = None  # (aux, z) of the last forward, differentiable
        # strategy.expert_parallel: (token copies sorted by expert, copies per expert) -> the experts' outputs,
        # computed by the ranks that own them; set from outside by parallel/expert.py. None: all experts here.
        self.expert_dispatch: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
        self.step_stats: Optional[torch.Tensor] = None  # `load` of the last finished step, reduced over ranks
        # model.moe.aux_loss_scope=global: sums the counts over the data-parallel ranks running this forward
        # together (and the context-parallel ranks holding the rest of the micro-batch, under either scope); set
        # from outside (parallel/moe_mesh.py). None: this process's counts alone.
        self.count_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        # (expert of each assignment (N*k,), E) -> assignments per expert (E,): a bincount. Replaced from outside
        # only by `lit-pretrain simulate` (simulate/routing.py), whose tensors hold no values to count.
        self.count_assignments: Callable[[torch.Tensor, int], torch.Tensor] = assignment_counts
        # Whether a training forward adds to `load`: the pipeline runner turns it off outside the schedule's
        # micro-batch forwards (parallel/pipeline.py).
        self.count_routing = True

    def route(self, x: torch.Tensor):
        """x (N, d) -> (expert of each assignment (N, k), its weight (N, k) fp32, scores (N, E) fp32, logits)."""
        moe = self.cfg
        logits = self.router(x).float()  # (N, E): routing in fp32 (OLMoE and DeepSeek-V3 do)
        scores = logits.softmax(-1) if moe.score == "softmax" else logits.sigmoid()  # (N, E)
        choice = scores if self.expert_bias is None else scores + self.expert_bias  # the bias picks, never weighs
        top = choice.topk(moe.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(-1, top)  # (N, k)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return top, weights, scores, logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe, E, k = self.cfg, self.cfg.num_experts, self.cfg.top_k
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        N = flat.shape[0]
        top, weights, scores, logits = self.route(flat)
        expert_of = top.flatten()  # (N*k,): assignment a = token a // k
        order = expert_of.argsort(stable=True)  # assignments grouped by expert, tokens in order within each
        counts = self.count_assignments(expert_of, E)  # (E,)
        token_of, weight_of = order // k, weights.flatten()[order]  # (N*k,) each
        kept_counts, dropped = counts, counts.new_zeros(())
        if moe.capacity_factor is not None:
            # Switch §2.2: an expert computes its first `capacity` assignments (in token order); the rest are
            # dropped and the token's residual stream passes through that expert's share unchanged.
            capacity = math.ceil(moe.capacity_factor * N * k / E)
            starts = counts.cumsum(0) - counts  # (E,)
            rank = torch.arange(N * k, device=x.device) - starts[expert_of[order]]  # (N*k,) place in its expert
            keep = rank < capacity
            token_of, weight_of = token_of[keep], weight_of[keep]
            kept_counts = counts.clamp(max=capacity)
            dropped = (counts - kept_counts).sum()
        # index_select, not flat[token_of]: the same rows, and its backward is one index_add_ where indexing's
        # is an accumulating index_put_ (measured 1.9x faster forward + backward at N 4096, d 256, k 2 on CPU).
        xs = flat.index_select(0, token_of)  # (M, d), M = kept assignments, sorted by expert
        if self.expert_dispatch is None:
            ys = self.experts(xs, kept_counts.cumsum(0).to(torch.int32))  # (M, d)
        else:  # strategy.expert_parallel: each copy computed by the rank owning its expert
            ys = self.expert_dispatch(xs, kept_counts)  # (M, d)
        ys = ys * weight_of.to(ys.dtype)[:, None]  # (M, d)
        out = torch.zeros_like(flat).index_add_(0, token_of, ys)  # (N, d): each token sums its experts
        if self.shared is not None:
            s = self.shared
            out = out + s["w_down"](F.silu(s["w_gate"](flat)) * s["w_up"](flat))
        # Load balancing. Switch/GShard (Fedus et al. 2021 eq. 4): E * sum_i f_i * P_i, f_i the fraction of the N*k
        # assignments routed to expert i (so a uniform router gives 1 whatever k, as Megatron-LM divides by top-k),
        # P_i the mean over tokens of its probability (sigmoid scores normalized per token, as DeepSeek-V3's
        # sequence-wise loss does). Router z-loss (ST-MoE eq. 5): mean over tokens of logsumexp(logits)^2.
        probs = scores if moe.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        if moe.aux_loss_scope == "sequence":  # each window's f and P, the mean over windows (B of them)
            windows = shape[0] if len(shape) == 3 else 1
            assigned = torch.zeros(windows, E, device=x.device).scatter_add_(
                1, top.view(windows, -1), torch.ones(windows, top.numel() // windows, device=x.device))  # (B, E)
            mean_probs = probs.view(windows, -1, E).mean(1)  # (B, E)
        else:
            assigned, mean_probs = counts.float(), probs.mean(0)  # (E,) each; counts carry no gradient
        if moe.aux_loss > 0 and self.count_reduce is not None:
            assigned = self.count_reduce(assigned)  # the tokens of every rank the loss's scope covers
        f = assigned / assigned.sum(-1, keepdim=True).clamp(min=1)  # = counts / (N k) on one process
        aux = E * (f * mean_probs).sum(-1).mean()
        z = torch.logsumexp(logits, dim=-1).square().mean()
        self.last_losses = torch.stack([aux, z])
        # Counted once per forward: activation checkpointing's recomputation stops as soon as the saved tensors are
        # rebuilt (torch's non-reentrant checkpoint, early stop on by default), before this line.
        if self.training and self.count_routing:
            if self.load is None or self.load.device != x.device:
                self.load = torch.zeros(E + 5, device=x.device)
            total = torch.tensor(float(N * k), device=x.device)
            self.load += torch.cat([counts.float(), dropped.float()[None], total[None], aux.detach()[None],
                                    z.detach()[None], torch.ones(1, device=x.device)])
        return out.view(shape)

    @torch.no_grad()
    def finish_step(self, stats: torch.Tensor) -> None:
        """Take this step's `stats` (the load reduced over ranks), move the bias, start the next step."""
        self.step_stats = stats
        E = self.cfg.num_experts
        if self.load is None:
            return
        if self.expert_bias is not None:
            # DeepSeek-V3 §2.1.2: b_i += gamma * sign(mean load - load_i): overloaded experts become less likely.
            counts = stats[:E]
            self.expert_bias += self.cfg.bias_update_rate * torch.sign(counts.mean() - counts)
        self.load.zero_()


def moe_layers(model: nn.Module) -> List[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_loss(model: nn.Module) -> Optional[torch.Tensor]:
    """model.moe.aux_loss x the auxiliary loss + model.moe.router_z_loss x the router z-loss, each averaged over the
    MoE layers of the last forward (as transformers' OLMoE averages its load-balancing loss over layers, so a
    coefficient means the same at any depth); None without MoE layers or with both coefficients 0."""
    layers = moe_layers(model)
    if not layers:
        return None
    cfg = layers[0].cfg
    if not (cfg.aux_loss or cfg.router_z_loss):
        return None
    aux, z = torch.stack([m.last_losses for m in layers]).mean(0)
    return cfg.aux_loss * aux + cfg.router_z_loss * z


@torch.no_grad()
def end_step(model: nn.Module, reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
    """After each optimizer step: sum every MoE layer's routing counts over the data-parallel ranks with `reduce`
    (one collective; every rank then moves its bias identically; None: this process's counts alone), update the
    biases, keep the statistics."""
    layers = [m for m in moe_layers(model) if m.load is not None]  # those a training forward has run
    if not layers:
        return
    loads = torch.stack([m.load for m in layers])  # (layers, E + 5)
    if reduce is not None:
        loads = reduce(loads)
    for m, stats in zip(layers, loads):
        m.finish_step(stats.clone())


def step_statistics(layer: MoE) -> Optional[Dict[str, torch.Tensor]]:
    """The last finished step's routing statistics of one layer, as 0-d tensors (read on the host by the caller):
    tokens per expert min / max / coefficient of variation (std / mean; 0 is perfectly balanced), the top expert's
    share of assignments, the dropped fraction, the mean auxiliary and z losses, the bias norm."""
    stats = layer.step_stats
    if stats is None:
        return None
    E = layer.cfg.num_experts
    counts, dropped, total, aux, z, forwards = stats[:E], stats[E], stats[E + 1], stats[E + 2], stats[E + 3], \
        stats[E + 4]
    forwards = forwards.clamp(min=1)
    out = {"tokens_min": counts.min(), "tokens_max": counts.max(),
           "tokens_cv": counts.std(correction=0) / counts.mean().clamp(min=1e-12),
           "max_share": counts.max() / total.clamp(min=1), "dropped_fraction": dropped / total.clamp(min=1),
           "aux_loss": aux / forwards, "z_loss": z / forwards}
    if layer.expert_bias is not None:
        out["bias_norm"] = layer.expert_bias.norm()
    return out
