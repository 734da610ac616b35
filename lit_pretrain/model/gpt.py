"""A decoder-only GPT as a plain `nn.Module`: pre-norm RMSNorm blocks, RoPE, causal attention, SwiGLU MLP, and the
variants of `GPTConfig` (grouped-query attention, QK-norm, logit soft-capping, LayerNorm, GELU MLP).

Knows nothing of Lightning or distribution: tensor parallelism, activation checkpointing and FSDP wrap it from
outside. Every module is built from the architecture table (`GPTConfig.block_modules`), and each nn.Linear (and
the embedding) carries its roles as attributes, `tensor_parallel` ("column" | "row" | "vocab" | None) and
`residual_projection` (bool), which the initializer and the tensor-parallel plan read instead of lists of names.
Names (`blocks.{i}.attn.wq`, ...) are still the checkpoint interface. Layout follows LLaMA (Touvron et al. 2023);
readable in one sitting like nanoGPT.
"""


import torch
import torch.nn.functional as F
from torch import nn

from lit_pretrain.model.config import GPTConfig, ModuleSpec, RopeScalingConfig, flops_per_token_formula  # noqa: F401

# flops_per_token_formula lives with the config (pure arithmetic, no torch) and is re-exported here.
from lit_pretrain.model.init import initialize
from lit_pretrain.model.mask import Mask, SdpaMask, sdpa_mask, with_sinks
from lit_pretrain.model.mla import LatentAttention
from lit_pretrain.model.moe import MoE
from lit_pretrain.model.mtp import MTPModule
from lit_pretrain.model.rope import inverse_frequencies


def build_linear(spec: ModuleSpec) -> nn.Linear:
    """A bias-free nn.Linear of the table's (out, in) shape, marked with its roles."""
    out_features, in_features = spec.shape
    linear = nn.Linear(in_features, out_features, bias=False)
    linear.tensor_parallel = spec.tensor_parallel
    linear.residual_projection = spec.residual_projection
    return linear


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm computed in fp32 and cast back to the input's dtype, as OLMo-core's RMSNorm and HF's LlamaRMSNorm
    do: with bf16 activations and weights (FSDP2's mixed-precision policy, bf16-true) the mean of squares and the
    weight's product are not rounded to 8 bits. An fp32 input and weight run exactly as nn.RMSNorm (no copies)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x.float(), self.normalized_shape, self.weight.float(), self.eps).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """Bias-free nn.LayerNorm computed in fp32 and cast back (see RMSNorm). Also what lets a bf16 weight meet an fp32
    input: layer_norm refuses mixed dtypes ("expected scalar type")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            weight = self.weight.float() if self.weight is not None else None
            return F.layer_norm(x.float(), self.normalized_shape, weight, None, self.eps).to(x.dtype)


def build_norm(cfg: GPTConfig, spec: ModuleSpec) -> nn.Module:
    """RMSNorm or bias-free LayerNorm over the table's width, in fp32; `tensor_parallel` marks a partial gradient."""
    if cfg.norm == "layernorm":
        norm = LayerNorm(spec.shape[0], eps=cfg.norm_eps, bias=False)
    else:
        norm = RMSNorm(spec.shape[0], eps=cfg.norm_eps)
    norm.tensor_parallel = spec.tensor_parallel
    return norm


class AttentionSinks(nn.Module):
    """model.attention_sinks: one learned logit per query head (weight (n_heads,), this rank's heads under tensor
    parallelism), joined to every softmax by the mask (model/mask.py `with_sinks`). Starts at 0 (model/init.py)."""

    sink = True  # read by the initializer and the optimizer's parameter kinds

    def __init__(self, spec: ModuleSpec):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(spec.shape))
        self.tensor_parallel = spec.tensor_parallel


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap · tanh(logits / cap) (Gemma 2, Gemma Team 2024 §2): ≈ logits where |logits| << cap, bounded by ±cap.
    None: unchanged."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


