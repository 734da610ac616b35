"""Multi-head latent attention (model.attention=mla): DeepSeek-V2 §2.1 (DeepSeek-AI 2024), as DeepSeek-V3 keeps it.

Keys and values are not projected per head from the input but expanded from one low-rank latent c_kv
(kv_lora_rank channels, normalized) by wkv_b, and RoPE is decoupled from them: each query head has qk_rope_head_dim
extra channels turned by RoPE, which meet one rotated key k_pe that every head shares (eq. 37-47). A KV cache
then needs only c_kv and k_pe per token and layer, kv_lora_rank + qk_rope_head_dim numbers, against 2·n_kv_heads·
head_dim for grouped-query attention (table 1). The weights' layout is transformers' DeepseekV3Attention's
(q_b_proj's rows head-major [nope | rope], kv_b_proj's head-major [nope key | value], kv_a_proj_with_mqa's
[latent | rope key]), so export maps one to one (interop/deepseek.py); RoPE is the rotate-half form of the rest
of the model (transformers' rope_interleave=false).

The attention itself is the model's: the same mask function (model/mask.py `sdpa_mask`, so document masking and
the cached decoding's alignment hold), the same SDPA call (score scale 1/sqrt(qk_nope + qk_rope), DeepSeek-V3's
softmax_scale), and context parallelism's gathered attention (`context`, set from outside by parallel/context.py).
Tensor parallelism splits the heads (wq/wq_b, wkv_b, wo) and sets `enter_heads` from outside (parallel/tensor.py):
Megatron-LM's f on the shared rotated key, whose gradient each rank's heads only partly make.
"""

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.mask import CAUSAL, Mask, SdpaMask, sdpa_mask

