"""The GPT's shape as plain data: read by `model.py` and by the config loader alike.

Kept apart from `model.py` so that loading and checking a config, and the FLOPs arithmetic the planner shares
with the model, never import torch.
Field metadata (`ge`, `gt`, `le`, `choices`) is the range the config loader enforces.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

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
class MLAConfig:
    """Multi-head latent attention (model.mla; read when model.attention=mla): DeepSeek-V2 §2.1 (DeepSeek-AI 2024),
    as DeepSeek-V3 keeps it. Keys and values are expanded per head from one compressed latent of kv_lora_rank
    channels, and RoPE is decoupled: each head's query carries qk_rope_head_dim rotated channels that meet one
    rotated key shared by every head. A KV cache then holds the latent and the shared key, kv_lora_rank +
    qk_rope_head_dim numbers a token a layer (lit_pretrain/model/mla.py). Names as transformers' DeepseekV3Config."""

    kv_lora_rank: int = field(default=64, metadata={"ge": 1})
    """Width of the compressed key/value latent (DeepSeek-V2's d_c; V3: 512)."""
    q_lora_rank: Optional[int] = field(default=None, metadata={"ge": 1})
    """Width of the compressed query (d_c'; V3: 1536), normalized between its down- and up-projection. null: the
    queries come from one projection of the input (DeepSeek-V2-Lite)."""
    qk_rope_head_dim: int = field(default=16, metadata={"ge": 2})
    """Rotated channels of each query head and of the one shared rotated key (d_h^R; V3: 64); even."""
    qk_nope_head_dim: int = field(default=32, metadata={"ge": 1})
    """Unrotated query/key channels per head, expanded from the latent (d_h; V3: 128)."""
    v_head_dim: int = field(default=32, metadata={"ge": 1})
    """Value channels per head, expanded from the latent (V3: 128); the output projection reads n_heads of them."""

    def check(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} is odd: RoPE rotates pairs of "
                             "channels; choose an even one (DeepSeek-V3: 64)")


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
    attention: str = field(default="mha", metadata={"choices": ["mha", "mla"]})
    """mha: multi-head attention with n_kv_heads key/value heads (grouped-query when fewer than n_heads); mla:
    multi-head latent attention (DeepSeek-V2 §2.1) with the ranks of model.mla (lit_pretrain/model/mla.py)."""
    mla: Optional[MLAConfig] = None
    """model.attention=mla only: its ranks and head widths (MLAConfig); null with model.attention=mha."""
    attention_sinks: bool = False
    """A learned logit per head that joins every query's softmax as one more key whose value is zero (GPT-OSS,
    OpenAI 2025 gpt-oss model card; the idea: Xiao et al. 2023, "Efficient Streaming Language Models with Attention
    Sinks"), so a head can put its weight on nothing instead of on the first tokens. Starts at 0 (one zero-score key:
    Miller 2023's softmax plus one); a bias of the logits, optim's "biases" kind, undecayed by default. Made by the
    mask function (lit_pretrain/model/mask.py `with_sinks`); docs/model.md, "Attention sinks"."""
    attention_gate: Optional[str] = field(default=None, metadata={"choices": [None, "headwise", "elementwise"]})
    """Gated attention (Qiu et al. 2025, "Gated Attention for Large Language Models", position G1: after SDPA,
    before wo): each head's output is multiplied by sigmoid(x W_g), x the block's normed input. headwise: one gate
    per head (W_g: d_model -> n_heads, the paper's cheap variant); elementwise: one per channel (d_model -> n_heads *
    head_dim: the paper's best and Qwen3-Next's). null: no gate. docs/model.md, "Gated attention"."""
    sliding_window: Optional[int] = field(default=None, metadata={"ge": 1})
    """Local attention: a query sees the sliding_window most recent tokens, its own included (transformers'
    sliding_window; Beltagy et al. 2020, Longformer §3.1; Mistral 7B: 4096; Gemma 3: 1024), on every layer unless
    model.global_attention_every or model.layer_types keeps some full. null: every layer attends to the whole
    window. A window of model.seq_len or more cuts nothing: those layers are full attention, masked and counted so."""
    global_attention_every: Optional[int] = field(default=None, metadata={"ge": 2})
    """With model.sliding_window: every k-th layer (layers k-1, 2k-1, ...) attends to the whole window, the others
    are local: Gemma 3's 5 local to 1 global is 6, GPT-OSS's alternation 2 (transformers' layer_types with
    sliding_window_pattern k). null: every layer local (or model.layer_types)."""
    layer_types: Optional[List[str]] = None
    """With model.sliding_window: each layer's attention, one of sliding | full per layer (n_layers of them), for a
    pattern global_attention_every cannot say. null: by model.global_attention_every. Not both."""
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
        if isinstance(self.mla, dict):
            self.mla = MLAConfig(**self.mla)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def qk_head_dim(self) -> int:
        """Channels of each query and key head: head_dim, or under latent attention the unrotated and rotated ones."""
        m = self.mla if self.attention == "mla" else None
        return self.head_dim if m is None else m.qk_nope_head_dim + m.qk_rope_head_dim

    @property
    def value_head_dim(self) -> int:
        """Channels of each value head (head_dim; model.mla.v_head_dim under latent attention)."""
        return self.head_dim if self.attention != "mla" else self.mla.v_head_dim

    @property
    def rope_head_dim(self) -> int:
        """Channels RoPE turns in each head: all of head_dim, or model.mla.qk_rope_head_dim (decoupled RoPE)."""
        return self.head_dim if self.attention != "mla" else self.mla.qk_rope_head_dim

    @property
    def kv_cache_layout(self) -> Tuple[int, int, int]:
        """(heads, key width, value width) a KV cache stores per token and layer: n_kv_heads keys and values of
        head_dim, or under latent attention one latent of kv_lora_rank and one shared rotated key (DeepSeek-V2
        §2.1.2, table 1: (d_c + d_h^R) elements a token a layer against GQA's 2·n_g·d_h)."""
        if self.attention == "mla":
            return 1, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim
        return self.kv_heads, self.head_dim, self.head_dim

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

    def attention_window(self, layer: int) -> Optional[int]:
        """The sliding window of block `layer`'s attention (model.sliding_window), or None: full attention. Every
        consumer asks this: the model's mask term (model/mask.py), the FLOP and memory counts (`mask_specs`), export."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None:
            return self.sliding_window if self.layer_types[layer] == "sliding" else None
        k = self.global_attention_every
        return None if k is not None and (layer + 1) % k == 0 else self.sliding_window

    def mask_specs(self, documents: bool = False) -> List[MaskSpec]:
        """Each layer's attention mask as data (model/mask_spec.py): what the FLOP counter and planners read."""
        return [MaskSpec(documents, self.attention_window(i)) for i in range(self.n_layers)]

    def attention_masks(self, documents: bool = False) -> List[MaskSpec]:
        """Every attention layer's mask, the blocks' and then model.mtp_depth's (each the last block's kind, its
        window too: model/mtp.py): the layers the FLOP counter counts."""
        masks = self.mask_specs(documents)
        return masks + masks[-1:] * self.mtp_depth

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
        if self.attention == "mla":  # latent attention's own projections in place of the four above
            out = {"attn_norm": out["attn_norm"], **self.latent_attention_modules()}
        if self.attention_gate is not None:
            # Column-parallel like wq: the gate's rows are heads (x head_dim when elementwise), split by whole heads.
            gates = self.n_heads * (q if self.attention_gate == "elementwise" else 1)
            out["attn.wg"] = ModuleSpec("linear", (gates, d), "column")
        if self.attention_sinks:
            # One logit per query head, split by head under tensor parallelism as wq's rows are (dim 0).
            out["attn.sinks"] = ModuleSpec("sinks", (self.n_heads,), "column")
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

    def latent_attention_modules(self) -> Dict[str, "ModuleSpec"]:
        """Multi-head latent attention's rows of the block table (DeepSeek-V2 §2.1, eq. 9-14 and 37-47; names as
        DeepSeek-V3's reference model.py): the query from wq, or down through wq_a, q_norm and up through wq_b; the
        latent and the shared rotated key from wkv_a, the latent normalized (kv_norm) and expanded by wkv_b into
        every head's unrotated key and value; wo over the heads' values.
        Under tensor parallelism wq/wq_b and wkv_b split their output rows by whole heads like wq (both are
        head-major: a head's qk_nope + qk_rope query channels, a head's qk_nope key then v_head_dim value
        channels) and wo its input columns; the down-projections and their norms stay replicated, as Megatron-LM's
        MLA keeps its q and kv down-projections (parallel/tensor.py sums the shared key's gradient).
        """
        m, d, H = self.mla, self.d_model, self.n_heads
        r, rope = m.kv_lora_rank, m.qk_rope_head_dim
        out = {}
        if m.q_lora_rank is None:
            out["attn.wq"] = ModuleSpec("linear", (H * self.qk_head_dim, d), "column")
        else:
            out["attn.wq_a"] = ModuleSpec("linear", (m.q_lora_rank, d))
            out["attn.q_norm"] = ModuleSpec("norm", (m.q_lora_rank,))
            out["attn.wq_b"] = ModuleSpec("linear", (H * self.qk_head_dim, m.q_lora_rank), "column")
        out["attn.wkv_a"] = ModuleSpec("linear", (r + rope, d))
        out["attn.kv_norm"] = ModuleSpec("norm", (r,))
        out["attn.wkv_b"] = ModuleSpec("linear", (H * (m.qk_nope_head_dim + m.v_head_dim), r), "column")
        out["attn.wo"] = ModuleSpec("linear", (d, H * m.v_head_dim), "row", residual_projection=True)
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
        if self.attention == "mla" and self.mla is None:
            raise ValueError("model.attention=mla needs its ranks in model.mla: set e.g. model.mla.kv_lora_rank=64 "
                             "(the other keys take their defaults)")
        if self.attention != "mla" and self.mla is not None:
            raise ValueError(f"model.mla is set but model.attention={self.attention}: set model.attention=mla, or "
                             "model.mla=null")
        if self.attention == "mla":
            self.mla.check()
            for key, value in (("model.n_kv_heads", self.n_kv_heads), ("model.qk_norm", self.qk_norm or None)):
                if value is not None:
                    raise ValueError(f"{key}={value} with model.attention=mla: latent attention expands every head's "
                                     f"key and value from one latent and normalizes the latents instead (DeepSeek-V2 "
                                     f"§2.1); set {key}={'null' if key.endswith('heads') else 'false'}")
            for key, value in (("model.attention_sinks", self.attention_sinks or None),
                               ("model.attention_gate", self.attention_gate),
                               ("model.sliding_window", self.sliding_window)):
                if value is not None:
                    raise ValueError(f"{key}={value} with model.attention=mla: the latent attention module "
                                     "(lit_pretrain/model/mla.py) has no sink logit, output gate or sliding window; "
                                     f"set {key}={'false' if key.endswith('sinks') else 'null'} or model.attention=mha")
        self._check_window()
        if self.mtp_depth >= self.seq_len:
            raise ValueError(f"model.mtp_depth={self.mtp_depth} predicts tokens beyond a window of model.seq_len="
                             f"{self.seq_len}: choose a depth below it (DeepSeek-V3 uses 1)")
        if self.attention == "mha" and self.head_dim % 2:
            raise ValueError(
                f"model.d_model / model.n_heads = {self.head_dim} is odd: RoPE rotates pairs of "
                "channels, so the head dimension must be even"
            )

    def _check_window(self) -> None:
        """model.sliding_window's pattern: one way of saying it, of the model's length."""
        if self.sliding_window is None:
            for key in ("global_attention_every", "layer_types"):
                if getattr(self, key) is not None:
                    raise ValueError(f"model.{key} without model.sliding_window: set model.sliding_window (tokens) "
                                     f"or model.{key}=null")
            return
        if self.layer_types is None:
            return
        if self.global_attention_every is not None:
            raise ValueError("model.layer_types and model.global_attention_every both set the local-global pattern: "
                             "keep one (model.global_attention_every=null or model.layer_types=null)")
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"model.layer_types has {len(self.layer_types)} entries for model.n_layers="
                             f"{self.n_layers}: give one (sliding | full) per layer")
        unknown = sorted({t for t in self.layer_types if t not in ("sliding", "full")})
        if unknown:
            raise ValueError(f"model.layer_types holds {unknown}: each entry is sliding or full")



