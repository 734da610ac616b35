"""Our mixture-of-experts GPT (model.moe) in transformers' OlmoeForCausalLM terms, and back, as plain data.

What makes the two compute the same function, line by line of transformers' modeling_olmoe.py (5.x):
- Attention is llama.py's, plus `OlmoeAttention.q_norm`/`k_norm`: RMSNorms over the whole q (hidden_size) and k
  (n_kv_heads * head_dim) projections before the split into heads and RoPE: our model.qk_norm_scope=projection.
  A per-head QK-norm (qk_norm_scope=head) or none at all cannot be written as OLMoE (its norms are always there).
- `OlmoeTopKRouter`: softmax of the router logits in fp32, top-k, the k weights renormalized only with
  norm_topk_prob: our model.moe.score=softmax, top_k, norm_topk_prob. No bias in the choice (DeepSeek-V3's
  model.moe.bias_update_rate cannot be expressed), no shared expert, every layer sparse, dropless.
- `OlmoeExperts`: SwiGLU experts, down(silu(gate x) * up x) times the token's weight, summed over its k experts:
  our routed experts, intermediate_size = model.moe.d_ff_expert.
Weights are written as the hub's OLMoE checkpoints hold them, one tensor per expert and projection
(`mlp.experts.{e}.gate_proj.weight`, ...; transformers 5 stacks them into its `gate_up_proj`/`down_proj` on load,
4.x reads them as they are), so every expert is a named tensor a reader can count; import reads either layout.
"""

import re
from typing import Any, Callable, Dict, Mapping

import torch

from lit_pretrain.errors import DataError
from lit_pretrain.model.config import GPTConfig

ARCHITECTURE = "OlmoeForCausalLM"
MODEL_TYPE = "olmoe"
# The model.moe fields the weights' function depends on (the balancing coefficients and rate only train it).
MOE_FUNCTION_FIELDS = ("num_experts", "top_k", "num_shared_experts", "d_ff_expert", "first_dense_layers", "every_k",
                       "capacity_factor", "score", "norm_topk_prob", "bias_update_rate")
PROJECTIONS = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
_OURS_EXPERTS = re.compile(r"blocks\.(\d+)\.mlp\.experts\.(w_gate|w_up|w_down)\.weight")
_THEIR_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_THEIR_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
# OlmoeConfig's defaults, for a config.json that leaves a field out.
OLMOE_DEFAULTS = {"norm_topk_prob": False, "clip_qkv": None, "num_experts_per_tok": 8, "num_experts": 64}


def moe_function_fields(cfg: GPTConfig):
    """model.moe's function fields (d_ff_expert resolved), or None for a dense model."""
    if cfg.moe is None:
        return None
    return {k: cfg.d_ff_expert if k == "d_ff_expert" else getattr(cfg.moe, k) for k in MOE_FUNCTION_FIELDS}


def check_exportable(cfg: GPTConfig) -> None:
    """A DataError naming the first model key OlmoeForCausalLM cannot express, and every key a model must be trained
    with to be exported (transformers has no other mixture-of-experts class ours maps onto)."""
    moe = cfg.moe
    differ = [(key, ours, theirs) for key, ours, theirs in (
        ("model.qk_norm", cfg.qk_norm, True), ("model.qk_norm_scope", cfg.qk_norm_scope, "projection"),
        ("model.moe.first_dense_layers", moe.first_dense_layers, 0), ("model.moe.every_k", moe.every_k, 1),
        ("model.moe.num_shared_experts", moe.num_shared_experts, 0), ("model.moe.score", moe.score, "softmax"),
        ("model.moe.bias_update_rate", moe.bias_update_rate, 0.0),
        ("model.moe.capacity_factor", moe.capacity_factor, None)) if ours != theirs]
    if differ:
        key, ours, theirs = differ[0]
        fix = " ".join(f"{k}={_override(v)}" for k, _, v in differ)
        raise DataError(f"{key}={ours!r} cannot be expressed by transformers' {ARCHITECTURE} (it has {theirs!r}): "
                        "this model cannot be exported to Hugging Face format; a mixture-of-experts model exports "
                        f"as OLMoE when trained with {fix} (as model=olmoe_1b_7b is)")


