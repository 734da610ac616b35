"""Our GPT with gated attention (model.attention_gate=elementwise) in transformers' Qwen3NextForCausalLM terms, as
plain data (export only).

What makes the two compute the same function, line by line of transformers' modeling_qwen3_next.py (5.x):
- `Qwen3NextAttention`: q_proj writes, per head, head_dim query channels then head_dim gate channels
  (`torch.chunk(q_proj(x).view(..., -1, 2 * head_dim), 2)`), and the attention output is multiplied by
  sigmoid(gate) before o_proj: our wq and wg rows interleaved head by head, the elementwise gate of Qiu et al. 2025
  (G1). A headwise gate has no counterpart. Its q_norm and k_norm are always there: our per-head model.qk_norm.
- `Qwen3NextRMSNorm` is zero-centred: x · rsqrt(mean(x²) + eps) · (1 + weight), in fp32 as ours; every norm's
  weight is written as ours minus 1.
- RoPE: `partial_rotary_factor` 1.0 turns the whole head (Qwen3-Next's own 0.25 turns a quarter), rotate-half
  layout as Llama's.
- Layers: `layer_types` all full_attention (no Gated DeltaNet linear-attention layer) and every layer in
  `mlp_only_layers` with `num_experts` 0: the dense SwiGLU MLP (`Qwen3NextMLP`), intermediate_size = d_ff.
Logits equal to transformers' (tests/interop/test_hf.py). Import reads Llama-shaped folders only, so an exported
folder is not imported back.
"""

from typing import Any, Dict, Mapping

import torch

from lit_pretrain.errors import DataError
from lit_pretrain.model.config import GPTConfig

ARCHITECTURE = "Qwen3NextForCausalLM"
MODEL_TYPE = "qwen3_next"
# Llama's names of the norm weights Qwen3-Next stores as weight - 1 (zero-centred).
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
          "self_attn.k_norm.weight")


def check_exportable(cfg: GPTConfig) -> None:
    """A DataError naming the first model key Qwen3NextForCausalLM cannot express with a gated model."""
    for key, ours, theirs in (("attention_gate", cfg.attention_gate, "elementwise"), ("qk_norm", cfg.qk_norm, True),
                              ("qk_norm_scope", cfg.qk_norm_scope, "head"), ("moe", cfg.moe, None)):
        if ours != theirs:
            raise DataError(f"model.{key}={ours!r} cannot be expressed by transformers' {ARCHITECTURE} (the one "
                            f"transformers class with gated attention has {key}={theirs!r}): this model cannot be "
                            "exported to Hugging Face format")


def to_config(llama: Dict[str, Any], cfg: GPTConfig) -> Dict[str, Any]:
    """config.json of a Qwen3NextForCausalLM from the Llama one of the same model without its gate."""
    drop = ("rope_scaling", "pretraining_tp", "mlp_bias", "use_sliding_window", "sliding_window", "max_window_layers")
    out = {k: v for k, v in llama.items() if k not in drop}
    return {**out, "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "partial_rotary_factor": 1.0,
            "rope_parameters": {**llama["rope_parameters"], "partial_rotary_factor": 1.0},
            "layer_types": ["full_attention"] * cfg.n_layers, "mlp_only_layers": list(range(cfg.n_layers)),
            "num_experts": 0, "num_experts_per_tok": 1, "decoder_sparse_step": 1}


def to_names(llama: Mapping[str, torch.Tensor], gates: Mapping[int, torch.Tensor], cfg: GPTConfig
             ) -> Dict[str, torch.Tensor]:
    """Qwen3-Next's weights from the Llama-named ones (llama.to_llama_names of every weight but the gates) and each
    block's gate (wg, by block index): q_proj (2·H·Q, d) = per head [wq_h; wg_h], norms minus 1."""
    out = dict(llama)
    H, Q = cfg.n_heads, cfg.head_dim
    for i, wg in gates.items():
        name = f"model.layers.{i}.self_attn.q_proj.weight"
        wq = out[name]
        out[name] = torch.cat([wq.view(H, Q, -1), wg.view(H, Q, -1)], dim=1).reshape(2 * H * Q, -1)  # (2HQ, d)
    for name in list(out):
        if name == "model.norm.weight" or name.endswith(_NORMS):
            out[name] = out[name] - 1  # zero-centred: (1 + weight)
    return out
