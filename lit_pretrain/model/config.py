"""The GPT's shape as plain data: read by `model.py` and by the config loader alike.

Kept apart from `model.py` so that loading and checking a config, and the FLOPs arithmetic the planner shares
with the model, never import torch.
Field metadata (`ge`, `gt`, `le`, `choices`) is the range the config loader enforces.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from lit_pretrain.model.mask_spec import CAUSAL, MaskSpec


@dataclass
class MoEConfig:
    """A mixture-of-experts MLP in some blocks (model.moe; null: every block is dense). Each token goes to top_k of
    num_experts routed SwiGLU experts, weighted by its router scores, plus num_shared_experts experts every token
    uses (DeepSeekMoE, Dai et al. 2024). Experts are computed as one grouped matmul over the tokens sorted by
    expert (lit_pretrain/model/moe.py)."""

    num_experts: int = field(default=8, metadata={"ge": 2})
    """Routed experts per MoE layer (E)."""
    top_k: int = field(default=2, metadata={"ge": 1})
    """Routed experts each token uses (k <= num_experts)."""
    num_shared_experts: int = field(default=0, metadata={"ge": 0})
    """Experts of width d_ff_expert that every token uses, unweighted (DeepSeekMoE §3.2); 0: none (OLMoE)."""
    d_ff_expert: Optional[int] = field(default=None, metadata={"ge": 1})
    """Hidden width of each expert (routed and shared). null: the dense MLP's (model.d_ff)."""
    first_dense_layers: int = field(default=0, metadata={"ge": 0})
    """Blocks 0 .. m-1 keep the dense MLP (DeepSeek-V3 keeps 3); 0: from the first block on."""
    every_k: int = field(default=1, metadata={"ge": 1})
    """After first_dense_layers, every k-th block is MoE (1: all of them; 2: GShard's alternating layers)."""
    capacity_factor: Optional[float] = field(default=None, metadata={"gt": 0})
    """null: dropless (every routed token is computed). Else each expert takes at most
    ceil(capacity_factor * tokens * top_k / num_experts) tokens (Switch, Fedus et al. 2021 §2.2) and the rest of its
    assignments are dropped (the residual stream carries the token on); the dropped fraction is logged."""
    score: str = field(default="softmax", metadata={"choices": ["softmax", "sigmoid"]})
    """Router score of each expert: softmax over the experts (Switch, OLMoE) or an independent sigmoid
    (DeepSeek-V3 §2.1.2)."""
    norm_topk_prob: bool = True
    """Divide the k chosen scores by their sum (DeepSeek-V3 with sigmoid; Mixtral). OLMoE-1B-7B: false."""
    aux_loss: float = field(default=0.01, metadata={"ge": 0})
    """Coefficient of the Switch/GShard load-balancing loss E * sum_i f_i * P_i (Fedus et al. 2021 eq. 4: f_i the
    fraction of assignments to expert i, P_i its mean router probability; 1 when balanced), averaged over the MoE
    layers as transformers' OLMoE does. 0: off."""
    aux_loss_scope: str = field(default="sequence", metadata={"choices": ["sequence", "micro_batch", "global"]})
    """Which tokens f_i and P_i count. sequence (default): each window's own, the loss the mean over windows
    (DeepSeek-V3's sequence-wise balance loss, §2.1.2): a window's term depends on that window alone, so every
    layout (processes, micro-batch size, gradient accumulation, expert parallelism) trains the same experiment
    (tests/parallel/test_moe_parallel.py), and with micro_batch_size 1 it is micro_batch's loss. micro_batch: each
    rank's micro-batch (Megatron-LM's default), which depends on the layout: the windows a micro-batch holds change with
    it. global: the micro-batches all data-parallel ranks run together, counts summed by one all-reduce of E per
    MoE layer and forward (global-batch balancing, Qiu et al. 2025, "Demons in the Detail"), P_i each rank's own:
    one process's loss over the same tokens only while no layout accumulates (gradient accumulation and pipeline
    micro-batches keep their own f), so it too depends on the layout. A checkpoint trained under micro_batch (the
    default before) resumes under the new default, said on the console (lit_pretrain/resume/compat.py)."""
    bias_update_rate: float = field(default=0.0, metadata={"ge": 0})
    """Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2; Wang et al. 2024): a per-expert bias, added to the
    scores for the top-k choice only, moves by this rate times sign(mean load - load) after every optimizer step.
    0: off (no bias)."""
    router_z_loss: float = field(default=0.0, metadata={"ge": 0})
    """Coefficient of the router z-loss mean(logsumexp(router logits)^2) (ST-MoE, Zoph et al. 2022 eq. 5),
    averaged over the MoE layers. 0: off."""
    def check(self) -> None:
        if self.top_k > self.num_experts:
            raise ValueError(f"model.moe.top_k={self.top_k} exceeds model.moe.num_experts={self.num_experts}: "
                             "a token cannot use more experts than there are")


