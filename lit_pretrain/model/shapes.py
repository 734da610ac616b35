"""Our model family's parameter count, FLOPs and a shape near a parameter count, as pure functions of the shape.

Every count sums the architecture table `GPTConfig.modules()`, the one description `lit_pretrain.model.gpt.GPT` builds
its modules from (tests build the model on the meta device and compare), so a variant (grouped-query attention,
QK-norm, GELU MLP, ...) changes them with no edit here. Default family, per block: 4·d² attention weights (wq, wk,
wv, wo), 3·d·f SwiGLU weights (w_gate, w_up, w_down) and 2·d norm weights; a final norm (d); the token embedding
V·d, plus a separate head V·d when embeddings are untied.
Conventions: `params` counts every unique parameter (Hoffmann et al. 2022 count embeddings); `non_embedding_params`
leaves out the vocabulary matrices (Kaplan et al. 2020 §2.1).
"""

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from lit_pretrain.model.config import GPTConfig, flops_per_token_formula

# The architecture table's variant keys `plan`/`memory --model KEY=VALUE` and a run file's shape carry:
# key -> (accepted types, null allowed).
VARIANT_TYPES = {"n_kv_heads": (int, True), "qk_norm": (bool, False), "logit_softcap": ((int, float), True),
                 "norm": (str, False), "mlp": (str, False), "qk_norm_scope": (str, False), "moe": (dict, True),
                 "attention_sinks": (bool, False), "attention_gate": (str, True),
                 "sliding_window": (int, True), "global_attention_every": (int, True), "layer_types": (list, True)}
VARIANT_KEYS = tuple(VARIANT_TYPES)


def block_params(cfg: GPTConfig) -> int:
    """Parameters of the largest block (with model.moe, a mixture-of-experts one: what a pipeline stage or a
    planner's per-layer bound must hold)."""
    return max(sum(spec.numel for spec in cfg.block_modules(i).values()) for i in _block_kinds(cfg))


def block_params_replicated(cfg: GPTConfig) -> List[Tuple[int, int]]:
    """(parameters, of which replicated matrices: the router, latent attention's down-projections) of each kind of
    block (dense, MoE): under tensor parallelism the latter are whole on every rank of the group, not split; the
    routed experts are split (parallel/expert_tensor.py)."""
    out = []
    for i in _block_kinds(cfg):
        specs = cfg.block_modules(i)
        kept = sum(s.numel for s in specs.values() if s.kind != "norm" and s.tensor_parallel is None)
        out.append((sum(s.numel for s in specs.values()), kept))
    return out


def block_norm_params(cfg: GPTConfig) -> int:
    """The norm weights of one block (replicated under tensor parallelism)."""
    return sum(spec.numel for spec in cfg.block_modules().values() if spec.kind == "norm")


def non_embedding_params(cfg: GPTConfig) -> int:
    return sum(s.numel for n, s in _modules(cfg).items() if n not in ("tok_embeddings", "lm_head"))


def params(cfg: GPTConfig) -> int:
    return sum(s.numel for s in _modules(cfg).values() if not s.tied)


def active_non_embedding_params(cfg: GPTConfig) -> int:
    """Non-embedding parameters one token uses: of the routed experts, top_k (ModuleSpec.active_numel); equal to
    `non_embedding_params` for a dense model."""
    return sum(s.active_numel for n, s in _modules(cfg).items() if n not in ("tok_embeddings", "lm_head"))


def active_params(cfg: GPTConfig) -> int:
    """Every unique parameter one token uses (OLMoE's "1B active" of "7B total")."""
    return sum(s.active_numel for s in _modules(cfg).values() if not s.tied)


