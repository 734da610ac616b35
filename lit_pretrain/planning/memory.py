"""Per-device memory of training, as pure functions: model states and activations.

Model states follow Rajbhandari et al. 2019 (ZeRO, §3.1 and §5): Ψ parameters under mixed-precision Adam hold
2Ψ (fp16 parameters) + 2Ψ (fp16 gradients) + KΨ optimizer states with K = 12 (fp32 master parameters, momentum,
variance); ZeRO stage 1 divides the optimizer states by the data-parallel size N_d, stage 2 the gradients as well,
stage 3 the parameters as well (their Figure 1 and Table 1).
What our own runs hold (torch.optim.AdamW, states in the parameter dtype):
- "32-true": 4 (fp32 parameter) + 4 (fp32 gradient) + 8 (exp_avg, exp_avg_sq) bytes per parameter.
- "bf16-mixed" / "16-mixed": Lightning's MixedPrecision runs forward under torch.autocast; parameters, gradients
  and AdamW states stay fp32 (the same 4 + 4 + 8), and autocast additionally caches a 16-bit copy of every weight a
  matmul reads during the forward (2 bytes per matmul parameter, kept for the backward): `cast_weight_bytes`.
- "bf16-true": everything in bf16, 2 + 2 + 4 bytes per parameter.
- "bf16-mixed-policy": bf16-mixed under ZeRO-2/3 with FSDP2's MixedPrecisionPolicy (strategy.mixed_precision_policy,
  parallel/zero.py): fp32 sharded parameters, gradients and AdamW states (4 + 4 + 8), the gathered copies in bf16
  (2 bytes: under ZeRO-2 held from forward to backward beside the fp32 shard, under ZeRO-3 the root and two blocks
  at a time), no autocast copies; each block's unsharded bf16 gradient is cast to an fp32 buffer for the
  reduce-scatter (2 + 4 bytes transient). Activations in bf16 with the residual stream bf16 (2 bytes, so a fully
  checkpointed block keeps 2 bytes an element); the norms cast their input to fp32 and compute there
  (`block_activation_bytes(fp32_norms=True)`), and the linears read the norms' bf16 output, one storage for q, k, v.
Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
Table 2; s sequence length, b micro-batch, h hidden size, a heads, t tensor-parallel size), in bytes per layer for
16-bit activations with 1-byte dropout masks:
    no recomputation, tensor parallel          sbh·(10 + 24/t + 5·a·s/(h·t))   (t = 1: sbh·(34 + 5as/h))
    ... with sequence parallelism              sbh·(34/t + 5·a·s/(h·t))
    selective recomputation                    sbh·(10 + 24/t)
    selective + sequence parallelism           sbh·34/t
    full recomputation                         2·sbh  (only each layer's input is kept)
That table describes the paper's GPT block (LayerNorm, dropout, GELU MLP of 4h, softmax attention storing the
s×s scores); ours (RMSNorm, no dropout, SwiGLU, fused attention storing no scores) saves other tensors, counted by
`block_activation_bytes` and used by `memory_plan` without recomputation. Of the table's recomputation rows, full
keeps each block's input (2sbh, as ours does); our selective mode is torchtitan's op-level policy, not the paper's
attention-only recomputation, and `memory_plan` counts what it keeps with planning/recompute.py.
Under "bf16-mixed" / "16-mixed" (autocast) our block saves a mix, counted by `block_activation_bytes(autocast=True)`
and measured under CPU autocast by tests/planning/test_run_plan.py: the residual stream stays fp32 (the embedding is
fp32 and each block adds a 16-bit output to it), so both norms run and save in fp32; every linear saves its own 16-bit
cast of its input (autocast caches casts of weights only: q, k and v each cast the attention norm's output, gate and
up the MLP norm's); the linears' outputs, RoPE'd q and k (rotated in fp32, cast back) and the MLP are 16-bit.
With full activation checkpointing our block keeps only its input, in the residual stream's dtype (fp32 under
autocast), and the backward recomputes one block at a time, whose activations are then live on top: one block's
worth (`recompute_bytes`).
Transient buffers at the peak (the start of the backward, when every saved activation is still held), counted in
`transient_bytes`: the fp32 gradient of the logits (and under autocast its 16-bit cast for the head's matmul);
under ZeRO-3 (FSDP2, parallel/zero.py: one group per block and one for the root) the root's parameters (embedding,
final norm, head), gathered for the whole forward and again from the start of the backward, and the gathered
parameters of the block computed and the next one prefetched (Zhao et al. 2023, "PyTorch FSDP" §3.3-3.4);
under ZeRO-2 and 3 the unsharded gradients of one block and of the root's head before their reduce-scatter.
Not counted: the CUDA context, NCCL buffers, the allocator's fragmentation, the optimizer step's temporaries (they
come after the activations are freed): what `run_plan.MIN_HEADROOM` is kept free for.
Under 1F1B pipeline parallelism the first stage keeps p micro-batches of its L/p layers in flight, i.e. L layers'
worth whatever p is (§4.2.3); it also holds the input embedding. Logits for the cross-entropy are stored in fp32,
4·s·b·v/t bytes (§4.3), on the last stage. With model.loss_chunk_size C the head and loss run C positions at a time
and the backward recomputes each chunk's logits (model/losses.py chunked_lm_sums): s becomes C (C·t gathered under
sequence parallelism) in the logits row and its transient gradient, the one chunk live at the start of the backward.
Vocabulary terms under tensor parallelism, as the code holds them (parallel/vocab.py, Megatron-LM's
VocabParallelEmbedding, column-parallel output layer and vocab_parallel_cross_entropy; Shoeybi et al. 2019 §3): each
tensor-parallel rank keeps V/t rows of the embedding and of an untied head (v·d/t parameters each, their state and,
under ZeRO-3, their gathered copies likewise), computes only its (B, T, V/t) logits, and the cross-entropy saves
their fp32 softmax (4·s·b·v/t) and backward makes a gradient of the same size (`transient_bytes`).
For fp32 activations ("32-true") the 16-bit formulas are doubled (for the
recomputation rows an upper estimate: they count 1-byte dropout masks our model does not have).
"""

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