@dataclass
class RopeScalingConfig:
    """Scaled RoPE frequencies for a context longer than the one pretrained (model.rope_scaling; null: unscaled).
    The inverse frequencies are pure functions of these fields (lit_pretrain/model/rope.py), equal to transformers'
    `_compute_llama3_parameters` / `_compute_yarn_parameters` (tests/model/test_rope.py)."""

    type: str = field(default="llama3", metadata={"choices": ["llama3", "yarn"]})
    """llama3: Llama 3.1's rule (Meta's llama-models `apply_scaling`): wavelengths shorter than original_seq_len /
    high_freq_factor are kept, longer than original_seq_len / low_freq_factor divided by factor, smoothly between.
    yarn: YaRN (Peng et al. 2023, eq. 18-21): per-frequency ramp between interpolation and extrapolation over
    beta_slow..beta_fast rotations, and attention logits scaled by attention_factor²."""
    factor: float = field(default=8.0, metadata={"ge": 1})
    """How many times longer than original_seq_len the context becomes (Llama 3.1: 8; YaRN: its s)."""
    original_seq_len: int = field(default=8192, metadata={"ge": 1})
    """The context length the model was pretrained at, before scaling (transformers'
    original_max_position_embeddings; Llama 3.1: 8192)."""
    low_freq_factor: float = field(default=1.0, metadata={"gt": 0})
    """type=llama3 only: wavelengths above original_seq_len / low_freq_factor are divided by factor (Llama 3.1: 1)."""
    high_freq_factor: float = field(default=4.0, metadata={"gt": 0})
    """type=llama3 only: wavelengths below original_seq_len / high_freq_factor are kept (Llama 3.1: 4); must exceed
    low_freq_factor."""
    beta_fast: float = field(default=32.0, metadata={"gt": 0})
    """type=yarn only: dimensions turning more than beta_fast times over original_seq_len extrapolate (unchanged);
    YaRN's β (§4.2: 32 for Llama), as transformers' default."""
    beta_slow: float = field(default=1.0, metadata={"gt": 0})
    """type=yarn only: dimensions turning fewer than beta_slow times over original_seq_len interpolate (divided by
    factor); YaRN's α (§4.2: 1), as transformers' default."""
    attention_factor: Optional[float] = field(default=None, metadata={"gt": 0})
    """type=yarn only: cos and sin are multiplied by it, so attention logits by its square (YaRN eq. 22's
    sqrt(1/t), as transformers applies it). null: 0.1 ln(factor) + 1 (YaRN eq. 22)."""

    def check(self) -> None:
        if self.type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                             f"model.rope_scaling.low_freq_factor={self.low_freq_factor} (Llama 3.1: 4 and 1)")
        if self.type == "yarn" and self.beta_fast <= self.beta_slow:
            raise ValueError(f"model.rope_scaling.beta_fast={self.beta_fast} must exceed "
                             f"model.rope_scaling.beta_slow={self.beta_slow} (YaRN: 32 and 1)")


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
    init: str = field(default="scaled_residual", metadata={"choices": ["standard", "scaled_residual", "mup"]})
    """Initialization (lit_pretrain/model/init.py). standard: every matrix ~ N(0, init_std); scaled_residual: residual
    output projections get init_std / sqrt(2 n_layers) (GPT-2 §2.3); mup: μP (Yang et al. 2022, Tensor Programs V,
    table 3 with a readout multiplier): hidden matrices' std and Adam rate scale with mup_base_width / d_model and
    the logits are multiplied by it, so a rate tuned at the base width carries over to wider models."""
    mup_base_width: Optional[int] = field(default=None, metadata={"ge": 1})
    """init=mup only: the d_model the hyperparameters were tuned at (required with init=mup)."""
    qk_norm_scope: str = field(default="head", metadata={"choices": ["head", "projection"]})
    """qk_norm only: head normalizes each head over head_dim (Qwen3, OLMo 2's later layout: one weight of head_dim);
    projection normalizes the whole q (d_model) and k (n_kv_heads * head_dim) projections before the split into
    heads, with weights of those sizes (OLMoE's OlmoeAttention; OLMo 2). Tensor parallelism needs head."""
    moe: Optional[MoEConfig] = None
    """Mixture of experts (MoEConfig); null: every block's MLP is dense."""
    rope_scaling: Optional[RopeScalingConfig] = None
    """Scaled RoPE for a context longer than pretrained (RopeScalingConfig: Llama 3.1's llama3 rule or YaRN); null:
    unscaled. Holds no weight: a context-extension stage sets it with a longer model.seq_len (docs/resume.md,
    "Context-extension stages")."""
    loss_chunk_size: Optional[int] = field(default=None, metadata={"ge": 1})
    """Positions per chunk of the output head and cross-entropy (and z-loss) in training and validation: the
    (B, T, V) logits never exist whole, forward or backward (each chunk's logits are recomputed in the backward:
    model/losses.py `chunked_lm_sums`; torchtitan's and OLMo-core's chunked loss). Holds no weight and changes no
    loss beyond fp32 rounding; costs one more head matmul per token (the recomputation). null: the whole window at
    once. Under context or sequence parallelism it counts this rank's positions."""
    mtp_depth: int = field(default=0, metadata={"ge": 0})
    """Multi-token prediction (DeepSeek-V3, DeepSeek-AI 2024, §2.2): D sequential modules after the last block, the
    k-th predicting token t+1+k from its RMSNorm'd input (the previous depth's output, the last block's for k = 1)
    and the RMSNorm'd embedding of token t+k, concatenated and projected to d_model, through one transformer block,
    its own final norm and the shared output head (eq. 21-23; lit_pretrain/model/mtp.py). Trained on, never used to
    generate: generation and HF export read the main head only. 0: none."""
    mtp_loss_weight: float = field(default=0.3, metadata={"ge": 0})
    """λ: the objective adds λ/D times the sum of the D depths' cross-entropies (DeepSeek-V3 eq. 25; 0.3 for its
    first 10T tokens, then 0.1, §4.2). train/loss stays the next-token loss; train/mtp_loss logs the depths' mean."""

    def __post_init__(self):
        if isinstance(self.moe, dict):  # from a checkpoint's plain hyperparameters (dataclasses.asdict)
            self.moe = MoEConfig(**self.moe)
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScalingConfig(**self.rope_scaling)

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

    @property
    def d_ff_expert(self) -> int:
        """Each expert's hidden width (model.moe.d_ff_expert, else the dense MLP's)."""
        moe = self.moe
        return self.hidden_dim if moe is None or moe.d_ff_expert is None else moe.d_ff_expert

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` has the mixture-of-experts MLP (model.moe.first_dense_layers, every_k)."""
        moe = self.moe
        return moe is not None and layer >= moe.first_dense_layers and \
            (layer - moe.first_dense_layers) % moe.every_k == 0

    def moe_layers(self) -> List[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    def block_modules(self, layer: int = 0) -> Dict[str, "ModuleSpec"]:
        """The architecture of one block, written once: module name (under `blocks.{i}.`) -> what it is.

        model.py builds its modules from this table (and marks each Linear with its roles); the parameter counts,
        FLOPs and memory planner (model/shapes.py) sum it without torch; tensor parallelism reads the roles off
        the built modules. A variant changes this table and everything downstream follows.
        Column-parallel linears split their output rows by whole heads (q: n_heads, k and v: n_kv_heads) or MLP
        units; row-parallel ones their input columns, and they are the residual projections (GPT-2 §2.3).
        A mixture-of-experts block (`is_moe_layer(layer)`) replaces the MLP's linears with the router (E, d), the
        routed experts' stacked weights (E, out, in), of which each token uses top_k (`active_experts`), and the
        shared experts, one SwiGLU of num_shared_experts * d_ff_expert units (a sum of SwiGLUs is one SwiGLU over
        their concatenated units).
        """
        d, q, f = self.d_model, self.head_dim, self.hidden_dim
        kv = self.kv_heads * q
        out = {"attn_norm": ModuleSpec("norm", (d,)),
               "attn.wq": ModuleSpec("linear", (d, d), "column"),
               "attn.wk": ModuleSpec("linear", (kv, d), "column"),
               "attn.wv": ModuleSpec("linear", (kv, d), "column")}
        if self.qk_norm and self.qk_norm_scope == "projection":
            out["attn.q_norm"] = ModuleSpec("norm", (d,))  # over the whole projections (OLMoE): no head split
            out["attn.k_norm"] = ModuleSpec("norm", (kv,))
        elif self.qk_norm:
            # Replicated weights inside the head-sharded region: each tensor-parallel rank sees only its heads,
            # so their gradients are partial sums ("partial", summed over the group by parallel/tensor.py).
            out["attn.q_norm"] = ModuleSpec("norm", (q,), "partial")
            out["attn.k_norm"] = ModuleSpec("norm", (q,), "partial")
        out["attn.wo"] = ModuleSpec("linear", (d, d), "row", residual_projection=True)
        out["mlp_norm"] = ModuleSpec("norm", (d,))
        if self.is_moe_layer(layer):
            moe, e = self.moe, self.d_ff_expert
            E, k = moe.num_experts, moe.top_k
            # Under tensor parallelism the router stays replicated; each routed expert is split along its hidden
            # size like the dense MLP (Megatron-LM's expert tensor parallelism), on dim 1 of the gate/up stacks and
            # dim 2 of the down stack, behind the leading expert dim (parallel/expert_tensor.py).
            out["mlp.router"] = ModuleSpec("linear", (E, d))
            out["mlp.experts.w_gate"] = ModuleSpec("experts", (E, e, d), "expert_column", active_experts=k)
            out["mlp.experts.w_up"] = ModuleSpec("experts", (E, e, d), "expert_column", active_experts=k)
            out["mlp.experts.w_down"] = ModuleSpec("experts", (E, d, e), "expert_row", residual_projection=True,
                                                   active_experts=k)
            if moe.num_shared_experts:
                s = moe.num_shared_experts * e
                # Split like the dense MLP under tensor parallelism (Megatron-LM's SharedExpertMLP).
                out["mlp.shared.w_gate"] = ModuleSpec("linear", (s, d), "column")
                out["mlp.shared.w_up"] = ModuleSpec("linear", (s, d), "column")
                out["mlp.shared.w_down"] = ModuleSpec("linear", (d, s), "row", residual_projection=True)
            return out
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
        # Both vocabulary matrices split their rows under tensor parallelism (parallel/vocab.py, Megatron-LM).
        out = {"tok_embeddings": ModuleSpec("embedding", (v, d), "vocab")}
        blocks = {}  # one table per kind of block (dense, MoE)
        for i in range(self.n_layers):
            kind = self.is_moe_layer(i)
            block = blocks[kind] = blocks[kind] if kind in blocks else self.block_modules(i)
            out.update({f"blocks.{i}.{name}": spec for name, spec in block.items()})
        out["norm"] = ModuleSpec("norm", (d,))
        out["lm_head"] = ModuleSpec("linear", (v, d), "vocab", tied=self.tie_embeddings)
        for k in range(self.mtp_depth):
            out.update({f"mtp.{k}.{name}": spec for name, spec in self.mtp_modules().items()})
        return out

    def mtp_modules(self) -> Dict[str, "ModuleSpec"]:
        """One multi-token prediction module (under `mtp.{k}.`, model.mtp_depth of them; DeepSeek-V3 eq. 21-23):
        the norms of the previous depth's output and of the next token's embedding, the (d, 2d) projection of their
        concatenation (replicated under tensor parallelism: its input is whole on every rank), one block of the
        last block's kind (`block.` + block_modules) and its final norm before the shared head. The embedding and
        head are the model's own (not listed again)."""
        d = self.d_model
        out = {"hnorm": ModuleSpec("norm", (d,)), "enorm": ModuleSpec("norm", (d,)),
               "proj": ModuleSpec("linear", (d, 2 * d))}
        out.update({f"block.{name}": spec for name, spec in self.block_modules(self.n_layers - 1).items()})
        out["norm"] = ModuleSpec("norm", (d,))
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
        if self.moe is not None:
            self.moe.check()
            if not self.moe_layers():
                raise ValueError(f"model.moe.first_dense_layers={self.moe.first_dense_layers} leaves no MoE layer "
                                 f"among model.n_layers={self.n_layers}: lower it or set model.moe=null")
            if self.mlp != "swiglu":
                raise ValueError(f"model.mlp={self.mlp!r} with model.moe: the experts are SwiGLU (OLMoE, DeepSeek-V3, "
                                 "Mixtral); set model.mlp=swiglu")
            # torch's grouped matmul reads rows at 16-byte strides: 8 elements cover bf16 and fp32 alike.
            for key, value in (("model.d_model", self.d_model), ("model.moe.d_ff_expert", self.d_ff_expert)):
                if value % 8:
                    raise ValueError(f"{key}={value} with model.moe: the experts' grouped matmul needs a multiple "
                                     "of 8 (16-byte rows); round it to one")
        if self.rope_scaling is not None:
            self.rope_scaling.check()
        if self.mtp_depth >= self.seq_len:
            raise ValueError(f"model.mtp_depth={self.mtp_depth} predicts tokens beyond a window of model.seq_len="
                             f"{self.seq_len}: choose a depth below it (DeepSeek-V3 uses 1)")
        if self.head_dim % 2:
            raise ValueError(
                f"model.d_model / model.n_heads = {self.head_dim} is odd: RoPE rotates pairs of "
                "channels, so the head dimension must be even"
            )


@dataclass(frozen=True)
class ModuleSpec:
    """One module of the GPT in the architecture table (`GPTConfig.modules`)."""

    kind: str
    """linear (weight (out, in), no bias), embedding (weight (vocab, d)), norm (weight (dim,), no bias) or experts
    (routed experts' stacked weights (E, out, in))."""
    shape: Tuple[int, ...]
    """Its weight's shape."""
    tensor_parallel: Optional[str] = None
    """column | row (Megatron-LM's split of a linear), vocab (the embedding's and head's rows: the vocabulary),
    expert_column | expert_row (the same splits of a routed expert stack (E, out, in), one dim further in), partial
    (replicated, but its gradient is a partial sum over the tensor-parallel group) or None (replicated)."""
    residual_projection: bool = False
    """Writes into the residual stream (attn.wo, mlp.w_down): the initializer scales it by depth."""
    tied: bool = False
    """Holds another module's Parameter (the head tied to the embedding): not counted again."""
    active_experts: Optional[int] = None
    """kind experts only: how many of the shape[0] stacked experts each token uses (top_k); None: all (dense)."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def active_numel(self) -> int:
        """The parameters one token uses: numel, or for routed experts active_experts of shape[0] experts."""
        if self.active_experts is None:
            return self.numel
        return self.numel // self.shape[0] * self.active_experts


def flops_per_token_formula(n_matmul_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int,
                            mask: MaskSpec = CAUSAL) -> int:
    """Training FLOPs per token (forward + backward): 6·N + 12·L·H·Q·T, PaLM appendix B (Chowdhery et al. 2022).

    6·N: each of the N matmul parameters costs one multiply-add (2 FLOPs) per token forward and twice that
    backward (gradient w.r.t. the input and w.r.t. the weight). 12·L·H·Q·T: the attention scores QKᵀ and the
    weighted sum over V, each 2·H·Q·T FLOPs per token per layer forward, times 3 for forward + backward.
    T is the keys a query is counted against, as the attention mask says (model/mask_spec.py
    `MaskSpec.scored_keys`): the full T×T score matrix, as PaLM counts it, although causal attention needs only
    half of it.
    """
    return 6 * n_matmul_params + 12 * n_layers * n_heads * head_dim * mask.scored_keys(seq_len)