def flops_per_token(cfg: GPTConfig, seq_len: Optional[int] = None) -> int:
    """Training FLOPs per token as `GPT.flops_per_token` counts them (PaLM appendix B: 6·N + 12·L·H·Q·T), N the
    active parameters (a token's matmuls touch only its top_k experts), each attention layer over the keys its
    mask keeps (`GPTConfig.attention_masks`: a sliding-window layer's window)."""
    # model.mtp_depth: its modules are in N, each adds an attention layer and a pass through the shared head
    n_matmul = active_non_embedding_params(cfg) + (1 + cfg.mtp_depth) * _vocab(cfg) * cfg.d_model
    return flops_per_token_formula(n_matmul, cfg.n_layers + cfg.mtp_depth, cfg.n_heads, cfg.qk_head_dim,
                                   seq_len or cfg.seq_len, cfg.attention_masks(), v_head_dim=cfg.value_head_dim)


def sizes(cfg: GPTConfig) -> Dict[str, int]:
    """The whole model's sizes as a run's summary.json records them (never one rank's part of it): every unique
    parameter, the non-embedding ones, those one token uses, and training FLOPs per token."""
    return {"params": params(cfg), "non_embedding_params": non_embedding_params(cfg),
            "active_params": active_params(cfg), "flops_per_token": flops_per_token(cfg)}


def param_shapes(cfg: GPTConfig) -> Dict[str, Tuple[int, ...]]:
    """Name -> shape of every unique parameter, in `GPT.named_parameters()` order (a tied head is not repeated)."""
    return {f"{name}.weight": spec.shape for name, spec in _modules(cfg).items() if not spec.tied}


def tensor_parallel_plan(cfg: GPTConfig) -> Dict[str, str]:
    """Module name -> "column" | "row" | "expert_column" | "expert_row" | "partial" for every module tensor
    parallelism treats specially; the built model's Linears and expert stacks carry the same roles
    (`tensor_parallel` attribute), which parallel/tensor.py reads."""
    return {name: spec.tensor_parallel for name, spec in _modules(cfg).items() if spec.tensor_parallel}


@dataclass(frozen=True)
class Shape:
    n_layers: int
    d_model: int
    n_heads: int
    params: int
    non_embedding_params: int
    flops_per_token: int
    n_kv_heads: Optional[int] = None


def shape_of(cfg: GPTConfig) -> Shape:
    return Shape(cfg.n_layers, cfg.d_model, cfg.n_heads, params(cfg), non_embedding_params(cfg), flops_per_token(cfg),
                 cfg.n_kv_heads)


