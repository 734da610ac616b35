"""Our model family's parameter count, FLOPs and a shape near a parameter count, as pure functions of the shape.

The counts follow `lit_pretrain.model.GPT` exactly (tests build the model and compare): per block 4·d² attention
weights (wq, wk, wv, wo), 3·d·f SwiGLU weights (w_gate, w_up, w_down) and 2·d RMSNorm weights; a final RMSNorm
(d); the token embedding V·d, plus a separate head V·d when embeddings are untied.
Conventions: `params` counts every unique parameter (Hoffmann et al. 2022 count embeddings); `non_embedding_params`
leaves out the vocabulary matrices (Kaplan et al. 2020 §2.1).
"""

import math
from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

from lit_pretrain.model_config import GPTConfig, flops_per_token_formula


def block_params(cfg: GPTConfig) -> int:
    d, f = cfg.d_model, cfg.hidden_dim
    return 4 * d * d + 3 * d * f + 2 * d


def non_embedding_params(cfg: GPTConfig) -> int:
    return cfg.n_layers * block_params(cfg) + cfg.d_model


def params(cfg: GPTConfig) -> int:
    vocab_matrices = (1 if cfg.tie_embeddings else 2) * _vocab(cfg) * cfg.d_model
    return non_embedding_params(cfg) + vocab_matrices


def flops_per_token(cfg: GPTConfig, seq_len: Optional[int] = None) -> int:
    """Training FLOPs per token as `GPT.flops_per_token` counts them (PaLM appendix B: 6·N + 12·L·H·Q·T)."""
    n_matmul = non_embedding_params(cfg) + _vocab(cfg) * cfg.d_model
    return flops_per_token_formula(n_matmul, cfg.n_layers, cfg.n_heads, cfg.head_dim, seq_len or cfg.seq_len)


def param_shapes(cfg: GPTConfig) -> Dict[str, Tuple[int, ...]]:
    """Name -> shape of every unique parameter, in `GPT.named_parameters()` order (a tied head is not repeated)."""
    d, f, v = cfg.d_model, cfg.hidden_dim, _vocab(cfg)
    shapes = {"tok_embeddings.weight": (v, d)}
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        shapes[p + "attn_norm.weight"] = (d,)
        for name in ("wq", "wk", "wv", "wo"):
            shapes[f"{p}attn.{name}.weight"] = (d, d)
        shapes[p + "mlp_norm.weight"] = (d,)
        shapes[p + "mlp.w_gate.weight"] = (f, d)
        shapes[p + "mlp.w_up.weight"] = (f, d)
        shapes[p + "mlp.w_down.weight"] = (d, f)
    shapes["norm.weight"] = (d,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


@dataclass(frozen=True)
class Shape:
    n_layers: int
    d_model: int
    n_heads: int
    params: int
    non_embedding_params: int
    flops_per_token: int


def shape_of(cfg: GPTConfig) -> Shape:
    return Shape(cfg.n_layers, cfg.d_model, cfg.n_heads, params(cfg), non_embedding_params(cfg), flops_per_token(cfg))


def shape_near(target_params: float, vocab_size: int, seq_len: int, head_dim: int = 64, aspect_ratio: float = 64.0,
               tie_embeddings: bool = True, count: str = "params", max_layers: int = 512,
               tolerance: float = 0.05) -> Shape:
    """A shape of our family (d_model = n_heads · head_dim, SwiGLU 8/3·d) near `target_params`: among shapes whose
    width/depth ratio d_model / n_layers is within a factor 2 of `aspect_ratio`, those within `tolerance` (relative)
    of the target, the one closest to the aspect ratio; if none is that close, the nearest count. (Kaplan et al.
    2020 §3.1: loss varies by only a few percent over aspect ratios 20-200 at fixed N, so the ratio is a
    free design choice; 64 is GPT-3 Small's 768/12 and LLaMA-7B has 128).
    count: "params" (all parameters, Chinchilla's N) or "non_embedding_params" (Kaplan's N).
    """
    if target_params <= 0:
        raise ValueError(f"target parameter count must be positive, got {target_params}")
    if count not in ("params", "non_embedding_params"):
        raise ValueError(f"count must be 'params' or 'non_embedding_params', got {count!r}")
    import numpy as np  # imported here: the --help of plan and memory need no numpy (~0.1 s of a fast command)

    # every (n_layers, n_heads) whose width is within the aspect window, as arrays (the same counts as `params`)
    layers = np.arange(1, max_layers + 1)
    lo = np.maximum(1, np.ceil(layers * aspect_ratio / 2 / head_dim)).astype(int)
    hi = np.floor(layers * aspect_ratio * 2 / head_dim).astype(int)
    n_layers = np.repeat(layers, np.maximum(0, hi - lo + 1))
    n_heads = np.concatenate([np.arange(a, b + 1) for a, b in zip(lo, hi) if b >= a] or [np.zeros(0, int)])
    if n_heads.size == 0:
        raise ValueError(f"no shape with head_dim {head_dim} and aspect ratio {aspect_ratio} up to {max_layers} "
                         "layers: lower the aspect ratio or the head dimension")
    d = (n_heads * head_dim).astype(np.float64)
    hidden = 64 * ((8 * d // 3 + 63) // 64)
    non_embedding = n_layers * (4 * d * d + 3 * d * hidden + 2 * d) + d
    n = non_embedding + (1 if tie_embeddings else 2) * vocab_size * d if count == "params" else non_embedding
    miss = np.abs(np.log(n / target_params))
    near = miss <= math.log1p(tolerance)
    pool = np.flatnonzero(near) if near.any() else np.flatnonzero(miss == miss.min())
    off_ratio = np.abs(np.log(d[pool] / n_layers[pool] / aspect_ratio))
    pick = pool[np.lexsort((miss[pool], off_ratio))[0]]
    cfg = GPTConfig(vocab_size=vocab_size, n_layers=int(n_layers[pick]), d_model=int(d[pick]),
                    n_heads=int(n_heads[pick]), seq_len=seq_len, tie_embeddings=tie_embeddings)
    return shape_of(cfg)


def with_shape(cfg: GPTConfig, n_layers: int, d_model: int, n_heads: int) -> GPTConfig:
    return replace(cfg, n_layers=n_layers, d_model=d_model, n_heads=n_heads)


def _vocab(cfg: GPTConfig) -> int:
    if cfg.vocab_size is None:
        raise ValueError("model.vocab_size is null: the parameter count needs the vocabulary size")
    return cfg.vocab_size
