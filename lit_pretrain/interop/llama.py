"""Our GPT in Hugging Face Llama's terms, and back: the config fields and the weight names, as plain data.

No file I/O and no transformers here (interop/hf.py reads and writes the folders), so the mapping is one place
to read. The two models compute the same function, which tests/interop/test_hf.py checks against transformers'
`LlamaForCausalLM` itself; what makes them the same, line by line of transformers' modeling_llama.py:
- RMSNorm: x * rsqrt(mean(x²) + eps) * weight in both (`LlamaRMSNorm` computes in fp32 and casts back; our
  nn.RMSNorm runs in the activation dtype, so in fp32 they agree). model.norm_eps <-> rms_norm_eps.
- RoPE: both use the rotate-half layout (channel i paired with i + head_dim/2, `rotate_half`) with inverse
  frequencies theta^(-2i/head_dim) over the whole head, so wq and wk need no permutation (Meta's original
  interleaved checkpoints do; transformers' convert_llama_weights_to_hf.py permutes them once into this layout).
  model.rope_theta <-> rope_theta (rope_parameters.rope_theta in transformers 5); model.rope_scaling <-> rope type
  "llama3" or "yarn" with their parameters (original_seq_len <-> original_max_position_embeddings): the same
  inverse frequencies and cos/sin multiplier to the bit (lit_pretrain/model/rope.py), null <-> "default".
- Attention: softmax(q·kᵀ / sqrt(head_dim)) causal, no bias: scaled_dot_product_attention's default scale is
  head_dim**-0.5, as `LlamaAttention.scaling`. Grouped-query attention: model.n_kv_heads <-> num_key_value_heads
  (`repeat_kv` gives query head h the key/value head h // (n_heads / n_kv_heads), as SDPA's enable_gqa does).
- MLP: down(silu(gate(x)) * up(x)), hidden_act "silu", no bias; d_ff (model.hidden_dim) <-> intermediate_size.
- Embeddings: tied or not (model.tie_embeddings <-> tie_word_embeddings); a tied head is stored once, as
  transformers does.
- QK-norm (model.qk_norm): exported as `Qwen3ForCausalLM`, which is this Llama plus per-head RMSNorms of q and k
  over head_dim (`Qwen3Attention.q_norm`/`k_norm`, eps rms_norm_eps) before RoPE, as ours.
- Sliding windows (model.sliding_window and its pattern): transformers' sliding_window counts the query's own key
  as ours does (masking_utils `sliding_window_overlay`: kv_idx > q_idx - sliding_window) and its layer_types say
  which layers use it ("sliding_attention" | "full_attention", `GPTConfig.attention_window`). With model.qk_norm:
  Qwen3ForCausalLM with use_sliding_window; without: `MinistralForCausalLM`, this Llama with sliding_window and
  layer_types (Ministral, transformers 5); with model.moe refused (OLMoE has no window).
- model.moe: exported as `OlmoeForCausalLM` (lit_pretrain/interop/olmoe.py says what makes it the same function).
- model.attention_gate=elementwise with the per-head QK-norm: exported as `Qwen3NextForCausalLM`, export only
  (lit_pretrain/interop/qwen3_next.py says what makes it the same function).
- model.attention=mla: exported as a dense `DeepseekV3ForCausalLM` (lit_pretrain/interop/deepseek.py).
What neither can express is refused, naming it: on export model.logit_softcap, model.norm=layernorm,
model.mlp=gelu, model.attention_sinks, a gate Qwen3-Next does not have and a sliding window beside experts or a gate
(`check_exportable`; Gemma 2 has a soft-cap but differs from our block elsewhere: embeddings scaled by sqrt(d), norms
around each sublayer); on import a bias, RoPE scaled other than llama3 or yarn (linear, dynamic, longrope; yarn with
truncate=false or a partial rotary factor), another activation.
"""

import math
import re
from dataclasses import replace
from typing import Any, Dict, Mapping, Optional, Tuple

from lit_pretrain.errors import DataError
from lit_pretrain.interop import deepseek, olmoe, qwen3_next
from lit_pretrain.model.config import GPTConfig, RopeScalingConfig

