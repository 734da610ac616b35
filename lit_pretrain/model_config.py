"""The GPT's shape as plain data: read by `model.py` and by the config loader alike.

Kept apart from `model.py` so that loading and checking a config, and the FLOPs arithmetic the planner shares
with the model, never import torch.
Field metadata (`ge`, `gt`, `le`, `choices`) is the range the config loader enforces.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple


@dataclass
class GPTConfig:
    vocab_size: Optional[int] = field(default=None, metadata={"ge": 2})
    """Vocabulary size. null: taken from the prepared tokenizer (`data.vocab_size` after training)."""
    n_layers: int = field(default=6, metadata={"ge": 1})
    """Number of transformer blocks (L)."""
    d_model: int = field(default=384, metadata={"ge": 1})
    """Residual stream width (d_model = n_heads * head_dim)."""
    n_heads: int = field(default=6, metadata={"ge": 1})
    """Attention (query) heads (H); must divide d_model."""
    n_kv_heads: Optional[int] = field(default=None, metadata={"ge": 1})
    """Key/value heads (grouped-query attention, Ainslie et al. 2023; Llama 2/3): each serves n_heads / n_kv_heads
    query heads; 1 is multi-query attention (Shazeer 2019). null: n_heads (multi-head attention). Must divide
    n_heads (and, under tensor parallelism, be divisible by strategy.tensor_parallel)."""
    qk_norm: bool = False
    """Normalize each head's queries and keys (the model's norm over head_dim, one learned weight shared by the heads,
    before RoPE) so attention logits cannot grow with the weights (Dehghani et al. 2023; OLMo 2; Qwen3's layout)."""
    logit_softcap: Optional[float] = field(default=None, metadata={"gt": 0})
    """Output logits become cap * tanh(logits / cap), bounded by +-cap (Gemma 2, Gemma Team 2024 §2). null: none."""
    norm: str = field(default="rmsnorm", metadata={"choices": ["rmsnorm", "layernorm"]})
    """Every norm of the model: rmsnorm (Zhang & Sennrich 2019; LLaMA) or layernorm (Ba et al. 2016) with a weight
    and no bias, as PaLM (Chowdhery et al. 2022 §2) uses it."""
    mlp: str = field(default="swiglu", metadata={"choices": ["swiglu", "gelu"]})
    """The block's MLP: swiglu, w_down(silu(w_gate x) * w_up x) (Shazeer 2020; LLaMA), or gelu, w_down(gelu(w_up x))
    (GPT-2; Hendrycks & Gimpel 2016), both without biases."""
    d_ff: Optional[int] = field(default=None, metadata={"ge": 1})
    """MLP hidden width. null: for swiglu 8/3 * d_model rounded up to a multiple of 64 (LLaMA's choice: the same
    parameters and FLOPs as a 4x GELU MLP); for gelu 4 * d_model (GPT-2)."""
    seq_len: int = field(default=256, metadata={"ge": 1})
    """Context length in tokens (T); also the training window length."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head (fewer parameters, as GPT-2 and PaLM do)."""
    rope_theta: float = field(default=10000.0, metadata={"gt": 0})
    """RoPE base frequency (Su et al. 2021)."""
    norm_eps: float = field(default=1e-5, metadata={"gt": 0})
    """Epsilon of every norm (RMSNorm or LayerNorm)."""
    init_std: float = field(default=0.02, metadata={"gt": 0})
    """Std of the normal init of every weight matrix; residual output projections get init_std / sqrt(2 * n_layers)."""
    activation_checkpointing: str = field(default="none", metadata={"choices": ["none", "full", "every_k"]})
    """Recompute whole blocks in the backward pass instead of saving their activations: none, full (every block)
    or every_k (blocks 0, k, 2k, ...). Applied from outside the GPT by lit_pretrain.parallel; the GPT ignores it."""
    activation_checkpointing_k: int = field(default=2, metadata={"ge": 1})
    """activation_checkpointing=every_k only: checkpoint one block in every k."""
    init: str = field(default="scaled_residual", metadata={"choices": ["standard", "scaled_residual", "mup"]})
    """Initialization (lit_pretrain/init.py). standard: every matrix ~ N(0, init_std); scaled_residual: residual
    output projections get init_std / sqrt(2 n_layers) (GPT-2 §2.3); mup: μP (Yang et al. 2022, Tensor Programs V,
    table 3 with a readout multiplier): hidden matrices' std and Adam rate scale with mup_base_width / d_model and
    the logits are multiplied by it, so a rate tuned at the base width carries over to wider models."""
    mup_base_width: Optional[int] = field(default=None, metadata={"ge": 1})
    """init=mup only: the d_model the hyperparameters were tuned at (required with init=mup)."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "gelu":
            return 4 * self.d_model
        return 64 * ((8 * self.d_model // 3 + 63) // 64)

    def block_modules(self) -> Dict[str, "ModuleSpec"]:
        """The architecture of one block, written once: module name (under `blocks.{i}.`) -> what it is.

        model.py builds its modules from this table (and marks each Linear with its roles); the parameter counts,
        FLOPs and memory planner (scaling/shapes.py) sum it without torch; tensor parallelism reads the roles off
        the built modules. A variant changes this table and everything downstream follows.
        Column-parallel linears split their output rows by whole heads (q: n_heads, k and v: n_kv_heads) or MLP
        units; row-parallel ones their input columns, and they are the residual projections (GPT-2 §2.3).
        """
        d, q, f = self.d_model, self.head_dim, self.hidden_dim
        kv = self.kv_heads * q
        out = {"attn_norm": ModuleSpec("norm", (d,)),
               "attn.wq": ModuleSpec("linear", (d, d), "column"),
               "attn.wk": ModuleSpec("linear", (kv, d), "column"),
               "attn.wv": ModuleSpec("linear", (kv, d), "column")}
        if self.qk_norm:
            # Replicated weights inside the head-sharded region: each tensor-parallel rank sees only its heads,
            # so their gradients are partial sums ("partial", summed over the group by parallel/tensor.py).
            out["attn.q_norm"] = ModuleSpec("norm", (q,), "partial")
            out["attn.k_norm"] = ModuleSpec("norm", (q,), "partial")
        out["attn.wo"] = ModuleSpec("linear", (d, d), "row", residual_projection=True)
        out["mlp_norm"] = ModuleSpec("norm", (d,))
        if self.mlp == "swiglu":
            out["mlp.w_gate"] = ModuleSpec("linear", (f, d), "column")
        out["mlp.w_up"] = ModuleSpec("linear", (f, d), "column")
        out["mlp.w_down"] = ModuleSpec("linear", (d, f), "row", residual_projection=True)
        return out

    def modules(self) -> Dict[str, "ModuleSpec"]:
        """Every module holding parameters, in `GPT.named_parameters()` order; a tied head is listed (it holds
        the embedding's Parameter) with `tied=True`."""
        if self.vocab_size is None:
            raise ValueError("model.vocab_size is null: the model's shapes need the vocabulary size")
        v, d = self.vocab_size, self.d_model
        out = {"tok_embeddings": ModuleSpec("embedding", (v, d))}
        block = self.block_modules()
        for i in range(self.n_layers):
            out.update({f"blocks.{i}.{name}": spec for name, spec in block.items()})
        out["norm"] = ModuleSpec("norm", (d,))
        out["lm_head"] = ModuleSpec("linear", (v, d), tied=self.tie_embeddings)
        return out

    def check(self) -> None:
        """Cross-field checks that a single field's range can't express."""
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}: "
                "choose n_heads that divides d_model"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}: each key/value "
                "head serves a whole group of query heads; choose n_kv_heads that divides n_heads"
            )
        if self.init == "mup" and self.mup_base_width is None:
            raise ValueError("model.init=mup needs model.mup_base_width: set it to the d_model the learning rate was "
                             "tuned at (e.g. model.mup_base_width=128)")
        if self.head_dim % 2:
            raise ValueError(
                f"model.d_model / model.n_heads = {self.head_dim} is odd: RoPE rotates pairs of "
                "channels, so the head dimension must be even"
            )


