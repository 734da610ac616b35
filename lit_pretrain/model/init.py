"""Weight initialization (model.init) as a pure function of the module tree, and μP's learning-rate side.

- standard: every weight matrix and the embedding ~ N(0, init_std); norm gains 1, biases 0.
- scaled_residual (the default): as standard, and the residual output projections (attn.wo, mlp.w_down: marked
  `residual_projection = True` on the Linear) ~ N(0, init_std / sqrt(2 n_layers)), so the residual stream's
  variance stays O(1) in depth: 2 projections add into it per block (GPT-2 paper §2.3).
- mup: μP (Yang et al. 2022, "Tensor Programs V", table 3, with the readout multiplier of its appendix and the
  muP package's MuReadout/MuAdamW), relative to a base width b = model.mup_base_width and width n = d_model:
  hidden matrices (both dimensions grow with width) ~ N(0, init_std² · b/n) with Adam rate × b/n (mup_lr_scale);
  the embedding and the output head (one dimension grows) keep init_std and their rate; the logits are multiplied
  by b/n (GPT.output_multiplier), which keeps them O(1) after the head's updates of size O(1) per coordinate
  line up with the O(n)-wide hidden state. The residual projections keep scaled_residual's depth factor.
  Identical to scaled_residual at n = b.

Attention's 1/sqrt(head_dim) score scale is left as is: μP's 1/head_dim matters when head_dim grows with width,
and this project grows width by heads of a fixed size as often as not.
"""

import math
from typing import Dict, Optional

import torch
from torch import nn

# The residual output projections by name, for models built before the Linear carried the mark.
_RESIDUAL_NAMES = ("attn.wo", "mlp.w_down")


def is_residual_projection(name: str, module: nn.Module) -> bool:
    mark = getattr(module, "residual_projection", None)
    if mark is not None:
        return bool(mark)
    return name.endswith(_RESIDUAL_NAMES)


def width_ratio(cfg) -> float:
    """b/n of μP: model.mup_base_width / d_model (1.0 unless model.init is mup)."""
    if getattr(cfg, "init", "scaled_residual") != "mup":
        return 1.0
    return cfg.mup_base_width / cfg.d_model


def mup_lr_scale(cfg) -> Optional[Dict[str, float]]:
    """Learning-rate factors by parameter kind (optim.param_kind) that μP adds for Adam: hidden matrices × b/n.
    None when model.init is not mup (or there is no config): no factor."""
    if cfg is None or getattr(cfg, "init", "scaled_residual") != "mup":
        return None
    return {"hidden": width_ratio(cfg)}


def _block_of(name: str) -> int:
    """The block index of a submodule name ("blocks.3.attn.wq" -> 3); -1 outside the blocks."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blocks" and parts[1].isdigit() else -1


@torch.no_grad()
def initialize(model: nn.Module, cfg) -> None:
    """Initialize every parameter of `model` (a GPT, or any tree of Embedding, Linear and norm modules) by
    cfg.init; deterministic under `torch.manual_seed`.

    Draw order (what makes a seed's weights): embeddings, then block by block its other matrices before its
    residual projections (each in `named_modules` order), then an untied head: the order of the weights before
    model.init existed, so a seed gives the same weights bitwise."""
    scheme = getattr(cfg, "init", "scaled_residual")
    std, ratio = cfg.init_std, width_ratio(cfg)
    residual_std = std if scheme == "standard" else std / math.sqrt(2 * cfg.n_layers)
    embeddings, linears, heads = [], [], []
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            embeddings.append(module)
        elif getattr(module, "expert", False):  # model.moe's stacked expert weights (E, out, in): matrices too
            linears.append((name, module))
        elif isinstance(module, nn.Linear):
            (heads if name.split(".")[-1] == "lm_head" else linears).append((name, module))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
            if module.weight is not None:
                nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        if getattr(module, "sink", False):  # model.attention_sinks start at 0: one zero-score key, no draw
            nn.init.zeros_(module.weight)
        if getattr(module, "expert_bias", None) is not None:  # DeepSeek-V3's balancing bias starts at 0
            nn.init.zeros_(module.expert_bias)
    tied = {id(m.weight) for m in embeddings}
    for module in embeddings:
        nn.init.normal_(module.weight, mean=0.0, std=std)
    linears.sort(key=lambda nm: (_block_of(nm[0]), is_residual_projection(*nm)))  # stable within each key
    for name, module in linears:
        s = residual_std if is_residual_projection(name, module) else std
        nn.init.normal_(module.weight, mean=0.0, std=s if ratio == 1.0 else s * math.sqrt(ratio))
    for _, module in heads:
        if id(module.weight) not in tied:  # a tied head is the embedding, drawn once
            nn.init.normal_(module.weight, mean=0.0, std=std)
        set_output_multiplier(module, ratio)


def _multiply_output(module: nn.Module, args, output):
    return output * module.output_multiplier


def set_output_multiplier(head: nn.Module, multiplier: float) -> None:
    """Multiply `head`'s output (the logits, before any soft-cap) by `multiplier`: μP's readout multiplier b/n.
    A forward hook on the head itself, so every path that runs the head (the GPT, a pipeline's last stage, cached
    decoding) applies it; registered once, only when the multiplier is not 1 (the default path stays untouched)."""
    head.output_multiplier = multiplier
    if multiplier != 1.0 and not getattr(head, "_output_multiplier_hooked", False):
        head.register_forward_hook(_multiply_output)
        head._output_multiplier_hooked = True