def shape_near(target_params: float, vocab_size: int, seq_len: int, head_dim: int = 64, aspect_ratio: float = 64.0,
               tie_embeddings: bool = True, count: str = "params", max_layers: int = 512,
               tolerance: float = 0.05, template: Optional[GPTConfig] = None) -> Shape:
    """A shape of our family (d_model = n_heads · head_dim, the MLP's default width) near `target_params`: among
    shapes whose width/depth ratio d_model / n_layers is within a factor 2 of `aspect_ratio`, those within
    `tolerance` (relative) of the target, the one closest to the aspect ratio; if none is that close, the nearest
    count. (Kaplan et al. 2020 §3.1: loss varies by only a few percent over aspect ratios 20-200 at fixed N, so
    the ratio is a free design choice; 64 is GPT-3 Small's 768/12 and LLaMA-7B has 128).
    count: "params" (all parameters, Chinchilla's N) or "non_embedding_params" (Kaplan's N).
    template: the variant (norm, mlp, qk_norm, n_kv_heads: a shape's n_heads is then a multiple of it, ...); its
    shape fields are replaced. Counts come from the architecture table, evaluated once per width.
    """
    if template is not None and template.moe is not None:
        raise ValueError("shape_near searches dense shapes (parameters grow linearly in depth); with model.moe the "
                         "count depends on which layers are MoE: set model.moe=null to search, then add it")
    if target_params <= 0:
        raise ValueError(f"target parameter count must be positive, got {target_params}")
    if count not in ("params", "non_embedding_params"):
        raise ValueError(f"count must be 'params' or 'non_embedding_params', got {count!r}")
    import numpy as np  # imported here: the --help of plan and memory need no numpy (~0.1 s of a fast command)

    template = replace(template or GPTConfig(), vocab_size=vocab_size, seq_len=seq_len, tie_embeddings=tie_embeddings,
                       d_ff=None)
    # every (n_layers, n_heads) whose width is within the aspect window, as arrays
    layers = np.arange(1, max_layers + 1)
    lo = np.maximum(1, np.ceil(layers * aspect_ratio / 2 / head_dim)).astype(int)
    hi = np.floor(layers * aspect_ratio * 2 / head_dim).astype(int)
    n_layers = np.repeat(layers, np.maximum(0, hi - lo + 1))
    n_heads = np.concatenate([np.arange(a, b + 1) for a, b in zip(lo, hi) if b >= a] or [np.zeros(0, int)])
    # counts per width, from the table (one evaluation per head count), looked up by n_heads
    by_heads = np.full((int(n_heads.max(initial=0)) + 1, 3), np.nan)
    for h in np.unique(n_heads):
        counts = _at_width(template, int(h), head_dim)
        if counts is not None:
            by_heads[h] = counts
    keep = ~np.isnan(by_heads[n_heads, 0])
    n_layers, n_heads = n_layers[keep], n_heads[keep]
    if n_heads.size == 0:
        raise ValueError(f"no shape with head_dim {head_dim} and aspect ratio {aspect_ratio} up to {max_layers} "
                         "layers: lower the aspect ratio or the head dimension")
    d = (n_heads * head_dim).astype(np.float64)
    block, fixed, vocab = by_heads[n_heads].T
    non_embedding = n_layers * block + fixed
    n = non_embedding + vocab if count == "params" else non_embedding
    miss = np.abs(np.log(n / target_params))
    near = miss <= math.log1p(tolerance)
    pool = np.flatnonzero(near) if near.any() else np.flatnonzero(miss == miss.min())
    off_ratio = np.abs(np.log(d[pool] / n_layers[pool] / aspect_ratio))
    pick = pool[np.lexsort((miss[pool], off_ratio))[0]]
    cfg = _with_heads(template, int(n_heads[pick]), head_dim)
    return shape_of(replace(cfg, n_layers=int(n_layers[pick])))


def _with_heads(template: GPTConfig, n_heads: int, head_dim: int) -> Optional[GPTConfig]:
    """The template at n_heads heads of head_dim, keeping its n_kv_heads key/value heads (as Llama 2 70B and Llama 3
    keep 8 at every width); None where they do not divide n_heads."""
    kv = template.n_kv_heads
    if kv is not None and n_heads % kv:
        return None
    return replace(template, n_layers=1, d_model=n_heads * head_dim, n_heads=n_heads)


def _at_width(template: GPTConfig, n_heads: int, head_dim: int) -> Optional[Tuple[int, int, int]]:
    """(parameters per block, non-embedding parameters outside the blocks, vocabulary matrices) at that width."""
    cfg = _with_heads(template, n_heads, head_dim)
    if cfg is None:
        return None
    block = block_params(cfg)
    non_embedding = non_embedding_params(cfg)
    return block, non_embedding - block, params(cfg) - non_embedding


def with_shape(cfg: GPTConfig, n_layers: int, d_model: int, n_heads: int) -> GPTConfig:
    return replace(cfg, n_layers=n_layers, d_model=d_model, n_heads=n_heads)


def _block_kinds(cfg: GPTConfig):
    """One layer index of each kind of block (dense, MoE) the model has."""
    return list({cfg.is_moe_layer(i): i for i in range(cfg.n_layers)}.values())


def _modules(cfg: GPTConfig):
    _vocab(cfg)
    return cfg.modules()


def _vocab(cfg: GPTConfig) -> int:
    if cfg.vocab_size is None:
        raise ValueError("model.vocab_size is null: the parameter count needs the vocabulary size")
    return cfg.vocab_size
