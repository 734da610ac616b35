"""`lit-pretrain plan`: a compute-optimal plan from a budget (FLOPs), a parameter count or a token count.

Given one of C, N, D the law's compute-optimal frontier N_opt(C) (with C = 6·N·D) gives the other two; the plan adds
the tokens-per-parameter ratio, the law's predicted loss where it has one, a concrete shape of our model family near
N, and the optimizer steps at a given batch.
"""

import json
import math
from pathlib import Path
from typing import Optional

from lit_pretrain.errors import ConfigError
from lit_pretrain.model import shapes
from lit_pretrain.planning.laws import PUBLISHED, ParametricLaw, PlanLaw, from_parametric


def load_law(name_or_path: str) -> PlanLaw:
    """A published law by name, or a law file written by `lit-pretrain fit`."""
    if name_or_path in PUBLISHED:
        return PUBLISHED[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"--law {name_or_path!r} is neither a published law ({', '.join(PUBLISHED)}) nor a law "
                          "file: pass one of those names or the law.json that `lit-pretrain fit --out` wrote")
    try:
        data = json.loads(path.read_text())
        fitted = ParametricLaw.from_dict(data["chinchilla"])
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{path} is not a law file from `lit-pretrain fit` (no 'chinchilla' coefficients "
                          "E, A, B, alpha, beta)") from None
    law = from_parametric(fitted)
    return PlanLaw(f"fitted:{path}", fitted.source or "lit-pretrain fit", law.param_count, law.n_opt, law.loss)


def _invert(fn, target: float, lo: float = 1.0, hi: float = 1e40) -> float:
    """The C with fn(C) = target for an increasing fn, by bisection in log space (60 halvings: ~1e-16 relative)."""
    a, b = math.log(lo), math.log(hi)
    for _ in range(200):
        mid = 0.5 * (a + b)
        if fn(math.exp(mid)) < target:
            a = mid
        else:
            b = mid
    return math.exp(0.5 * (a + b))


def plan(law: PlanLaw, flops: Optional[float] = None, params: Optional[float] = None, tokens: Optional[float] = None,
         vocab_size: int = 32000, seq_len: int = 2048, tokens_per_step: int = 2**20, head_dim: int = 64,
         aspect_ratio: float = 64.0, template=None) -> dict:
    """The compute-optimal (C, N, D) through exactly one of flops, params, tokens, and a shape near N (of the
    `template` GPTConfig's variant: norm, MLP, key/value heads, ...)."""
    given = [k for k, v in (("flops", flops), ("params", params), ("tokens", tokens)) if v is not None]
    if len(given) != 1:
        raise ConfigError(f"give exactly one of --flops, --params, --tokens (got {given or 'none'})")
    value = {"flops": flops, "params": params, "tokens": tokens}[given[0]]
    if not value > 0:
        raise ConfigError(f"--{given[0]} must be positive, got {value}")
    if flops is None:
        # N_opt(C) rises with C and D_opt(C) = C / (6·N_opt(C)) too (every law here has N_opt ∝ C^a with a < 1)
        fn = law.n_opt if params is not None else (lambda c: c / (6 * law.n_opt(c)))
        flops = _invert(fn, value)
    n = law.n_opt(flops)
    d = flops / (6 * n)
    shape = shapes.shape_near(n, vocab_size, seq_len, head_dim=head_dim, aspect_ratio=aspect_ratio,
                              count=law.param_count, template=template)
    shape_n = shape.params if law.param_count == "params" else shape.non_embedding_params
    steps = math.ceil(d / tokens_per_step)
    return {
        "law": law.name, "source": law.source, "param_count": law.param_count,
        "flops": flops, "params": n, "tokens": d, "tokens_per_param": d / n,
        "predicted_loss": law.loss(n, d) if law.loss else None,
        "shape": {"n_layers": shape.n_layers, "d_model": shape.d_model, "n_heads": shape.n_heads,
                  "n_kv_heads": shape.n_kv_heads, "head_dim": head_dim, "vocab_size": vocab_size, "seq_len": seq_len,
                  "params": shape.params,
                  "non_embedding_params": shape.non_embedding_params, "flops_per_token": shape.flops_per_token},
        # the shape trained on the plan's tokens: its own ratio and its full compute (6N + attention)
        "shape_tokens_per_param": d / shape_n,
        "shape_flops": shape.flops_per_token * d,
        "tokens_per_step": tokens_per_step, "steps": steps,
    }


def format_plan(p: dict) -> str:
    s = p["shape"]
    loss = "n/a (the law gives no loss)" if p["predicted_loss"] is None else f"{p['predicted_loss']:.4f} nats/token"
    convention = "all parameters" if p["param_count"] == "params" else "non-embedding parameters (Kaplan)"
    rows = [
        ("law", f"{p['law']}  ({p['source']})"),
        ("compute", f"{p['flops']:.4g} FLOPs (C = 6·N·D)"),
        ("parameters N", f"{p['params']:.4g}  ({convention})"),
        ("tokens D", f"{p['tokens']:.4g}"),
        ("tokens_per_param", f"{p['tokens_per_param']:.2f}"),
        ("predicted loss", loss),
        ("shape", f"{s['n_layers']} layers, d_model {s['d_model']}, {s['n_heads']} heads of {s['head_dim']} "
                  f"(vocab {s['vocab_size']}, seq_len {s['seq_len']})"),
        ("shape parameters", f"{s['params']:,} ({s['non_embedding_params']:,} non-embedding); "
                             f"tokens_per_param {p['shape_tokens_per_param']:.2f}"),
        ("shape compute", f"{p['shape_flops']:.4g} FLOPs ({s['flops_per_token']:,} FLOPs/token incl. attention)"),
        ("steps", f"{p['steps']:,} at {p['tokens_per_step']:,} tokens per step"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