def rope_tables(head_dim: int, seq_len: int, theta: float, device: torch.device | None = None,
                scaling: RopeScalingConfig | None = None):
    """cos and sin tables of RoPE (Su et al. 2021, eq. 34), each (seq_len, head_dim), in fp32; scaled by
    model.rope_scaling (lit_pretrain/model/rope.py: Llama 3.1's rule or YaRN, whose cos and sin carry its attention
    factor, as transformers' rotary embedding multiplies them).

    Rotate-half layout (GPT-NeoX, Hugging Face LLaMA): channel i is paired with channel i + head_dim/2, not with
    its neighbour as in the paper's interleaved form; both are the same rotation up to a fixed channel permutation
    of wq and wk. fp32 because the angles reach seq_len radians: near 1000 rad bf16's spacing is 4 rad.
    """
    inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling, device)  # (Q/2,)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)  # (T,)
    angles = torch.outer(positions, inv_freq)  # (T, Q/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, Q): both halves of a pair turn by the same angle
    if attention_factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, n_heads, head_dim) by the angles of its positions; cos, sin are (T, head_dim), or
    (B, T, head_dim) when each row has its own positions (document masking restarts them per document)."""
    # Rotation done in fp32 (as Meta's LLaMA reference does) so bf16 activations don't round the angles.
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)  # (B, T, n_heads, head_dim/2) each
    rotated = torch.cat([-x2, x1], dim=-1)  # (B, T, n_heads, head_dim)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (T, 1, head_dim) or (B, T, 1, head_dim): over heads
    return (xf * cos + rotated * sin).type_as(x)


def document_ids(idx: torch.Tensor, eod_id: int) -> torch.Tensor:
    """The document of each token of idx (B, T), numbered from 0 in each row: the token after an eod_id starts a new
    document, so an EOD belongs to the document it ends (Megatron-LM's reset_attention_mask and torchtitan's
    get_document_mask_mod count the same way). Returns (B, T) int64."""
    ends = (idx == eod_id).long()  # (B, T)
    return ends.cumsum(1) - ends  # (B, T): EODs strictly before each token


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document (0 at the document's first token in the window); doc_ids (B, T)
    non-decreasing along T, as `document_ids` returns. Returns (B, T) int64."""
    T = doc_ids.shape[1]
    t = torch.arange(T, device=doc_ids.device)  # (T,)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)  # (B, T)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, t, 0).cummax(dim=1).values  # (B, T): index of the document's first token
    return t - first


def document_mask(doc_ids: torch.Tensor, queries: torch.Tensor | None = None,
                  window: int | None = None) -> torch.Tensor:
    """Block-diagonal causal mask of doc_ids (B, T): True where query i may look at key j (j <= i, same document).
    Returns (B, 1, T, T) bool, broadcast over heads (so it also serves a tensor-parallel rank's share of them).
    queries: (Tq,) the positions of the queries when they are only some of the T (context parallelism computes
    part of the sequence's queries over all its keys): their rows, (B, 1, Tq, T). window: also inside a sliding
    window of that many keys (model.sliding_window). Made by `sdpa_mask` (model/mask.py)."""
    T = doc_ids.shape[1]
    n_queries = T if queries is None else queries.shape[0]
    return sdpa_mask(Mask(doc_ids, 0 if queries is None else queries, window), n_queries, T, doc_ids).attn_mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           is_causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ/sqrt(head_dim)) v for q (B, H, T, Q) and k, v (B, KV, S, Q), KV dividing H: query head h reads
    key/value head h // (H / KV) (grouped-query attention; KV = H is multi-head attention, bit for bit the same
    call). SDPA's enable_gqa, not k.repeat_interleave: see README's measurement (no copy of k and v).
    sinks: (H,) logits (model.attention_sinks) joining each query's softmax as a zero key with a zero value."""
    if sinks is not None:
        mask = with_sinks(SdpaMask(mask, is_causal), sinks, q.shape[2], k.shape[2], q)  # (B or 1, H, T, S + 1)
        k, v, is_causal = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1)), False  # (B, KV, S + 1, Q): key S is 0
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)


