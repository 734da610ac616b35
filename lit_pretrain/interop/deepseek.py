"""Our latent-attention GPT (model.attention=mla) in transformers' DeepseekV3ForCausalLM terms, and back, as plain data.

What makes the two compute the same function, line by line of transformers' modeling_deepseek_v3.py (5.x):
- `DeepseekV3Attention` is model/mla.py's LatentAttention: q_proj, or q_a_proj, q_a_layernorm and q_b_proj (our wq,
  or wq_a, q_norm, wq_b); kv_a_proj_with_mqa's rows [latent | rotated key] (wkv_a), kv_a_layernorm (kv_norm),
  kv_b_proj's head-major rows [nope key | value] (wkv_b), o_proj (wo); both latent norms with eps 1e-6 (ours too,
  mla.LATENT_NORM_EPS); scaling qk_head_dim**-0.5, SDPA's default for our queries' width.
- RoPE: written with rope_interleave=false, transformers' rotate-half form over qk_rope_head_dim channels (its
  head_dim), ours; unscaled (model.rope_scaling with latent attention is refused here: DeepSeek's YaRN also scales
  the unrotated channels' softmax, mscale_all_dim, which our RoPE does not).
- The block, norms and SwiGLU MLP are Llama's (llama.py); every layer dense: first_k_dense_replace = n_layers, so
  none of DeepSeek-V3's routed-expert settings is read. model.moe is refused: DeepSeek-V3's router (sigmoid scores
  grouped into n_group, routed_scaling_factor) is not ours to the bit.
"""

from dataclasses import asdict
from typing import Any, Callable, Dict, Mapping, Optional

from lit_pretrain.errors import DataError
from lit_pretrain.model.config import GPTConfig

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
# Our block names -> DeepseekV3's (under model.layers.{i}.)
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}


def mla_function_fields(cfg: GPTConfig) -> Optional[Dict[str, Any]]:
    """model.mla as plain data, or None (multi-head attention)."""
    mla = cfg.mla
    if mla is None:
        return None
    return dict(mla) if isinstance(mla, Mapping) else asdict(mla)


def check_exportable(cfg: GPTConfig) -> None:
    """A DataError naming the first model key DeepseekV3ForCausalLM cannot express with our latent attention."""
    for key, ours, why in (("model.moe", cfg.moe, "its routed experts are DeepSeek-V3's grouped sigmoid router, not "
                            "ours to the bit"),
                           ("model.rope_scaling", cfg.rope_scaling, "its YaRN also scales the unrotated channels' "
                            "softmax (mscale_all_dim)")):
        if ours is not None:
            raise DataError(f"{key} with model.attention=mla cannot be expressed by transformers' {ARCHITECTURE} "
                            f"({why}): set {key}=null to export this model to Hugging Face format")


def to_config(llama: Dict[str, Any], cfg: GPTConfig) -> Dict[str, Any]:
    """config.json of a dense DeepseekV3ForCausalLM from the Llama one llama.to_llama_config made of the same `cfg`
    (with multi-head attention)."""
    out = {k: v for k, v in llama.items() if k not in ("mlp_bias", "head_dim", "rope_scaling")}
    out.update({"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **mla_function_fields(cfg),
                "num_key_value_heads": cfg.n_heads, "rope_interleave": False,
                "first_k_dense_replace": cfg.n_layers, "moe_intermediate_size": cfg.hidden_dim,
                "n_shared_experts": 0, "n_routed_experts": 1, "num_experts_per_tok": 1, "n_group": 1,
                "topk_group": 1, "num_nextn_predict_layers": 0})
    return out


def from_config(hf: Mapping[str, Any], fields: Dict[str, Any], refuse: Callable[[str, Any, str], DataError]):
    """Our fields of a DeepseekV3 config.json, given the Llama-shaped `fields` read from it."""
    layers = hf["num_hidden_layers"]
    if hf.get("first_k_dense_replace", 3) < layers:
        raise refuse("first_k_dense_replace", hf.get("first_k_dense_replace", 3),
                     f"only a dense model (first_k_dense_replace >= num_hidden_layers={layers}) imports: our experts "
                     "are not DeepSeek-V3's grouped sigmoid router")
    if hf.get("rope_interleave", True):
        raise refuse("rope_interleave", hf.get("rope_interleave", True),
                     "our RoPE is the rotate-half form (rope_interleave=false)")
    if fields["rope_scaling"] is not None:
        raise refuse("rope_parameters", hf.get("rope_parameters"), "latent attention imports with unscaled RoPE")
    mla = {k: hf.get(k) for k in MLA_FIELDS}
    for key, value in mla.items():
        if not (value is None and key == "q_lora_rank") and (not isinstance(value, int) or value < 1):
            raise refuse(key, value, "a positive integer")
    return {**fields, "attention": "mla", "mla": mla}