# The epsilon of q_norm and kv_norm, whatever model.norm_eps is: DeepSeek-V3's reference model.py and transformers'
# DeepseekV3Attention build both latent norms with RMSNorm's default 1e-6 (rms_norm_eps reaches the block's norms
# only). A latent's mean square is ~1e-2 at init: 1e-5 instead would change it by ~(1e-5 - 1e-6) / (2 · 1e-2), 5e-4
# relative, far above the 1e-5 the export's logits are held to.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """Causal multi-head latent attention of x (B, T, d_model); the interface of gpt.Attention.

    build_linear, build_norm and apply_rope are model/gpt.py's (which imports this file, so passes them in): the
    same marked Linears, fp32 norms and rotate-half RoPE as the rest of the model."""

    def __init__(self, cfg: GPTConfig, build_linear, build_norm, apply_rope):
        super().__init__()
        self.apply_rope = apply_rope
        m = cfg.mla
        self.nope, self.rope, self.v_dim, self.rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, \
            m.kv_lora_rank
        spec = cfg.latent_attention_modules()
        latent = replace(cfg, norm_eps=LATENT_NORM_EPS)
        # Registered in the table's order: it is named_parameters()'s, which the planners and checkpoints read.
        if m.q_lora_rank is None:
            self.wq = build_linear(spec["attn.wq"])
        else:
            self.wq_a, self.q_norm = build_linear(spec["attn.wq_a"]), build_norm(latent, spec["attn.q_norm"])
            self.wq_b = build_linear(spec["attn.wq_b"])
        self.wkv_a, self.kv_norm = build_linear(spec["attn.wkv_a"]), build_norm(latent, spec["attn.kv_norm"])
        self.wkv_b = build_linear(spec["attn.wkv_b"])
        self.wo = build_linear(spec["attn.wo"])
        self.context = None  # context parallelism's gathered attention (parallel/context.py); None: one process's
        self.enter_heads = None  # tensor parallelism's f for the shared rotated key (parallel/tensor.py); None: as is

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(B, n_heads, T, qk_nope + qk_rope): each head's unrotated channels, then its rotated ones."""
        B, T, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))  # (B, T, H·(nope+rope))
        q = q.view(B, T, -1, self.nope + self.rope)  # -1: a tensor-parallel rank's share of the heads
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        return torch.cat([q_nope, self.apply_rope(q_pe, cos, sin)], dim=-1).transpose(1, 2)

    def latent(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """What a KV cache keeps of x (B, T, d_model): the normalized latent (B, T, kv_lora_rank) and the rotated
        key every head shares (B, T, qk_rope)."""
        c_kv, k_pe = self.wkv_a(x).split([self.rank, self.rope], dim=-1)
        k_pe = self.apply_rope(k_pe.unsqueeze(2), cos, sin).squeeze(2)  # one "head": (B, T, 1, rope) turned
        if self.enter_heads is not None:
            k_pe = self.enter_heads(k_pe)
        return self.kv_norm(c_kv), k_pe

    def keys_values(self, c_kv: torch.Tensor, k_pe: torch.Tensor):
        """Every head's keys (B, H, S, nope + rope) and values (B, H, S, v_head_dim) from the latent (B, S, rank)
        and the shared rotated key (B, S, rope)."""
        B, S, _ = c_kv.shape
        kv = self.wkv_b(c_kv).view(B, S, -1, self.nope + self.v_dim)  # (B, S, H, nope + v)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, k_nope.shape[2], -1)], dim=-1)  # (B, S, H, nope+rope)
        return k.transpose(1, 2), v.transpose(1, 2)

    def _rows(self, cos: torch.Tensor, sin: torch.Tensor, T: int):
        return (cos[:T], sin[:T]) if cos.dim() == 2 else (cos, sin)  # (B, T, rope) tables are the rows' own

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model); cos, sin over qk_rope_head_dim; mask as gpt.Attention.forward's."""
        B, T, _ = x.shape
        cos, sin = self._rows(cos, sin, T)
        q = self.queries(x, cos, sin)  # (B, H, T, nope + rope)
        k, v = self.keys_values(*self.latent(x, cos, sin))  # (B, H, T, nope + rope), (B, H, T, v_head_dim)
        if self.context is not None:  # the values padded to the queries' width there too (`_sdpa` says why)
            y = self.context(q, k, _pad(v, q.shape[-1]), mask)[..., :self.v_dim]  # (B, H, T, v_head_dim)
        else:
            sdpa = sdpa_mask(CAUSAL, T, T, q) if mask is None else SdpaMask(mask, False)
            y = _sdpa(q, k, v, sdpa)  # (B, H, T, v_head_dim)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, layer: int) -> torch.Tensor:
        """`forward` for tokens at positions [cache.length, cache.length + T): the cache holds each position's
        latent and rotated key (not its heads' keys and values), expanded again for the attention."""
        B, T, _ = x.shape
        cos, sin = self._rows(cos, sin, T)
        q = self.queries(x, cos, sin)  # (B, H, T, nope + rope)
        c_kv, k_pe = self.latent(x, cos, sin)
        c_kv, k_pe = cache.append(layer, c_kv.unsqueeze(1), k_pe.unsqueeze(1))  # (B, 1, S, rank), (B, 1, S, rope)
        k, v = self.keys_values(c_kv.squeeze(1), k_pe.squeeze(1))  # (B, H, S, ...)
        y = _sdpa(q, k, v, sdpa_mask(Mask(queries=cache.length), T, k.shape[2], q))  # (B, H, T, v_head_dim)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: SdpaMask) -> torch.Tensor:
    """softmax(q·kᵀ / sqrt(qk_nope + qk_rope)) v, every head its own key and value (no grouping): gpt.attend's call.
    Values narrower than the queries are zero-padded to their width and the output cut back (as transformers does
    for flash attention): SDPA's fused CPU kernel takes equal widths only, and its math fallback keeps the B·H·T²
    probabilities for backward (measured: 131,072 of a block's 422,912 saved elements at T 64, growing with T²)."""
    width = v.shape[-1]
    y = F.scaled_dot_product_attention(q, k, _pad(v, q.shape[-1]), attn_mask=mask.attn_mask, is_causal=mask.is_causal)
    return y[..., :width]


def _pad(v: torch.Tensor, width: int) -> torch.Tensor:
    """v (B, H, S, v_head_dim) with zero columns up to `width` (zero columns of v give zero columns of the output)."""
    return F.pad(v, (0, width - v.shape[-1])) if v.shape[-1] < width else v