class Attention(nn.Module):
    """Causal self-attention with RoPE on q and k; n_kv_heads key/value heads (grouped-query when fewer than
    n_heads), optional QK-norm."""

    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.head_dim, self.qk_norm_scope = cfg.head_dim, cfg.qk_norm_scope
        # model.sliding_window on this layer (GPTConfig.attention_window), or None: the mask's window term
        self.window = cfg.attention_window(layer)
        spec = cfg.block_modules()
        # Separate q/k/v (not one fused wqkv) so tensor parallelism can shard each column-wise by whole heads.
        self.wq, self.wk, self.wv = (build_linear(spec[f"attn.{n}"]) for n in ("wq", "wk", "wv"))
        if cfg.qk_norm:
            self.q_norm, self.k_norm = build_norm(cfg, spec["attn.q_norm"]), build_norm(cfg, spec["attn.k_norm"])
        else:
            self.q_norm = self.k_norm = None
        self.wo = build_linear(spec["attn.wo"])
        # model.attention_gate: sigmoid(x W_g) over each head (headwise) or channel (elementwise) of the output
        self.wg = build_linear(spec["attn.wg"]) if "attn.wg" in spec else None
        self.sinks = AttentionSinks(spec["attn.sinks"]) if "attn.sinks" in spec else None  # model.attention_sinks
        # Context parallelism (lit_pretrain/parallel/context.py) sets this from outside: a callable (q, k, v, mask,
        # sinks) -> y that attends this rank's queries over the whole sequence's keys and values. None: one process's.
        self.context = None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries (B, n_heads, T, head_dim), keys and values (B, n_kv_heads, T, head_dim) of x (B, T, d_model),
        QK-norm then RoPE on q and k. cos, sin hold x's positions from its first; they may run past T (their first
        T rows are used), so a caller that does not know how long x will be here can pass the whole tables."""
        B, T, _ = x.shape
        if cos.dim() == 2:  # (B, T, head_dim) tables (document masking) are the rows' own already
            cos, sin = cos[:T], sin[:T]  # (T, head_dim)
        # -1 heads, not cfg.n_heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, n_heads, head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        if self.q_norm is not None and self.qk_norm_scope == "projection":  # over the projections (OLMoE)
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        elif self.q_norm is not None:  # per head, over head_dim, before RoPE (Qwen3, OLMo 2 per-head variant)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: None for plain causal attention (within this layer's sliding window, if it has one), or the
        (B, 1, T, T) bool mask `sdpa_mask` made once per forward for every layer of this layer's window (document
        masking), True where a query may look."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)  # q (B, n_heads, T, head_dim); k, v (B, n_kv_heads, T, head_dim)
        sinks = None if self.sinks is None else self.sinks.weight  # (n_heads,)
        if self.context is not None:  # keys and values of the whole sequence, mask in its positions
            y = self.context(q, k, v, mask, self.window, sinks)  # (B, n_heads, T, head_dim)
        else:
            # SDPA with an explicit mask, not flex_attention: on this CPU (torch 2.13) flex_attention has no
            # backward ("FlexAttention does not support backward on CPU"), so it cannot train here; its forward
            # alone measured 190-230 ms eager and 23-48 ms compiled against SDPA's 16-31 ms with the mask (B 8,
            # 4 heads, T 256, head_dim 64; 2 loaded cores). The mask costs B·T² bytes: 0.5 MB for the default model.
            sdpa = sdpa_mask(Mask(window=self.window), T, T, q) if mask is None else SdpaMask(mask, False)
            y = attend(q, k, v, *sdpa, sinks=sinks)  # (B, n_heads, T, head_dim)
        return self.output(x, y)

    def output(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """wo of the heads' outputs y (B, n_heads, T, head_dim), each gated by sigmoid(x W_g) of the attention's
        input x (B, T, d_model) under model.attention_gate (Qiu et al. 2025, G1). Returns (B, T, d_model)."""
        B, T, _ = x.shape
        if self.wg is not None:
            gate = torch.sigmoid(self.wg(x)).view(B, T, y.shape[1], -1)  # (B, T, n_heads, 1 or head_dim)
            y = y * gate.transpose(1, 2)  # (B, n_heads, T, head_dim)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, d_model)

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: "KVCache",
                       layer: int) -> torch.Tensor:
        """`forward` for tokens at positions [cache.length, cache.length + T): their keys and values join the
        cache's, and their queries attend to every cached position before them. Decoding only; training never
        calls it, so `forward` stays one fused causal kernel with nothing to check."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)  # q (B, n_heads, T, head_dim); k, v (B, n_kv_heads, T, head_dim)
        k, v = cache.append(layer, k, v)  # (B, n_kv_heads, S, head_dim), S = cache.length + T
        # the new queries end at the last key: the causal triangle aligned to the bottom right (and this layer's
        # window, counted back from each query)
        sinks = None if self.sinks is None else self.sinks.weight  # (n_heads,)
        sdpa = sdpa_mask(Mask(queries=cache.length, window=self.window), T, k.shape[2], q)
        y = attend(q, k, v, *sdpa, sinks=sinks)  # (B, n_heads, T, head_dim)
        return self.output(x, y)


class SwiGLU(nn.Module):
    """Gated MLP w_down(silu(w_gate(x)) * w_up(x)) (Shazeer 2020, "GLU Variants Improve Transformer")."""

    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        spec = cfg.block_modules(layer)
        self.w_gate, self.w_up, self.w_down = (build_linear(spec[f"mlp.{n}"]) for n in ("w_gate", "w_up", "w_down"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))  # (B, T, hidden_dim) -> (B, T, d_model)