from lit_pretrain.errors import ConfigError
from lit_pretrain.model import shapes
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.mask_spec import CAUSAL, MaskSpec, layers_mask_bytes
from lit_pretrain.planning import recompute as recomputation


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state under one precision recipe."""

    param: int
    grad: int
    optimizer: int
    cast_weight: int  # 16-bit weight copies autocast keeps from forward to backward
    activation_factor: float  # multiplier of Korthikanti et al.'s 16-bit activation formulas
    residual: int = 2  # bytes of a residual-stream element (a fully checkpointed block keeps its input)
    autocast: bool = False  # forward under torch.autocast: our block's mixed count (block_activation_bytes)
    gathered: int = 0  # bytes of an FSDP2-gathered parameter when not the parameter's own (0: `param`)
    fp32_norms: bool = False  # 16-bit activations whose norms compute in fp32 (block_activation_bytes)
    grad_transient: int = 0  # bytes of an unsharded gradient before its reduce-scatter when not `grad`'s (0: grad)


PRECISIONS: Dict[str, StateBytes] = {
    "zero-mixed-adam": StateBytes(2, 2, 12, 0, 1.0),  # Rajbhandari et al. 2019 §3.1, K = 12
    "32-true": StateBytes(4, 4, 8, 0, 2.0, residual=4),
    "bf16-mixed": StateBytes(4, 4, 8, 2, 1.0, residual=4, autocast=True),
    "16-mixed": StateBytes(4, 4, 8, 2, 1.0, residual=4, autocast=True),
    "bf16-true": StateBytes(2, 2, 4, 0, 1.0),
    "bf16-mixed-policy": StateBytes(4, 4, 8, 0, 1.0, residual=2, gathered=2, fp32_norms=True, grad_transient=6),
}
CHECKPOINTING = ("none", "selective", "full", "every_k")


def model_state_bytes(params: float, data_parallel: int = 1, zero_stage: int = 0,
                      precision: str = "zero-mixed-adam") -> Dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimizer states for `params` parameters held by a rank before
    data-parallel sharding (Rajbhandari et al. 2019, Figure 1: (2 + 2 + K)·Ψ, divided by N_d per ZeRO stage)."""
    b = _precision(precision)
    _check_parallel(data_parallel, zero_stage)
    nd = data_parallel
    # ZeRO-2 holds the gathered parameters through the step; in another dtype than the master, beside its shard
    gathered_z2 = b.param * params / nd + b.gathered * params if b.gathered and zero_stage == 2 else None
    out = {"param_bytes": gathered_z2 if gathered_z2 is not None else b.param * params / (nd if zero_stage >= 3 else 1),
           "grad_bytes": b.grad * params / (nd if zero_stage >= 2 else 1),
           "optimizer_bytes": b.optimizer * params / (nd if zero_stage >= 1 else 1)}
    out["model_state_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optimizer_bytes"]
    return out


def per_rank_model_state_bytes(cfg: GPTConfig, world_size: int, zero_stage: int, precision: str = "32-true",
                               exact: bool = True) -> Dict[str, float]:
    """Per-rank param/grad/optimizer bytes of a GPT under data parallelism with ZeRO stage `zero_stage`.

    exact=True sums per-tensor shards the way FSDP2 lays them out: each parameter is split along dim 0 into
    world_size chunks padded to ceil(dim0 / world_size) rows, so a rank holds ceil(dim0/ws)·(numel/dim0)
    elements of every sharded tensor. exact=False divides the total by world_size (the ZeRO paper's accounting).
    """
    b = _precision(precision)
    _check_parallel(world_size, zero_stage)
    if not exact:
        return model_state_bytes(shapes.params(cfg), world_size, zero_stage, precision)
    full = shapes.params(cfg)
    sharded = sum(math.ceil(s[0] / world_size) * math.prod(s[1:]) for s in shapes.param_shapes(cfg).values())
    out = {"param_bytes": b.param * (sharded if zero_stage >= 3 else full),
           "grad_bytes": b.grad * (sharded if zero_stage >= 2 else full),
           "optimizer_bytes": b.optimizer * (sharded if zero_stage >= 1 else full)}
    out["model_state_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optimizer_bytes"]
    return out


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, tensor_parallel: int = 1,
                               sequence_parallel: bool = False, activation_checkpointing: str = "none") -> float:
    """Korthikanti et al. 2022, Table 2: bytes of one transformer layer's stored activations (16-bit)."""
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tensor_parallel
    if activation_checkpointing not in CHECKPOINTING[:3]:
        raise ConfigError(f"--activation-checkpointing must be one of {', '.join(CHECKPOINTING[:3])}, got "
                          f"{activation_checkpointing!r}")
    if sequence_parallel and t == 1:
        raise ConfigError("--sequence-parallel splits activations over the tensor-parallel group: it needs "
                          "--tensor-parallel > 1")
    sbh = s * b * h
    if activation_checkpointing == "full":
        return 2.0 * sbh
    attention = 0.0 if activation_checkpointing == "selective" else 5.0 * a * s / (h * t)
    rest = 34.0 / t if sequence_parallel else 10.0 + 24.0 / t
    return sbh * (rest + attention)