@dataclass(frozen=True)
class ModuleSpec:
    """One module of the GPT in the architecture table (`GPTConfig.modules`)."""

    kind: str
    """linear (weight (out, in), no bias), embedding (weight (vocab, d)) or norm (weight (dim,), no bias)."""
    shape: Tuple[int, ...]
    """Its weight's shape."""
    tensor_parallel: Optional[str] = None
    """column | row (Megatron-LM's split of a linear), partial (replicated, but its gradient is a partial sum
    over the tensor-parallel group) or None (replicated)."""
    residual_projection: bool = False
    """Writes into the residual stream (attn.wo, mlp.w_down): the initializer scales it by depth."""
    tied: bool = False
    """Holds another module's Parameter (the head tied to the embedding): not counted again."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def flops_per_token_formula(n_matmul_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward): 6·N + 12·L·H·Q·T, PaLM appendix B (Chowdhery et al. 2022).

    6·N: each of the N matmul parameters costs one multiply-add (2 FLOPs) per token forward and twice that
    backward (gradient w.r.t. the input and w.r.t. the weight). 12·L·H·Q·T: the attention scores QKᵀ and the
    weighted sum over V, each 2·H·Q·T FLOPs per token per layer forward, times 3 for forward + backward.
    The full T×T score matrix is counted, as PaLM does, although causal attention needs only half of it.
    """
    return 6 * n_matmul_params + 12 * n_layers * n_heads * head_dim * seq_len