def _override(value) -> str:
    """A value as a command-line override writes it (true, null, 0.0, projection)."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def to_config(llama: Dict[str, Any], cfg: GPTConfig) -> Dict[str, Any]:
    """config.json of an OlmoeForCausalLM from the Llama one llama.to_llama_config made of the same `cfg`."""
    out = {k: v for k, v in llama.items() if k not in ("mlp_bias", "pretraining_tp", "head_dim")}
    out.update({"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "intermediate_size": cfg.d_ff_expert,
                "num_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.top_k,
                "norm_topk_prob": cfg.moe.norm_topk_prob, "router_aux_loss_coef": cfg.moe.aux_loss,
                "output_router_logits": False, "clip_qkv": None})
    return out


def from_config(hf: Mapping[str, Any], fields: Dict[str, Any], refuse: Callable[[str, Any, str], DataError]):
    """Our fields of an OLMoE config.json, given the Llama-shaped `fields` read from it."""
    get = {**OLMOE_DEFAULTS, **hf}.get
    if get("clip_qkv") is not None:
        raise refuse("clip_qkv", get("clip_qkv"), "our attention does not clip q, k and v")
    return {**fields, "d_ff": None, "qk_norm": True, "qk_norm_scope": "projection",
            "moe": {"num_experts": get("num_experts"), "top_k": get("num_experts_per_tok"), "num_shared_experts": 0,
                    "d_ff_expert": hf["intermediate_size"], "first_dense_layers": 0, "every_k": 1,
                    "capacity_factor": None, "score": "softmax", "norm_topk_prob": bool(get("norm_topk_prob")),
                    "bias_update_rate": 0.0}}


def split_experts(name: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Our stacked experts' weight (E, out, in) as one hub tensor per expert; {} if `name` is not one."""
    match = _OURS_EXPERTS.fullmatch(name)
    if not match:
        return {}
    layer, proj = match.group(1), PROJECTIONS[match.group(2)]
    return {f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight": tensor[e].clone() for e in range(tensor.shape[0])}


def stack_experts(state: Mapping[str, torch.Tensor], source: str) -> Dict[str, torch.Tensor]:
    """Our stacked expert weights from the hub's per-expert tensors or transformers 5's fused ones (gate_up_proj
    (E, 2f, d): gate rows first, as `OlmoeExperts.forward` chunks them); other names are left to the caller."""
    per_expert: Dict[tuple, Dict[int, torch.Tensor]] = {}
    out = {}
    ours_of = {v: k for k, v in PROJECTIONS.items()}
    for name, tensor in state.items():
        one, fused = _THEIR_EXPERT.fullmatch(name), _THEIR_FUSED.fullmatch(name)
        if one:
            per_expert.setdefault((one.group(1), ours_of[one.group(3)]), {})[int(one.group(2))] = tensor
        elif fused and fused.group(2) == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            out[f"blocks.{fused.group(1)}.mlp.experts.w_gate.weight"] = gate.contiguous()
            out[f"blocks.{fused.group(1)}.mlp.experts.w_up.weight"] = up.contiguous()
        elif fused:
            out[f"blocks.{fused.group(1)}.mlp.experts.w_down.weight"] = tensor
    for (layer, ours), experts in per_expert.items():
        if sorted(experts) != list(range(len(experts))):
            missing = sorted(set(range(max(experts) + 1)) - set(experts))
            raise DataError(f"{source}: layer {layer} lacks experts {missing} of its {ours.replace('w_', '')} "
                            "projection: every expert's weights are needed")
        out[f"blocks.{layer}.mlp.experts.{ours}.weight"] = torch.stack([experts[e] for e in sorted(experts)])
    return out


def is_expert_name(name: str) -> bool:
    return bool(_THEIR_EXPERT.fullmatch(name) or _THEIR_FUSED.fullmatch(name))