class GeluMLP(nn.Module):
    """w_down(gelu(w_up(x))), exact (erf) GELU (Hendrycks & Gimpel 2016; GPT-2's MLP without biases)."""

    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        spec = cfg.block_modules(layer)
        self.w_up, self.w_down = build_linear(spec["mlp.w_up"]), build_linear(spec["mlp.w_down"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.gelu(self.w_up(x)))  # (B, T, hidden_dim) -> (B, T, d_model)


MLPS = {"swiglu": SwiGLU, "gelu": GeluMLP}


class Block(nn.Module):
    """Pre-norm residual block (GPT-2, LLaMA): normalizing the branch input, not the stream, keeps the
    residual path an identity, which trains stably without warmup tricks at depth (Xiong et al. 2020)."""

    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        spec = cfg.block_modules(layer)
        self.attn_norm = build_norm(cfg, spec["attn_norm"])
        mla = cfg.attention == "mla"  # model.attention
        self.attn = LatentAttention(cfg, build_linear, build_norm, apply_rope) if mla else Attention(cfg, layer)
        self.mlp_norm = build_norm(cfg, spec["mlp_norm"])
        # model.moe: the table decides which blocks route their tokens to experts (lit_pretrain/model/moe.py)
        self.mlp = MoE(cfg, layer) if cfg.is_moe_layer(layer) else MLPS[cfg.mlp](cfg, layer)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)  # (B, T, d_model)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, d_model)

    def forward_cached(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: "KVCache",
                       layer: int) -> torch.Tensor:
        x = x + self.attn.forward_cached(self.attn_norm(x), cos, sin, cache, layer)  # (B, T, d_model)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, d_model)