def attention_gate_width(cfg: GPTConfig) -> int:
    """Gates per head of model.attention_gate: 0 (none), 1 (headwise) or head_dim (elementwise)."""
    return {None: 0, "headwise": 1, "elementwise": cfg.head_dim}[cfg.attention_gate]


def block_activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, mlp_hidden: int,
                           tensor_parallel: int = 1, sequence_parallel: bool = False,
                           bytes_per_element: float = 4.0, *, kv_heads: Optional[int] = None, mlp: str = "swiglu",
                           norm: str = "rmsnorm", qk_norm: bool = False, autocast: bool = False, moe=None,
                           fp32_norms: bool = False, context_parallel: int = 1, mla=None, sinks: bool = False,
                           gate_width: int = 0) -> float:
    """Bytes one of OUR blocks (model.py: pre-norms, RoPE, fused causal attention, MLP; no dropout, no biases)
    saves for backward on one tensor-parallel rank, without recomputation, counted by storage as
    parallel/memory.py's SavedActivations measures (a tensor saved by several ops counts once; weights and the RoPE
    tables are not activations). N = seq_len · micro_batch tokens, h hidden, f = mlp_hidden, a heads, g = kv_heads
    key/value heads of Q = h/a channels, t ranks.

    - Norm region, 4Nh + 2N elements: each of the two RMSNorms (composite on CPU: x · rsqrt(mean(x²) + eps) · w)
      saves its input x (N·h), the normalized x̂ for the weight's gradient (N·h) and rsqrt(...) (N); a LayerNorm
      (one fused kernel) saves x, its mean and rstd: 2Nh + 4N. Replicated under tensor parallelism; under
      sequence parallelism each rank holds T/t positions: divided by t.
    - Column-parallel inputs, 2Nh: each norm's output, saved once by the linears that read it (q, k, v; gate, up).
      Replicated under tensor parallelism and, in our sequence parallelism, the all-gathered tensor is what they
      save (parallel/sequence.py says why): never divided by t.
    - Attention, (2Nh + 2NgQ)/t: RoPE'd q, k and v (the kernel's inputs; with grouped-query attention SDPA's
      enable_gqa reads the g key/value heads without expanding them) and its output (also wo's input: one
      storage); RoPE saves nothing but the tables. Plus the kernel's log-sum-exp, N·a/t elements, always fp32
      (4 bytes). No s×s scores: the fused kernel recomputes them, so the paper's 5as/h term is absent.
      QK-norm adds, per q and k, its input, x̂ and rsqrt: (2Nh + Na + 2NgQ + Ng)/t.
    - MLP: SwiGLU 4Nf/t (gate and up projections, silu(gate), the product: w_down's input); GELU 2Nf/t (up's
      output, gelu's: w_down's input).
    - A mixture-of-experts MLP (moe = (E experts, k per token, expert width f_e, s shared experts), replacing the
      MLP term): the routed experts' input and their gate and up projections over the R = kN token copies, R·h +
      2R·f_e (lit_pretrain/model/moe_kernels.py recomputes silu and the product in backward; no copy is padded),
      4sNf_e for the shared experts, 2kNh for the copies' outputs (kept by their weighting) and the weighted
      copies (kept by index_add_), 2NE fp32 router scores and 32kN bytes of int64 routing indices. Measured
      against SavedActivations within 1% (tests/model/test_moe.py): the rest is a few per-token scalars of the routing.
      Under tensor parallelism the router routes the whole micro-batch on every rank, with or without sequence
      parallelism, so the copies' input and outputs (R·h + 2kNh) stay whole on every rank; the routed experts'
      gate and up projections (2R·f_e) are split along the expert width and divided by t, as the shared experts'
      term is (parallel/expert_tensor.py).
    - Context parallelism over c ranks (parallel/context.py): every term above counts this rank's N/c tokens, and
      attention saves the all-gathered keys and values of the whole window (2NgQ/t, in place of this rank's
      2NgQ/(ct)) and, beside its output as wo's input, the two chunks' outputs apart (N·h/(ct) more). Per forward,
      not per block (`context_forward_bytes`): the RoPE tables at this rank's positions.
    - Latent attention (mla = (d_qk, d_v, kv_lora_rank r, qk_rope_head_dim, q_lora_rank or None); model/mla.py),
      replacing the attention term: per head q, k, the values zero-padded to d_qk and the padded output
      (4N·a·d_qk/t), wo's input (N·a·d_v/t); replicated on every tensor-parallel rank, the latent side: wkv_a's
      output (kv_norm's input, N(r + rope)), kv_norm's x̂ and rsqrt (Nr + N), wkv_b's input (Nr), and with query
      compression wq_a's output, q_norm's x̂ and rsqrt and wq_b's input (3N·q_lora + N). Values as wide as the
      queries are not padded: v is then a view of wkv_b's output (N·a·(d_qk - rope + d_v)) and the output is wo's
      input. Measured exact against SavedActivations in fp32 (tests/model/test_mla.py); under context parallelism
      the gathered keys and padded values of the whole window are counted as for multi-head attention.
    - Attention sinks (`sinks`, model.attention_sinks; model/mask.py `with_sinks`): SDPA takes its math path, which
      saves the scaled q and the output's copy for wo (2Nh), k and v with the sink's zero key appended, expanded to
      the a heads (2·b·K·h for K keys a query row's calls hold: T + 1 on one process) and the probabilities
      (b·a·P, P = T·(T + 1)), in place of the fused kernel's q, k, v, output and log-sum-exp. Under context
      parallelism each of a rank's two chunks of m = T/(2c) queries calls over the keys up to its end plus the
      sink: K = (2c + 1)m + 2, P = m·K (equal to the saved-tensor hooks at c = 2 with the RoPE tables of
      `context_forward_bytes`, measured once; no test holds it); document masking's single call (K = T + 1,
      P = (T/c)(T + 1)) is not what this counts.
    - The attention gate (`gate_width` = 1 headwise, Q elementwise; model.attention_gate): sigmoid's output
      (N·a·gate_width) and the gated output, wo's input (Nh), both split over t.
    Total: e·[norm region/(t if sequence parallel else 1) + 2Nh + (attention + MLP)/t] + 4Na/t bytes, e the
    activation's bytes per element (4 for fp32). The residual additions and the logit soft-cap (outside the
    blocks) are not counted here.
    autocast (bf16-mixed, 16-mixed; e = 2): the norm region is fp32 (4 bytes: the residual stream is fp32), and each
    column-parallel linear saves its own cast of its input: 3Nh (q, k, v) + 2Nh (SwiGLU's gate, up; GELU: Nh) in
    place of 2Nh.
    fp32_norms (bf16-mixed-policy; e = 2): the residual stream is bf16 and each norm casts it to fp32 and computes
    there, so the norm region is fp32 (4 bytes), plus each norm's weight cast to fp32 (h, 4 bytes); the linears
    read the norm's bf16 output (2Nh, as without autocast). Measured for RMSNorm without QK-norm (tests/
    test_mixed_precision.py); QK-norm's terms are counted at e bytes, an estimate (they too run in fp32).
    """
    c = context_parallel
    whole_n = seq_len * micro_batch
    n, h, f, a, t = whole_n // c, hidden, mlp_hidden, heads, tensor_parallel
    g = heads if kv_heads is None else kv_heads
    kv = g * (h // a)  # key/value channels
    if sequence_parallel and t == 1:
        raise ConfigError("--sequence-parallel splits activations over the tensor-parallel group: it needs "
                          "--tensor-parallel > 1")
    per_norm = 2 * n * h + n if norm == "rmsnorm" else n * h + 2 * n
    norm_region = 2 * per_norm / (t if sequence_parallel else 1)
    column_inputs = 2 * n * h
    attention = 2 * n * h + 2 * n * kv
    if qk_norm:
        attention += 2 * n * h + n * a + 2 * n * kv + n * g
    if c > 1 and not sinks:  # the gathered keys and values of the window in place of this rank's; the chunks' outputs
        attention += 2 * (whole_n - n) * kv + n * h
    lse = 4.0 * n * a / t  # the fused kernel's log-sum-exp, fp32
    if sinks:  # the math path's tensors in place of the fused kernel's (see above)
        m = seq_len // (2 * c)
        keys = seq_len + 1 if c == 1 else (2 * c + 1) * m + 2
        probabilities = seq_len * (seq_len + 1) if c == 1 else m * keys
        attention += 2 * micro_batch * keys * h + micro_batch * a * probabilities - 2 * n * kv
        lse = 0.0
    if gate_width:
        attention += n * h + n * a * gate_width
    mlp_elements = (4 if mlp == "swiglu" else 2) * n * f
    routing_bytes = replicated = 0.0
    if mla is not None:
        qk, vd, r, rope, q_lora = mla
        if vd < qk:  # q, k, the padded values and output; wo's input (mla._sdpa)
            attention = 4 * n * a * qk + n * a * vd + 2 * (whole_n - n) * a * qk
        else:  # q, k, wkv_b's output (v is its view); the output, which is wo's input
            attention = 2 * n * a * qk + n * a * (qk - rope + vd) + n * a * vd + (whole_n - n) * a * (qk + vd)
        replicated = n * (r + rope) + n + 2 * n * r + (3 * n * q_lora + n if q_lora else 0)
    if moe is not None:
        experts, k, f_e, shared = moe
        rows = k * n
        mlp_elements = 4 * shared * n * f_e + 2 * rows * f_e  # split over t: the experts' hidden units
        replicated = rows * h + 2 * k * n * h  # the copies in and out of the experts: the same on every TP rank
        routing_bytes = 4.0 * 2 * n * experts + 32.0 * k * n
    sharded = (attention + mlp_elements) / t + replicated
    if fp32_norms:
        weights = 4.0 * 2 * h  # the two norms' weights cast to fp32
        return 4.0 * norm_region + bytes_per_element * (column_inputs + sharded) + lse + routing_bytes + weights
    if autocast:
        # q, k, v and the MLP's column linears each save their own cast; an MoE block's router saves one cast of
        # its input and its experts' input is already counted (R·h; estimated, not measured under autocast).
        column_inputs = (3 + (1 if moe is not None else 2 if mlp == "swiglu" else 1)) * n * h
        return 4.0 * norm_region + bytes_per_element * (column_inputs + sharded) + lse + routing_bytes
    return bytes_per_element * (norm_region + column_inputs + sharded) + lse + routing_bytes


def context_forward_bytes(seq_len: int, micro_batch: int, head_dim: int, context_parallel: int,
                          document_masking: bool = False) -> float:
    """Bytes a context-parallel forward saves once for all its blocks (parallel/context.py): the fp32 RoPE tables
    cos and sin at this rank's seq_len/c positions, (T/c, head_dim) each, or per row (B, T/c, head_dim) under
    document masking. One process saves none: its tables are the model's buffers."""
    if context_parallel == 1:
        return 0.0
    rows = micro_batch if document_masking else 1
    return 4.0 * 2 * rows * seq_len // context_parallel * head_dim


def context_mask_bytes(seq_len: int, context_parallel: int, bytes_per_element: float = 4.0,
                       masks: Sequence[MaskSpec] = (CAUSAL,)) -> float:
    """The additive causal mask a context-parallel rank passes to SDPA off the GPU, once per forward (model/mask.py
    `sdpa_mask`, shared by both chunks and every layer): T/(2c) queries over the window's T keys, as
    `MaskSpec.mask_bytes` counts it. On CUDA, PyTorch's CausalBias needs none, so `memory_plan` leaves it out; CPU
    measurements add it. masks: the layers' (`GPTConfig.mask_specs`): a binding sliding window adds its boolean
    (T/c, T) mask, on any device (`mask_bytes`)."""
    return layers_mask_bytes(masks, seq_len, 1, context_parallel, bytes_per_element)


def context_transient_bytes(cfg: GPTConfig, micro_batch: int, context_parallel: int, tensor_parallel: int = 1,
                            bytes_per_element: float = 4.0) -> float:
    """The all-gathered K/V transient of a context-parallel backward, one block at a time: the gradient of the
    window's keys and values and its rank-major copy, the reduce-scatter's input (parallel/context.py GatherKV),
    2 x 2·B·T·g·Q/t elements."""
    if context_parallel == 1:
        return 0.0
    kv = cfg.kv_heads * cfg.head_dim // tensor_parallel
    return bytes_per_element * 2 * 2 * micro_batch * cfg.seq_len * kv


def memory_plan(plan, cfg: GPTConfig, micro_batch: int, precision: str = "zero-mixed-adam",
                device_memory: Optional[float] = None, exact: bool = False) -> dict:
    """Per-device bytes of the most loaded rank: the first pipeline stage (all layers' worth of activations under
    1F1B, plus the embedding); with a single stage it also holds the fp32 logits.
    plan: the layout (parallel/plan.ParallelPlan): its degrees, ZeRO stage, sequence parallelism and activation
    checkpointing. Model state is sharded at zero_stage over data_parallel_shard x context_parallel ranks (FSDP2's
    group, parallel/mesh.py fsdp_dims; under HSDP not the replicas): `data_parallel` below.
    activation_checkpointing: none (our block's count), selective (torchtitan's op policy: the block's input, its
    saved matmul and attention outputs, with model.moe also the router's, the grouped experts' and the router's
    top-k, planning/recompute.py; `activation_checkpointing_save_matmuls` all or every_other), full (our block's
    input in the residual dtype), every_k (blocks 0, k, 2k, ... full, the others none). "recompute_flops": the
    matmul and attention FLOPs the backward runs again on this rank per micro-batch (planning/recompute.py's
    convention, FlopCounterMode's).
    exact: model states from `per_rank_model_state_bytes` (FSDP2's padded dim-0 shards); data parallelism only.
    tensor_parallel (model.moe): the routed experts are split along their width like the dense MLP (parameters,
    gradients, AdamW state and their hidden activations divided by t); the router is replicated.
    expert_parallel (model.moe): each rank holds 1/expert_parallel of every MoE layer's routed experts (of their
    tensor-parallel slices: E/P experts x 1/t of their width), their state sharded at zero_stage over
    `expert_data_parallel` ranks (the ranks holding the same experts: replicas x shards x context ranks / P); the
    dense part as before. Activations are unchanged: a rank computes the token copies routed to its experts, as
    many as its own on average (parallel/expert.py).
    context_parallel (c): each rank computes seq_len/c positions of every window, so activations, logits and the
    checkpointed inputs fall by c, attention keeps the gathered keys and values of the whole window
    (block_activation_bytes), the forward keeps its RoPE tables at its positions (context_forward_bytes) and the
    backward the gathered K/V's gradient one block at a time (context_transient_bytes). Model state is sharded
    over `data_parallel`, data_parallel_shard x context_parallel (FSDP2's group)."""
    context_parallel, zero_stage, expert_parallel = plan.context_parallel, plan.zero_stage, plan.expert_parallel
    data_parallel = plan.data_parallel_shard * context_parallel
    expert_data_parallel = max(1, plan.data_parallel_replicate * data_parallel // expert_parallel)
    tensor_parallel, pipeline_parallel, sequence_parallel = plan.tensor_parallel, plan.pipeline_parallel, \
        plan.sequence_parallel
    activation_checkpointing, activation_checkpointing_k = plan.activation_checkpointing, \
        plan.activation_checkpointing_k
    activation_checkpointing_save_matmuls = plan.activation_checkpointing_save_matmuls
    b = _precision(precision)
    _check_parallel(data_parallel, zero_stage)
    t, p, L = tensor_parallel, pipeline_parallel, cfg.n_layers
    if t < 1 or p < 1:
        raise ConfigError("--tensor-parallel and --pipeline-parallel must be at least 1")
    if cfg.n_heads % t or cfg.kv_heads % t:
        raise ConfigError(f"--tensor-parallel {t} must divide --heads {cfg.n_heads} and the key/value heads "
                          f"{cfg.kv_heads} (tensor parallelism splits whole heads)")
    if cfg.vocab_size % t:
        raise ConfigError(f"--tensor-parallel {t} must divide --vocab {cfg.vocab_size} (the embedding and head split "
                          f"their rows over the tensor-parallel ranks, parallel/vocab.py): choose a multiple of {t}")
    if cfg.moe is not None and cfg.d_ff_expert % t:
        raise ConfigError(f"--tensor-parallel {t} must divide the experts' width {cfg.d_ff_expert} (model.moe."
                          "d_ff_expert: tensor parallelism splits every routed expert along it)")
    if p > L:
        raise ConfigError(f"--pipeline-parallel {p} exceeds --layers {L}: every stage needs at least one layer")
    if activation_checkpointing not in CHECKPOINTING:
        raise ConfigError(f"--activation-checkpointing must be one of {', '.join(CHECKPOINTING)}, got "
                          f"{activation_checkpointing!r}")
    if activation_checkpointing == "every_k" and activation_checkpointing_k < 1:
        raise ConfigError(f"--activation-checkpointing-k must be at least 1, got {activation_checkpointing_k}")
    layers_here = math.ceil(L / p)
    d, v = cfg.d_model, cfg.vocab_size
    norms = shapes.block_norm_params(cfg)  # norm weights are replicated across the tensor-parallel group
    # The first stage holds its layers and the vocabulary-parallel embedding (V/t rows, parallel/vocab.py); with one
    # stage also the final norm and, untied, the head (V/t rows too). Tensor parallelism splits every matrix by t
    # (Megatron-LM's column/row and vocab splits, the routed experts' along their width) but an MoE block's router,
    # replicated over the group (parallel/moe_mesh.py); with model.moe the larger of a dense and an MoE block.
    # Expert parallelism splits the routed experts' tensor-parallel slices further, by expert.
    local_block = max((block - norms - kept) / t + norms + kept
                      for block, kept in shapes.block_params_replicated(cfg))
    routed_block = 3 * cfg.moe.num_experts * cfg.d_ff_expert * cfg.d_model if cfg.moe is not None else 0
    local = layers_here * local_block + v * d / t
    if p == 1:
        local += d + (0 if cfg.tie_embeddings else v * d / t)
    if exact and (t > 1 or p > 1):
        raise ConfigError("--exact sums FSDP2's per-tensor shards under data parallelism alone: drop --exact or "
                          "set --tensor-parallel 1 --pipeline-parallel 1")
    ep = expert_parallel
    # this stage's routed-expert parameters (of its MoE layers, at most layers_here), this rank's 1/t of each
    routed = min(layers_here, sum(cfg.is_moe_layer(i) for i in range(L))) * routed_block / t
    if ep < 1 or (ep > 1 and (cfg.moe is None or cfg.moe.num_experts % ep)):
        raise ConfigError(f"--expert-parallel {ep} must be at least 1 and, above 1, divide the MoE's routed experts")
    if exact and ep > 1:
        raise ConfigError("--exact sums FSDP2's per-tensor shards under data parallelism alone: drop --exact or "
                          "set --expert-parallel 1")
    if exact:
        states = per_rank_model_state_bytes(cfg, data_parallel, zero_stage, precision, exact=True)
    elif ep > 1:
        edp = expert_data_parallel
        dense_states = model_state_bytes(local - routed, data_parallel, zero_stage, precision)
        expert_states = model_state_bytes(routed / ep, edp, zero_stage, precision)
        states = {k: dense_states[k] + expert_states[k] for k in dense_states}
        local -= routed * (1 - 1 / ep)
    else:
        states = model_state_bytes(local, data_parallel, zero_stage, precision)
    m = cfg.moe  # with model.moe the larger of a dense and an MoE block (a pipeline stage may hold either)
    moe_shape = (m.num_experts, m.top_k, cfg.d_ff_expert, m.num_shared_experts) if m is not None else None
    latent = None if cfg.attention != "mla" else (cfg.qk_head_dim, cfg.value_head_dim, cfg.mla.kv_lora_rank,
                                                  cfg.mla.qk_rope_head_dim, cfg.mla.q_lora_rank)
    whole = max(block_activation_bytes(cfg.seq_len, micro_batch, d, cfg.n_heads, cfg.hidden_dim, t, sequence_parallel,
                                       2.0 * b.activation_factor, kv_heads=cfg.kv_heads, mlp=cfg.mlp, norm=cfg.norm,
                                       qk_norm=cfg.qk_norm, autocast=b.autocast, fp32_norms=b.fp32_norms,
                                       moe=(m.num_experts, m.top_k, cfg.d_ff_expert, m.num_shared_experts)
                                       if moe_layer else None, context_parallel=context_parallel, mla=latent,
                                       sinks=cfg.attention_sinks, gate_width=attention_gate_width(cfg))
                for moe_layer in {cfg.is_moe_layer(i) for i in range(cfg.n_layers)})
    # What a fully checkpointed block keeps: its input, in the residual stream's dtype (sharded along the sequence
    # under sequence parallelism).
    cp = context_parallel
    if cp < 1 or cfg.seq_len % (2 * cp):
        raise ConfigError(f"--context-parallel {cp} must be at least 1 and 2 x it divide --seq-len {cfg.seq_len}")
    kept = b.residual * cfg.seq_len * micro_batch * d / (t if sequence_parallel else 1) / cp
    if activation_checkpointing == "none":  # our block's own count
        per_layer = whole
    elif activation_checkpointing == "full":
        per_layer = kept
    elif activation_checkpointing == "every_k":
        checkpointed = math.ceil(layers_here / activation_checkpointing_k)  # blocks 0, k, 2k, ...
        per_layer = (checkpointed * kept + (layers_here - checkpointed) * whole) / layers_here
    else:  # with model.moe the larger of a dense and an MoE block, as `whole`
        per_layer = max(recomputation.selective_block_bytes(
            cfg.seq_len, micro_batch, d, cfg.n_heads, cfg.hidden_dim, t, sequence_parallel, 2.0 * b.activation_factor,
            kv_heads=cfg.kv_heads, mlp=cfg.mlp, residual_bytes=b.residual,
            save_matmuls=activation_checkpointing_save_matmuls, moe=moe_shape if moe_layer else None)
            for moe_layer in {cfg.is_moe_layer(i) for i in range(cfg.n_layers)})
    # The backward recomputes one checkpointed block at a time: its activations are live on top of the kept ones
    # (under selective an upper estimate: the saved outputs among them are the cached ones, not new).
    recompute = 0.0 if activation_checkpointing == "none" else whole
    checkpointed = {"none": 0, "full": layers_here, "selective": layers_here,
                    "every_k": math.ceil(layers_here / activation_checkpointing_k)}[activation_checkpointing]
    ac_mode = "full" if activation_checkpointing == "every_k" else activation_checkpointing
    # Each checkpointed block of the first stage (layers 0 .. layers_here - 1) recomputes as its kind, dense or MoE.
    flops_of = {moe_layer: recomputation.recompute_flops(
        ac_mode, cfg.seq_len, micro_batch, d, cfg.n_heads, cfg.hidden_dim, t, kv_heads=cfg.kv_heads, mlp=cfg.mlp,
        save_matmuls=activation_checkpointing_save_matmuls, moe=moe_shape if moe_layer else None)
        for moe_layer in (False, True)}
    ids = range(0, layers_here, activation_checkpointing_k if activation_checkpointing == "every_k" else 1) \
        if checkpointed else ()
    recompute_flops = {k: sum((flops_of[cfg.is_moe_layer(i)][k] for i in ids), 0.0) for k in flops_of[False]}
    # 1F1B: the first stage has p micro-batches of its L/p layers in flight (Korthikanti et al. §4.2.3)
    activations = per_layer * layers_here * p
    tokens = cfg.seq_len * micro_batch // cp  # this rank's
    if cfg.loss_chunk_size is not None:  # one chunk's logits at a time (recomputed in the backward), gathered
        # over the sequence-parallel ranks before the head (model/losses.py chunked_lm_sums)
        tokens = micro_batch * min(cfg.loss_chunk_size * (t if sequence_parallel else 1), cfg.seq_len // cp)
    logits = 4.0 * tokens * v / t if p == 1 else 0.0
    if p == 1:  # model.mtp_depth (refused with pipelines): each module keeps a block's activations and its own
        # fp32 logits for the backward (one chunk's with model.loss_chunk_size), model/mtp.py
        activations += cfg.mtp_depth * (per_layer + logits)
    activation_elements = 2.0 * b.activation_factor  # bytes of an activation element (fp32: 4)
    context = context_forward_bytes(cfg.seq_len, micro_batch, cfg.head_dim, cp) + context_transient_bytes(
        cfg, micro_batch, cp, t, activation_elements)
    # model.sliding_window: the boolean mask of this stage's window layers, kept by SDPA for the backward (none
    # without a binding window on CUDA, whose kernels take the causal mask as a flag)
    masks = layers_mask_bytes(cfg.mask_specs()[:layers_here], cfg.seq_len, micro_batch, cp, cuda=True)
    # autocast casts the weight a matmul reads (the blocks' linears and the head, not the embedding's lookup),
    # gathered in full under ZeRO-3, and saves the copy for the backward
    matmul_params = layers_here * (local_block - norms) + (v * d / t if p == 1 else 0) - routed * (1 - 1 / ep)
    cast = b.cast_weight * matmul_params
    transient = _transient_bytes(b, cfg, zero_stage, t, p, local_block, logits, tokens)
    total = states["model_state_bytes"] + cast + activations + logits + recompute + transient + context + masks
    out = {
        "params": shapes.params(cfg), "active_params": shapes.active_params(cfg), "params_per_device": local,
        "precision": precision,
        "data_parallel": data_parallel, "zero_stage": zero_stage, "tensor_parallel": t, "pipeline_parallel": p,
        "expert_parallel": ep, "expert_data_parallel": expert_data_parallel, "context_parallel": cp,
        "context_parallel_bytes": context,
        "sequence_parallel": sequence_parallel, "activation_checkpointing": activation_checkpointing,
        "micro_batch": micro_batch, "seq_len": cfg.seq_len, "layers_per_stage": layers_here,
        **states, "cast_weight_bytes": cast, "activation_bytes_per_layer": per_layer,
        "activation_bytes": activations + logits, "logits_bytes": logits, "recompute_bytes": recompute,
        "transient_bytes": transient, "total_bytes": total, "recompute_flops": recompute_flops,
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg), "mask_bytes": masks,
    }
    if device_memory is not None:
        out["device_memory"] = device_memory
        out["fits"] = total <= device_memory
    return out


def _transient_bytes(b: StateBytes, cfg: GPTConfig, zero_stage: int, t: int, p: int, local_block: float,
                     logits: float, tokens: int) -> float:
    """Buffers live at the start of the backward besides the saved activations (see the module docstring)."""
    out = 0.0
    if p == 1:  # the fp32 gradient of the logits; under autocast (or bf16 gathered weights) also its 16-bit cast
        out += logits + (2.0 * tokens * cfg.vocab_size / t if b.autocast or b.fp32_norms else 0.0)
    # FSDP2 (also on one rank) all-gathers into a full buffer beside the rank's shard, reduce-scatters from a full one
    if zero_stage >= 3:  # gathered: the root (embedding, final norm, untied head), the block computed, the prefetched
        root = cfg.vocab_size * cfg.d_model / t * (1 if cfg.tie_embeddings or p > 1 else 2) + cfg.d_model
        out += (b.gathered or b.param) * (root + 2 * local_block)
    if zero_stage >= 2:  # one block's and the head's gradient, unsharded until their reduce-scatter
        out += (b.grad_transient or b.grad) * (local_block + (cfg.vocab_size * cfg.d_model / t if p == 1 else 0.0))
    return out


def kv_cache_bytes_per_token(cfg: GPTConfig, bytes_per_element: float = 2.0) -> float:
    """Bytes a KV cache holds for each token of context, over every layer (model/gpt.py KVCache, as `generate`
    allocates it): n_layers · heads · (key width + value width) · bytes_per_element (default 2: bf16 decoding).
    Grouped-query attention keeps 2·n_kv_heads·head_dim numbers a token a layer; latent attention its latent and
    shared rotated key, kv_lora_rank + qk_rope_head_dim (DeepSeek-V2 §2.1.4, table 1). Llama 3 8B in bf16:
    32 · 8 · 256 · 2 = 131,072 B; DeepSeek-V3: 61 · (512 + 64) · 2 = 70,272 B."""
    heads, k, v = cfg.kv_cache_layout
    return bytes_per_element * cfg.n_layers * heads * (k + v)


def parse_bytes(text: str) -> float:
    """'80GB' -> 8e10, '80GiB' -> 80·2^30, '1.5e9' -> 1.5e9 (plain numbers are bytes)."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "B": 1}
    raw = text.strip().upper()
    for unit, factor in units.items():
        if raw.endswith(unit):
            raw, scale = raw[: -len(unit)], factor
            break
    else:
        scale = 1
    try:
        value = float(raw) * scale
    except ValueError:
        raise ConfigError(f"--device-memory {text!r} is not a size: write e.g. 80GB, 141GiB or 8e10") from None
    if value <= 0:
        raise ConfigError(f"--device-memory must be positive, got {text!r}")
    return value


def _precision(name: str) -> StateBytes:
    if name not in PRECISIONS:
        raise ConfigError(f"--precision {name!r} is not one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def _check_parallel(data_parallel: int, zero_stage: int) -> None:
    if data_parallel < 1:
        raise ConfigError(f"--data-parallel must be at least 1, got {data_parallel}")
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage}")