ARCHITECTURE = "LlamaForCausalLM"
QK_NORM_ARCHITECTURE = "Qwen3ForCausalLM"  # Llama + per-head QK-norm (model.qk_norm)
WINDOW_ARCHITECTURE = "MinistralForCausalLM"  # Llama + sliding_window on the layers layer_types names
MODEL_TYPES = {ARCHITECTURE: "llama", QK_NORM_ARCHITECTURE: "qwen3", olmoe.ARCHITECTURE: olmoe.MODEL_TYPE,
               deepseek.ARCHITECTURE: deepseek.MODEL_TYPE, WINDOW_ARCHITECTURE: "ministral"}
# model.layer_types' entries <-> transformers' layer_types'
HF_LAYER_TYPES = {"sliding": "sliding_attention", "full": "full_attention"}

# Our names (model/gpt.py) -> Llama's (transformers' LlamaForCausalLM). {i} is the block index.
GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",  # Qwen3 only (model.qk_norm)
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",  # OLMoE only (model.moe); its experts: olmoe.split_experts
}
_OURS_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_LLAMA_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")
_LLAMA_OF_BLOCK = {v: k for k, v in BLOCK_NAMES.items()}
_LLAMA_OF_BLOCK.update({v: k for k, v in deepseek.BLOCK_NAMES.items() if v not in _LLAMA_OF_BLOCK})  # latent attention
_OURS_OF_GLOBAL = {v: k for k, v in GLOBAL_NAMES.items()}

# The GPTConfig fields that decide what function a set of weights computes (seq_len does not: it is only how many
# positions the RoPE tables cover; init_std does not either).
FUNCTION_FIELDS = ("vocab_size", "n_layers", "d_model", "n_heads", "d_ff", "tie_embeddings", "rope_theta", "norm_eps",
                   "n_kv_heads", "qk_norm", "logit_softcap", "norm", "mlp", "qk_norm_scope", "moe", "rope_scaling",
                   "attention", "mla", "attention_sinks", "attention_gate", "sliding_window", "layer_types")
# The architecture variants, at the values a Llama (and a weights file written before them) has.
VARIANT_DEFAULTS = {"n_kv_heads": None, "qk_norm": False, "logit_softcap": None, "norm": "rmsnorm", "mlp": "swiglu",
                    "qk_norm_scope": "head", "moe": None, "rope_scaling": None, "attention": "mha", "mla": None,
                    "attention_sinks": False, "attention_gate": None, "sliding_window": None, "layer_types": None}
# model.rope_scaling's fields each type computes with (the others are unused by it).
ROPE_FIELDS = {"llama3": ("type", "factor", "original_seq_len", "low_freq_factor", "high_freq_factor"),
               "yarn": ("type", "factor", "original_seq_len", "beta_fast", "beta_slow", "attention_factor")}

# transformers' LlamaConfig defaults, for a config.json that leaves a field out (transformers writes them all).
LLAMA_DEFAULTS = {"num_key_value_heads": None, "head_dim": None, "hidden_act": "silu", "rms_norm_eps": 1e-6,
                  "tie_word_embeddings": False, "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False,
                  "rope_scaling": None, "max_position_embeddings": 2048}


def function_fields(cfg: GPTConfig) -> Dict[str, Any]:
    """The fields of `cfg` that the weights' function depends on; d_ff resolved (null means 8/3 · d_model),
    n_kv_heads null when it equals n_heads (the same function)."""
    out = {name: cfg.hidden_dim if name == "d_ff" else getattr(cfg, name) for name in FUNCTION_FIELDS}
    out["n_kv_heads"] = None if cfg.kv_heads == cfg.n_heads else cfg.kv_heads
    out["moe"] = olmoe.moe_function_fields(cfg)
    out["rope_scaling"] = rope_function_fields(cfg)
    out["mla"] = deepseek.mla_function_fields(cfg)
    if cfg.moe is not None and len(cfg.moe_layers()) == cfg.n_layers:
        out["d_ff"] = None  # no dense MLP anywhere: its width computes nothing
    out["layer_types"] = window_layer_types(cfg)
    return out


def window_layer_types(cfg: GPTConfig) -> Optional[list]:
    """model.layer_types as one list whichever key said it (model.global_attention_every names the same layers):
    None where every layer is local (model.sliding_window alone) or there is no window."""
    types = ["full" if cfg.attention_window(i) is None else "sliding" for i in range(cfg.n_layers)]
    return None if cfg.sliding_window is None or "full" not in types else types


