"""The GPT's shape as plain data: read by `model.py` and by the config loader alike.

Kept apart from `model.py` so that loading and checking a config, and the FLOPs arithmetic the planner shares
with the model, never import torch.
Field metadata (`ge`, `gt`, `le`, `choices`) is the range the config loader enforces.
"""

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class GPTConfig:
    vocab_size: Optional[int] = field(default=None, metadata={"ge": 2})
    """Vocabulary size. null: taken from the prepared tokenizer (`data.vocab_size` after training)."""
    n_layers: int = field(default=6, metadata={"ge": 1})
    """Number of transformer blocks (L)."""
    d_model: int = field(default=384, metadata={"ge": 1})
    """Residual stream width (d_model = n_heads * head_dim)."""
    n_heads: int = field(default=6, metadata={"ge": 1})
    """Attention heads (H); must divide d_model."""
    d_ff: Optional[int] = field(default=None, metadata={"ge": 1})
    """SwiGLU hidden width. null: 8/3 * d_model rounded up to a multiple of 64 (LLaMA's choice: the same
    parameters and FLOPs as a 4x GELU MLP)."""
    seq_len: int = field(default=256, metadata={"ge": 1})
    """Context length in tokens (T); also the training window length."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head (fewer parameters, as GPT-2 and PaLM do)."""
    rope_theta: float = field(default=10000.0, metadata={"gt": 0})
    """RoPE base frequency (Su et al. 2021)."""
    norm_eps: float = field(default=1e-5, metadata={"gt": 0})
    """RMSNorm epsilon."""
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
    def hidden_dim(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        return 64 * ((8 * self.d_model // 3 + 63) // 64)

    def check(self) -> None:
        """Cross-field checks that a single field's range can't express."""
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}: "
                "choose n_heads that divides d_model"
            )
        if self.init == "mup" and self.mup_base_width is None:
            raise ValueError("model.init=mup needs model.mup_base_width: set it to the d_model the learning rate was "
                             "tuned at (e.g. model.mup_base_width=128)")
        if self.head_dim % 2:
            raise ValueError(
                f"model.d_model / model.n_heads = {self.head_dim} is odd: RoPE rotates pairs of "
                "channels, so the head dimension must be even"
            )


def flops_per_token_formula(n_matmul_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward): 6·N + 12·L·H·Q·T, PaLM appendix B (Chowdhery et al. 2022).

    6·N: each of the N matmul parameters costs one multiply-add (2 FLOPs) per token forward and twice that
    backward (gradient w.r.t. the input and w.r.t. the weight). 12·L·H·Q·T: the attention scores QKᵀ and the
    weighted sum over V, each 2·H·Q·T FLOPs per token per layer forward, times 3 for forward + backward.
    The full T×T score matrix is counted, as PaLM does, although causal attention needs only half of it.
    """
    return 6 * n_matmul_params + 12 * n_layers * n_heads * head_dim * seq_len