@dataclass(frozen=True)
class ModuleSpec:
    """One module of the GPT in the architecture table (`GPTConfig.modules`)."""

    kind: str
    """linear (weight (out, in), no bias), embedding (weight (vocab, d)), norm (weight (dim,), no bias), experts
    (routed experts' stacked weights (E, out, in)) or sinks (attention sink logits (n_heads,))."""
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
                            mask: Union[MaskSpec, Sequence[MaskSpec]] = CAUSAL, v_head_dim: Optional[int] = None
                            ) -> int:
    """Training FLOPs per token (forward + backward): 6·N + 12·L·H·Q·T, PaLM appendix B (Chowdhery et al. 2022).

    6·N: each of the N matmul parameters costs one multiply-add (2 FLOPs) per token forward and twice that
    backward (gradient w.r.t. the input and w.r.t. the weight). 12·L·H·Q·T: the attention scores QKᵀ and the
    weighted sum over V, each 2·H·Q·T FLOPs per token per layer forward, times 3 for forward + backward.
    T is the keys a query is counted against, as the attention mask says (model/mask_spec.py
    `MaskSpec.scored_pairs`, over the window's T queries): the full T×T score matrix, as PaLM counts it, although
    causal attention needs only half of it; a sliding-window layer exactly the pairs its window keeps.
    mask: every layer's, or one per layer (`GPTConfig.mask_specs`). The attention term is rounded down.
    v_head_dim: the value heads' width where it differs from the query/key heads' head_dim (multi-head latent
    attention): the scores then cost 2·H·head_dim per pair and the weighted sum 2·H·v_head_dim; None: head_dim.
    """
    masks = [mask] * n_layers if isinstance(mask, MaskSpec) else list(mask)
    if len(masks) != n_layers:
        raise ValueError(f"{len(masks)} layer masks for {n_layers} layers")
    pairs = sum(m.scored_pairs(seq_len) for m in masks)  # over the window's seq_len queries
    v = head_dim if v_head_dim is None else v_head_dim
    return 6 * n_matmul_params + (6 * n_heads * (head_dim + v) * pairs // seq_len if seq_len else 0)