class GPT(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, vocab_size). No loss inside: the LightningModule owns it."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError(
                "model.vocab_size is null: set it in the config or take it from the prepared tokenizer "
                "(data.vocab_size) before building the model"
            )
        cfg.check()
        self.cfg = cfg
        spec = cfg.modules()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.tok_embeddings.tensor_parallel = spec["tok_embeddings"].tensor_parallel  # "vocab": its rows split
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = build_norm(cfg, spec["norm"])
        self.lm_head = build_linear(spec["lm_head"])
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight  # one Parameter, two views (GPT-2, PaLM)
        if cfg.mtp_depth:  # model.mtp_depth: trained only, after the head (model/mtp.py); absent otherwise
            mtp = cfg.mtp_modules()
            self.mtp = nn.ModuleList(MTPModule(build_norm(cfg, mtp["hnorm"]), build_norm(cfg, mtp["enorm"]),
                                               build_linear(mtp["proj"]), Block(cfg, cfg.n_layers - 1),
                                               build_norm(cfg, mtp["norm"])) for _ in range(cfg.mtp_depth))
        # Non-persistent: derived from the config, so checkpoints hold only weights.
        self.register_buffer("rope_cos", torch.empty(cfg.seq_len, cfg.rope_head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.seq_len, cfg.rope_head_dim), persistent=False)
        # Context parallelism sets this from outside (lit_pretrain/parallel/context.py): an object whose
        # positions(T, device) are the (T/c,) positions of a window of T that this process computes. None: all.
        self.context_split = None
        self.windows = [cfg.attention_window(i) for i in range(cfg.n_layers)]  # model.sliding_window per layer
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialize every weight and the RoPE tables; deterministic under `torch.manual_seed`.

        By model.init (lit_pretrain/model/init.py): by default weight matrices ~ N(0, init_std) and the residual output
        projections (Linears marked `residual_projection`: attn.wo, mlp.w_down) ~ N(0, init_std / sqrt(2 * n_layers))
        so the residual stream's variance stays O(1) in depth (GPT-2 paper §2.3, "scaled residual initialization").
        Norm weights = 1.
        A small std also matters for speed: N(0, 1) tied embeddings produced denormals that slowed CPU steps 5x.
        Call again after materializing from the meta device: the children's own `reset_parameters` would apply
        PyTorch's defaults (Kaiming-uniform Linears, N(0, 1) Embedding), not this scheme.
        """
        cfg = self.cfg
        initialize(self, cfg)  # model.init: lit_pretrain/model/init.py
        cos, sin = rope_tables(cfg.rope_head_dim, cfg.seq_len, cfg.rope_theta, device=self.rope_cos.device,
                               scaling=cfg.rope_scaling)
        # Assigned, not copied: the buffers may have been cast (e.g. `.to(bfloat16)`); the tables are fp32.
        self.rope_cos, self.rope_sin = cos, sin

    def forward(self, idx: torch.Tensor, document_ids: torch.Tensor | None = None, output=None):
        """Logits of idx (B, T). document_ids (B, T), e.g. `document_ids(idx, eod_id)`: attention stays inside each
        document and RoPE positions restart at each document's first token, so a document is computed as if it
        were alone in the window (document masking). None: one causal sequence per row, positions 0..T-1.
        Under context parallelism (`context_split`) the logits are those of this process's T/c positions.
        output: what the forward returns instead of the logits, output(gpt, x, (cos, sin, mask)) of the last
        block's output x (B, T, d_model): the loss path's chunked cross-entropy and multi-token prediction modules
        (parallel/batch_losses.py) run there, inside the forward, so FSDP's hooks and compile see the head as they
        see it in the logits' path."""
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(
                f"input has {T} tokens but model.seq_len={self.cfg.seq_len}: the RoPE tables cover only "
                "model.seq_len positions; raise model.seq_len or feed shorter windows"
            )
        # Under context parallelism this process computes only the (T/c,) positions `part` of the window, whose
        # attention reads every position's keys (Attention.context); None: all of them.
        part = None if self.context_split is None else self.context_split.positions(T, idx.device)
        if document_ids is None:
            if part is None:
                cos, sin, mask = self.rope_cos[:T], self.rope_sin[:T], None  # (T, head_dim); is_causal attention
            else:  # global positions; the causal mask is Attention.context's
                cos, sin, mask = self.rope_cos[part], self.rope_sin[part], None  # (T/c, head_dim)
        else:
            if document_ids.shape != idx.shape:
                raise ValueError(f"document_ids {tuple(document_ids.shape)} must have the shape of the input "
                                 f"{tuple(idx.shape)}")
            # RoPE scores depend on relative positions only, so inside a masked document the restart changes the
            # scores by rounding alone; it makes them the very angles the document gets when alone in a window.
            positions = document_positions(document_ids)  # (B, T)
            if part is not None:  # counted over the whole window: a document may start in another rank's chunk
                positions = positions[:, part]  # (B, T/c)
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]  # (B, T or T/c, head_dim)
            # one mask per distinct window (model.sliding_window's layers and the full ones), shared by its layers
            mask = {w: document_mask(document_ids, part, w) for w in set(self.windows)}  # (B, 1, T or T/c, T) each
        if part is not None:
            idx = idx[:, part]  # (B, T/c)
        x = self.tok_embeddings(idx)  # (B, T, d_model)
        for block, window in zip(self.blocks, self.windows):
            x = block(x, cos, sin, None if mask is None else mask[window])  # (B, T, d_model)
        if output is not None:  # the MTP blocks are the last block's kind, its window too (model/mtp.py)
            return output(self, x, (cos, sin, None if mask is None else mask[self.windows[-1]]))
        return self.head(x)  # (B, T, vocab_size)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the last block's output x (B, T, d_model): final norm, output head, soft-cap. Pipeline stages
        call it too."""
        return softcap(self.lm_head(self.norm(x)), self.cfg.logit_softcap)  # (B, T, vocab_size)

    def mtp_head(self, k: int):
        """Depth k's (0-based) head: its own final norm, then the shared output head and soft-cap (DeepSeek-V3
        eq. 23's OutHead)."""
        norm = self.mtp[k].norm
        return lambda h: softcap(self.lm_head(norm(h)), self.cfg.logit_softcap)  # (B, T, vocab_size)

    def forward_cached(self, idx: torch.Tensor, cache: "KVCache") -> torch.Tensor:
        """Logits of the last token of idx (B, T), which continues the cache's sequence at position cache.length;
        the cache then holds cache.length + T positions. Only the new tokens are computed: a decoding step costs
        one token's forward instead of the whole prefix's (Pope et al. 2022, "Efficiently Scaling Transformer
        Inference", §2). Returns (B, vocab_size)."""
        B, T = idx.shape
        start = cache.length
        if start + T > cache.max_len:
            raise ValueError(f"{start} cached + {T} new tokens exceed the cache's {cache.max_len} positions "
                             f"(at most model.seq_len={self.cfg.seq_len})")
        # Positions start..start+T-1: RoPE turns each key by its absolute position, as `forward` does.
        cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]  # (T, head_dim)
        x = self.tok_embeddings(idx)  # (B, T, d_model)
        for layer, block in enumerate(self.blocks):
            x = block.forward_cached(x, cos, sin, cache, layer)  # (B, T, d_model)
        cache.length = start + T
        return self.head(x[:, -1])  # (B, vocab_size): only the last position is sampled from

    def new_cache(self, batch_size: int, max_len: int | None = None) -> "KVCache":
        """An empty KVCache for this model, of max_len positions (default model.seq_len), on its device and in
        its dtype."""
        cfg, weight = self.cfg, self.tok_embeddings.weight
        max_len = cfg.seq_len if max_len is None else max_len
        if not 1 <= max_len <= cfg.seq_len:
            raise ValueError(f"a cache of {max_len} positions: choose 1..model.seq_len={cfg.seq_len}")
        heads, k_dim, v_dim = cfg.kv_cache_layout  # latent attention: one latent and one shared key
        return KVCache(cfg.n_layers, batch_size, heads, max_len, k_dim, weight.device, weight.dtype, v_dim)

    def num_params(self, non_embedding: bool = True, active: bool = False) -> int:
        """Number of unique parameters (a tied embedding/head Parameter is counted once).

        non_embedding=True follows Kaplan et al. 2020 §2.1: N excludes the vocabulary matrices, i.e. both the
        token embedding and the output head, tied or not. Norm weights are included.
        non_embedding=False counts every unique parameter.
        active=True counts what one token uses: of each routed experts' stack (E, out, in), top_k experts.
        """
        vocab_matrices = {id(self.tok_embeddings.weight), id(self.lm_head.weight)}
        used = {}
        if active and self.cfg.moe is not None:
            k, E = self.cfg.moe.top_k, self.cfg.moe.num_experts
            used = {id(m.weight): m.weight.numel() // E * k for m in self.modules() if getattr(m, "expert", False)}
        return sum(used.get(id(p), p.numel()) for p in self.parameters()
                   if not (non_embedding and id(p) in vocab_matrices))

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward), PaLM appendix B: see `flops_per_token_formula`.

        N = num_params(non_embedding=True, active=True) + vocab_size·d_model: every parameter used per token (of a
        mixture of experts, the top_k routed experts; the router's matmul is in N too) plus the output
        head's matmul; the embedding is a lookup, not a matmul. Norm weights stay in N, as PaLM counts all
        parameters, although they cost elementwise multiplies, not matmuls (an overcount of 6·(2L+1)·d_model).
        The attention term counts the full T×T score matrix, as PaLM does, though attention is causal (a
        sliding-window layer: the pairs its window keeps, model/mask_spec.py `scored_pairs`); it depends
        on the query heads only (grouped-query attention shares k and v, not the score computations).
        seq_len defaults to model.seq_len.
        """
        cfg = self.cfg
        # model.mtp_depth: each depth's parameters are in N, its block is one more attention layer, and it runs
        # the shared head's matmul once more (DeepSeek-V3 §2.2)
        heads = 1 + cfg.mtp_depth
        n_matmul_params = self.num_params(non_embedding=True, active=True) + heads * cfg.vocab_size * cfg.d_model
        seq_len = cfg.seq_len if seq_len is None else seq_len
        return flops_per_token_formula(n_matmul_params, cfg.n_layers + cfg.mtp_depth, cfg.n_heads, cfg.qk_head_dim,
                                       seq_len, cfg.attention_masks(), v_head_dim=cfg.value_head_dim)


class KVCache:
    """Keys and values of every layer for the positions decoded so far, in tensors allocated once for max_len
    positions (no concatenation per step). Positions [0, length) are filled; `GPT.forward_cached` fills the next."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device | None = None, dtype: torch.dtype | None = None, v_dim: int | None = None):
        # n_kv_heads, not n_heads: grouped-query attention shrinks the cache by n_heads / n_kv_heads (its purpose).
        # v_dim: the second tensor's width where it differs (latent attention: the latent in k, the rotated key in v).
        shape = (n_layers, batch_size, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # (L, B, n_kv_heads, max_len, head_dim)
        self.v = torch.zeros(shape[:-1] + (v_dim or head_dim,), device=device, dtype=dtype)  # (..., v_dim)
        self.max_len, self.length = max_len, 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v (B, n_kv_heads, T, head_dim) at positions [length, length + T) of `layer`; return that layer's
        keys and values of positions [0, length + T). `length` itself moves once all layers have appended."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # (B, n_kv_heads, end, head_dim) each