def rope_function_fields(cfg: GPTConfig) -> Optional[Dict[str, Any]]:
    """model.rope_scaling's fields its type computes with, or None (unscaled)."""
    rope = cfg.rope_scaling
    if rope is None:
        return None
    if isinstance(rope, Mapping):
        rope = RopeScalingConfig(**rope)
    return {key: getattr(rope, key) for key in ROPE_FIELDS[rope.type]}


def rope_parameters(cfg: GPTConfig) -> Dict[str, Any]:
    """transformers' rope_parameters (5.x; rope_scaling in 4.x, without rope_theta) of model.rope_theta and
    model.rope_scaling."""
    rope = rope_function_fields(cfg)
    if rope is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out = {"rope_type": rope.pop("type"), "rope_theta": cfg.rope_theta,
           "original_max_position_embeddings": rope.pop("original_seq_len"), **rope}
    if out.get("attention_factor", 0.0) is None:
        del out["attention_factor"]  # transformers derives it from factor, as we do
    return out


def rope_scaling_of(hf_rope: Mapping[str, Any], max_positions: int, refuse, where: str = "rope_parameters"
                    ) -> Optional[Dict[str, Any]]:
    """model.rope_scaling of transformers' rope_parameters (or 4.x rope_scaling: `where`), as
    `_compute_llama3_parameters` and `_compute_yarn_parameters` read it (their defaults included); None for
    "default"."""
    kind = hf_rope.get("rope_type", hf_rope.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_FIELDS:
        raise refuse(f"{where}.rope_type", kind, "our RoPE is unscaled, llama3 or yarn")
    if hf_rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(f"{where}.partial_rotary_factor", hf_rope["partial_rotary_factor"],
                     "our RoPE turns the whole head")
    original = hf_rope.get("original_max_position_embeddings") or max_positions
    out = {"type": kind, "original_seq_len": int(original)}
    if kind == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if not isinstance(hf_rope.get(key), (int, float)):
                raise refuse(f"{where}.{key}", hf_rope.get(key), "Llama 3.1's scaling needs it")
            out[key] = float(hf_rope[key])
        return out
    if hf_rope.get("truncate", True) is not True:
        raise refuse(f"{where}.truncate", hf_rope["truncate"], "our YaRN floors and ceils its ramp's bounds")
    factor = hf_rope.get("factor") or max_positions / original  # transformers' fallback (DeepSeek-V3's configs)
    attention = hf_rope.get("attention_factor")
    mscale, mscale_all_dim = hf_rope.get("mscale"), hf_rope.get("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:  # transformers' ratio of two yarn_get_mscale values
        attention = (0.1 * mscale * math.log(factor) + 1.0) / (0.1 * mscale_all_dim * math.log(factor) + 1.0) \
            if factor > 1 else 1.0
    return {**out, "factor": float(factor), "beta_fast": float(hf_rope.get("beta_fast") or 32),
            "beta_slow": float(hf_rope.get("beta_slow") or 1),
            "attention_factor": None if attention is None else float(attention)}


def architecture(cfg: GPTConfig) -> str:
    if cfg.attention == "mla":
        return deepseek.ARCHITECTURE
    if cfg.attention_gate is not None:
        return qwen3_next.ARCHITECTURE
    if cfg.moe is not None:
        return olmoe.ARCHITECTURE
    if cfg.qk_norm:
        return QK_NORM_ARCHITECTURE
    return ARCHITECTURE if cfg.sliding_window is None else WINDOW_ARCHITECTURE


def check_exportable(cfg: GPTConfig) -> None:
    """A DataError naming the first model key neither LlamaForCausalLM nor Qwen3ForCausalLM can express (exporting
    without it would compute another function)."""
    if cfg.attention == "mla":  # DeepseekV3ForCausalLM, dense (interop/deepseek.py)
        deepseek.check_exportable(cfg)
    if cfg.attention_sinks:
        # GptOssForCausalLM's attention has the same sinks, but only inside its own block: biased q/k/v/o projections
        # and a mixture of experts with biases and a clamped SwiGLU (swiglu_limit, alpha 1.702), which ours is not.
        raise DataError("model.attention_sinks=true cannot be expressed by transformers' Llama, Qwen3 or OLMoE (only "
                        "GptOssForCausalLM has sinks, in a block of biased projections and clamped-SwiGLU experts "
                        "ours is not): this model cannot be exported to Hugging Face format")
    if cfg.attention_gate is not None and cfg.sliding_window is not None:
        raise DataError(f"model.sliding_window={cfg.sliding_window} with model.attention_gate cannot be expressed by "
                        f"transformers' {qwen3_next.ARCHITECTURE} (its attention layers have no sliding window): this "
                        "model cannot be exported to Hugging Face format")
    if cfg.attention_gate is not None:  # Qwen3NextForCausalLM: the elementwise gate with per-head QK-norm
        qwen3_next.check_exportable(cfg)
    if cfg.moe is not None and cfg.sliding_window is not None:
        raise DataError(f"model.sliding_window={cfg.sliding_window} with model.moe cannot be expressed by "
                        f"transformers' {olmoe.ARCHITECTURE} (it has no sliding window): this model cannot be exported "
                        "to Hugging Face format")
    if cfg.moe is not None:
        olmoe.check_exportable(cfg)
    elif cfg.qk_norm and cfg.qk_norm_scope != "head":
        raise DataError(f"model.qk_norm_scope={cfg.qk_norm_scope!r} cannot be expressed by transformers' "
                        f"{QK_NORM_ARCHITECTURE} (its q/k norms are per head): this model cannot be exported to "
                        "Hugging Face format")
    for key, ours, llama in (("logit_softcap", cfg.logit_softcap, None), ("norm", cfg.norm, "rmsnorm"),
                             ("mlp", cfg.mlp, "swiglu")):
        if ours != llama:
            raise DataError(f"model.{key}={ours!r} cannot be expressed by transformers' {architecture(cfg)} (it has "
                            f"{key}={llama!r}): this model cannot be exported to Hugging Face format")
    if cfg.init == "mup" and cfg.mup_base_width != cfg.d_model:
        # μP multiplies the logits by mup_base_width / d_model (lit_pretrain/model/init.py): a forward multiplier that
        # neither class has, so the exported weights would compute other logits.
        raise DataError(f"model.init=mup with model.mup_base_width={cfg.mup_base_width} != d_model={cfg.d_model} "
                        f"multiplies the logits by {cfg.mup_base_width / cfg.d_model:g}, which transformers' "
                        f"{architecture(cfg)} cannot express: this model cannot be exported to Hugging Face format")


def to_llama_config(cfg: GPTConfig, eod_id: int, dtype: str) -> Dict[str, Any]:
    """config.json of a LlamaForCausalLM (Qwen3ForCausalLM with model.qk_norm) computing what `cfg`'s GPT computes
    (read by transformers 4.45 to 5.x; Qwen3 from 4.51); OlmoeForCausalLM with model.moe; DeepseekV3ForCausalLM
    with model.attention=mla; Qwen3NextForCausalLM with model.attention_gate."""
    if cfg.attention == "mla":
        return deepseek.to_config(to_llama_config(replace(cfg, attention="mha", mla=None), eod_id, dtype), cfg)
    if cfg.attention_gate is not None:
        return qwen3_next.to_config(to_llama_config(replace(cfg, attention_gate=None), eod_id, dtype), cfg)
    if cfg.moe is not None:
        return olmoe.to_config(to_llama_config(replace(cfg, moe=None, qk_norm=False), eod_id, dtype), cfg)
    arch = architecture(cfg)
    layer_types = [HF_LAYER_TYPES["full" if cfg.attention_window(i) is None else "sliding"]
                   for i in range(cfg.n_layers)]
    windows = {"sliding_window": cfg.sliding_window, "layer_types": layer_types}
    if cfg.qk_norm:  # Qwen3 reads sliding_window only with use_sliding_window; layer_types name the layers
        windows = {"use_sliding_window": cfg.sliding_window is not None, "max_window_layers": cfg.n_layers, **windows}
    return {
        "architectures": [arch],
        "model_type": MODEL_TYPES[arch],
        **(windows if arch != ARCHITECTURE else {}),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,  # = num_attention_heads: multi-head attention
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 4.x reads rope_theta and rope_scaling; 5.x reads rope_parameters (and folds rope_theta in).
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else
        {k: v for k, v in rope_parameters(cfg).items() if k != "rope_theta"},
        "rope_parameters": rope_parameters(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": cfg.init_std,
        # Our documents are separated by one end-of-document token and nothing else: it ends a text and, as in
        # GPT-2, is the only candidate for a beginning-of-text token. Llama's defaults (1, 2) would be wrong ids.
        "bos_token_id": eod_id,
        "eos_token_id": eod_id,
        "pad_token_id": None,
        "dtype": dtype,  # transformers 5; 4.x reads torch_dtype
        "torch_dtype": dtype,
        "use_cache": True,
    }


def from_llama_config(hf: Mapping[str, Any], source: str) -> Dict[str, Any]:
    """GPTConfig field values (and seq_len) of a Llama config.json; a DataError names a field we can't express."""
    arch = hf.get("architectures")
    known = [a for a, t in MODEL_TYPES.items() if ([a] == list(arch) if arch else hf.get("model_type") == t)]
    if not known:
        found = f"architectures {list(arch)}" if arch else f"model_type {hf.get('model_type')!r}"
        raise DataError(f"{source}: {found} is not [{ARCHITECTURE!r}], [{QK_NORM_ARCHITECTURE!r}], "
                        f"[{WINDOW_ARCHITECTURE!r}] or [{olmoe.ARCHITECTURE!r}]: import reads Llama-shaped models only")
    qk_norm = known[0] == QK_NORM_ARCHITECTURE
    if known[0] == deepseek.ARCHITECTURE:  # its head_dim is the rotated channels' (qk_rope_head_dim)
        hf = {k: v for k, v in hf.items() if k != "head_dim"}
    get = {**LLAMA_DEFAULTS, **hf}.get
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool):
            raise DataError(f"{source}: {key} is missing or not an integer")
    d_model, n_heads = hf["hidden_size"], hf["num_attention_heads"]

    def refuse(key: str, value: Any, why: str) -> DataError:
        return DataError(f"{source}: {key}={value!r} cannot be expressed by lit_pretrain's GPT ({why})")

    kv = get("num_key_value_heads")
    if kv is not None and (not isinstance(kv, int) or kv < 1 or n_heads % kv):
        raise refuse("num_key_value_heads", kv, f"key/value heads must divide num_attention_heads={n_heads}")
    if d_model % n_heads or get("head_dim") not in (None, d_model // n_heads):
        raise refuse("head_dim", get("head_dim"), f"we need hidden_size / num_attention_heads = {d_model / n_heads}")
    if get("hidden_act") not in ("silu", "swish"):
        raise refuse("hidden_act", get("hidden_act"), "our MLP is SwiGLU: silu")
    for key in ("attention_bias", "mlp_bias"):
        if get(key):
            raise refuse(key, get(key), "our linear layers have no bias")
    sliding_window, layer_types = windows_of(hf, known[0], refuse)
    # transformers 5 writes rope_parameters (rope_theta inside); 4.x rope_scaling beside rope_theta, and 5.x reads
    # a rope_scaling first when both are there (`convert_rope_params_to_dict`).
    rope = dict(get("rope_scaling") or hf.get("rope_parameters") or {})
    rope_scaling = rope_scaling_of(rope, get("max_position_embeddings"), refuse,
                                   "rope_scaling" if get("rope_scaling") else "rope_parameters")
    rope = {**(hf.get("rope_parameters") or {}), **rope}
    fields = {
        "vocab_size": hf["vocab_size"],
        "n_layers": hf["num_hidden_layers"],
        "d_model": d_model,
        "n_heads": n_heads,
        "d_ff": hf["intermediate_size"],
        "tie_embeddings": bool(get("tie_word_embeddings")),
        "rope_theta": float(rope.get("rope_theta", get("rope_theta"))),
        "norm_eps": float(get("rms_norm_eps")),
        "seq_len": get("max_position_embeddings"),
        **VARIANT_DEFAULTS,
        "n_kv_heads": None if kv in (None, n_heads) else kv,
        "qk_norm": qk_norm,
        "rope_scaling": rope_scaling,
        "sliding_window": sliding_window,
        "layer_types": layer_types,
    }
    if known[0] == deepseek.ARCHITECTURE:
        return deepseek.from_config(hf, fields, refuse)
    return olmoe.from_config(hf, fields, refuse) if known[0] == olmoe.ARCHITECTURE else fields


def windows_of(hf: Mapping[str, Any], arch: str, refuse) -> Tuple[Optional[int], Optional[list]]:
    """(model.sliding_window, model.layer_types) of a config.json: Qwen3's with use_sliding_window, Ministral's;
    layer_types null where every layer is local (`window_layer_types`); (None, None) without a window."""
    window = hf.get("sliding_window")
    if arch == QK_NORM_ARCHITECTURE and not hf.get("use_sliding_window"):
        window = None  # what Qwen3Config does with it
    if arch not in (QK_NORM_ARCHITECTURE, WINDOW_ARCHITECTURE) or window is None:
        return None, None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise refuse("sliding_window", window, "a window is a positive number of tokens")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None and arch == QK_NORM_ARCHITECTURE:  # Qwen3Config's default: local from max_window_layers on
        types = ["sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention" for i in range(n)]
    if types is None:  # Ministral's default: every layer local
        return window, None
    ours = {v: k for k, v in HF_LAYER_TYPES.items()}
    if not isinstance(types, list) or len(types) != n or any(t not in ours for t in types):
        raise refuse("layer_types", types, f"we read {n} entries of sliding_attention | full_attention")
    if "sliding_attention" not in types:
        return None, None
    return window, None if "full_attention" not in types else [ours[t] for t in types]


def to_llama_names(state: Mapping[str, Any], tied: bool, block_names: Mapping[str, str] = BLOCK_NAMES
                   ) -> Dict[str, Any]:
    """Our GPT's state dict under Llama's names; a tied head is left out (transformers ties it on load).

    A key with no Llama counterpart (a bias, another norm's parameter) is a DataError naming it: exporting without
    it would silently compute another function.
    """
    out = {}
    for name, tensor in state.items():
        if tied and name == "lm_head.weight":
            continue
        block = _OURS_BLOCK.fullmatch(name)
        experts = olmoe.split_experts(name, tensor)
        if experts:  # model.moe: one tensor per expert, as OLMoE's checkpoints hold them
            out.update(experts)
        elif name in GLOBAL_NAMES:
            out[GLOBAL_NAMES[name]] = tensor
        elif block and block.group(2) in block_names:  # deepseek.BLOCK_NAMES under latent attention
            out[f"model.layers.{block.group(1)}.{block_names[block.group(2)]}"] = tensor
        else:
            raise DataError(f"weight {name!r} has no counterpart in transformers' Llama (which has no biases and only "
                            "RMSNorm weights): this model cannot be exported as LlamaForCausalLM or Qwen3ForCausalLM")
    return out


def to_export_names(state: Mapping[str, Any], cfg: GPTConfig) -> Dict[str, Any]:
    """Our GPT's state dict under the names (and, for Qwen3-Next, the layout) of `architecture(cfg)`."""
    if cfg.attention == "mla":
        return to_llama_names(state, cfg.tie_embeddings, deepseek.BLOCK_NAMES)
    if cfg.attention_gate is None:
        return to_llama_names(state, cfg.tie_embeddings)
    gates = {int(m.group(1)): t for name, t in state.items()
             if (m := _OURS_BLOCK.fullmatch(name)) and m.group(2) == "attn.wg.weight"}
    rest = {name: t for name, t in state.items() if not name.endswith(".attn.wg.weight")}
    return qwen3_next.to_names(to_llama_names(rest, cfg.tie_embeddings), gates, cfg)


def from_llama_names(state: Mapping[str, Any], tied: bool, source: str) -> Tuple[Dict[str, Any], list]:
    """(our state dict, Llama names we skipped) of Llama weights; an unknown weight is a DataError naming it.

    Skipped: a stored lm_head when the embeddings are tied (transformers uses the embedding there too) and the
    RoPE inverse frequencies old transformers versions saved (we derive them from rope_theta).
    """
    out, skipped = olmoe.stack_experts(state, source), []  # OLMoE's experts, stacked; {} for a dense model
    for name, tensor in state.items():
        block = _LLAMA_BLOCK.fullmatch(name)
        if olmoe.is_expert_name(name):
            continue
        if (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
            skipped.append(name)
        elif name in _OURS_OF_GLOBAL:
            out[_OURS_OF_GLOBAL[name]] = tensor
        elif block and block.group(2) in _LLAMA_OF_BLOCK:
            out[f"blocks.{block.group(1)}.{_LLAMA_OF_BLOCK[block.group(2)]}"] = tensor
        else:
            raise DataError(f"{source}: weight {name!r} has no counterpart in lit_pretrain's GPT (no biases, "
                            "RMSNorm only): this model cannot be imported")
    return out, skipped
