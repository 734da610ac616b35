"""Bytes each rank moves per optimizer step, by collective, as pure functions of the model's shape and the layout.

Convention (what bench/parallel/compositions.py's counting wrapper measures): the size of the whole tensor a collective
works on, per call, summed over a step: an all-reduce's tensor, an all-gather's output (the gathered whole), a
reduce-scatter's input (the whole before scattering). A ring moves (n-1)/n of that over each rank's link; the
convention leaves that factor out, so the figures are independent of the algorithm gloo picks.

Notation: L blocks, d = d_model, f = the MLP width (SwiGLU's hidden_dim), V the vocabulary, B the sequences one
rank's forward sees (its share of the global batch), T = seq_len, t the tensor-parallel degree, w the FSDP shard
degree, e bytes per element (4 in fp32). The GPT's parameters (model/gpt.py), with the embedding tied to the head:
per block wq, wk, wv, wo (d x d), w_gate, w_up (f x d), w_down (d x f), attn_norm, mlp_norm (d); outside the blocks
tok_embeddings (V x d, also the head) and the final norm (d).

ZeRO-3 (FSDP2 `fully_shard` on each block, then on the root; `reshard_after_forward=True`), per rank per step:
- FSDP2 shards every parameter along dim 0, padded to a multiple of w: a (n0, n1) parameter costs
  ceil(n0 / w) * w * n1 elements in the all-gather output and in the reduce-scatter input (`padded`).
- each group is all-gathered for its forward, freed, and all-gathered again for its backward: 2 x (blocks + root).
  The root group (embedding/head, final norm) too: measured on torch 2.13, 2 (L + 1) all-gather calls per step
  (FSDP1 and older FSDP2 kept the root gathered after forward, which would make it 2 P_blocks + P_root);
- every group's gradient is reduce-scattered once, after its backward: 1 x (blocks + root);
- our grad_norm all-reduces one fp32 scalar over the shard group (and a (dense, experts) pair over each
  tensor-parallel or pipeline group of size > 1).
  all_gather = 2 e (P_blocks + P_root),  reduce_scatter = e (P_blocks + P_root)  (P: padded element counts)
ZeRO-2 (`reshard_after_forward=False`) gathers every group once: all_gather = e (P_blocks + P_root) (not measured).
HSDP adds an all-reduce of each reduce-scattered shard over the replicas: e (P_blocks + P_root) / w.

Tensor parallelism (parallel/tensor.py), per block: forward, g all-reduces the (B, T, d) output of wo and of
w_down (2 all-reduces); backward, f all-reduces the input gradient of every column-parallel linear. Our f sits in
each ColumnParallelLinear, so wq, wk, wv, w_gate and w_up each all-reduce (B, T, d) (5 per block, where Megatron's
f, once per attention and MLP input, makes it 2). The vocabulary-parallel ends (parallel/vocab.py): the embedding's
g all-reduces its (B, T, d) partial lookups forward, the head's f its (B, T, d) input gradient backward, and the
cross-entropy all-reduces one fp32 per position for the max and two (sum of exponentials, target logit) for the
rest: 3 B T. The norms need nothing: f's sum makes their gradients equal on every rank. With data-parallel
replicas (no FSDP) `sync_gradients` all-reduces every local gradient once (the TP slices: 1/t of the block
matrices and of the embedding, whole norms).
  all_reduce = e B T d (L (2 + 5) + 2) + 3 e B T  [+ e * local parameters with replicas]

Tensor + sequence parallelism (parallel/sequence.py), per block: before attention and MLP an all-gather (forward)
and its reduce-scatter (backward); after wo and w_down a reduce-scatter (forward) and its all-gather (backward),
each on the whole (B, T, d). At the edges: the embedding reduce-scatters its partial lookups (forward) and
all-gathers its gradient (backward); the head's input is all-gathered (forward) and its gradient reduce-scattered
(backward). The norms' weight gradients are summed over the group once per step, (2L + 1) d, and the
cross-entropy all-reduces 3 B T as without sequence parallelism.
  all_gather = e B T d (4L + 2),  reduce_scatter = e B T d (4L + 2),  all_reduce = e (d (2L + 1) + 3 B T)
  [+ replicas' gradients]
Context parallelism over c ranks (parallel/context.py), per block: forward, one all-gather of this rank's keys and
values stacked, whose output is the window's (2, B, T, g·Q); backward, one reduce-scatter of their gradient, whose
input is the same size (g key/value heads of Q channels, g/t of them under tensor parallelism). The loss all-reduces
(summed loss, predicted count) per micro-batch, and (summed z-loss) with optim.z_loss. Without FSDP
`sync_gradients` all-reduces every gradient over the context-parallel group (`replicas_all_reduce`'s bytes); with
FSDP the group is part of the shard group (`zero` with w = data_parallel_shard x c). With activation checkpointing
the recomputed forward all-gathers again (not counted here).
  all_gather = reduce_scatter = 2 e B T g Q L per micro-batch,  all_reduce = e (2 or 3) per micro-batch
Pipeline parallelism (parallel/pipeline.py, torch.distributed.pipelining's schedules): every stage but the last
sends each pipeline micro-batch's residual stream forward, every stage but the first its gradient backward, and
the neighbour receives each; a rank's stages are never adjacent (stage s on pipeline rank s mod p), so every
boundary crosses ranks. Per schedule call (one of the accumulation's micro-batches, cut into m) a rank holding
stages S of n sends and receives m (|S not last| + |S not first|) tensors of (B/m, T', d) (T' = T/c, /t under
sequence parallelism), e the stream's bytes.
Expert parallelism over P ranks (parallel/expert.py), per MoE layer and micro-batch: an all-to-all of the (E,) int64
counts, then the N·k token copies (N this rank's tokens, k experts each) out to their experts' ranks and the
outputs back, each an all-to-all of (rows, d) counted by its input; the backward runs the two again in reverse.
Under balanced routing (every expert N·k/E copies, simulate/routing.py) every one of the four moves N·k rows:
  all_to_all = 5 calls, 8 E + 4 e N k d bytes per MoE layer and micro-batch
"""

from typing import Dict, List, Tuple

Shape = Tuple[int, ...]
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")
ROW = ("wo", "w_down")


def block_shapes(d: int, f: int) -> Dict[str, Shape]:
    """One block's parameters by name (nn.Linear weights are (out, in))."""
    return {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w_gate": (f, d), "w_up": (f, d),
            "w_down": (d, f), "attn_norm": (d,), "mlp_norm": (d,)}


def tp_local(shapes: Dict[str, Shape], t: int) -> Dict[str, Shape]:
    """The slice one tensor-parallel rank holds: column linears split dim 0, row linears dim 1, the rest whole."""
    out = {}
    for name, s in shapes.items():
        if name in COLUMN:
            s = (s[0] // t, *s[1:])
        elif name in ROW:
            s = (s[0], s[1] // t)
        out[name] = s
    return out


def numel(s: Shape) -> int:
    n = 1
    for k in s:
        n *= k
    return n


def padded(shapes: List[Shape], w: int) -> int:
    """Elements of FSDP2's all-gather output (= reduce-scatter input) for a group: dim 0 padded to a multiple of w."""
    return sum(-(-s[0] // w) * w * numel(s[1:]) for s in shapes)


def groups(L: int, d: int, f: int, V: int, t: int = 1) -> Tuple[List[List[Shape]], List[Shape]]:
    """(each block's local shapes, the root's: tied embedding/head, its V/t vocabulary rows, and final norm) under
    tensor degree t."""
    block = list(tp_local(block_shapes(d, f), t).values())
    return [block] * L, [(V // t, d), (d,)]


def local_params(L: int, d: int, f: int, V: int, t: int = 1) -> int:
    blocks, root = groups(L, d, f, V, t)
    return sum(numel(s) for b in blocks for s in b) + sum(numel(s) for s in root)


def zero(L: int, d: int, f: int, V: int, w: int, stage: int = 3, t: int = 1, replicas: int = 1,
         e: int = 4) -> Dict[str, int]:
    """FSDP2's bytes per rank per step at ZeRO stage 2 or 3 over w shards (HSDP: replicas > 1); grad_norm left out."""
    blocks, root = groups(L, d, f, V, t)
    p_blocks, p_root = sum(padded(b, w) for b in blocks), padded(root, w)
    gathers = (2 if stage == 3 else 1) * (p_blocks + p_root)
    out = {"all_gather": e * gathers, "reduce_scatter": e * (p_blocks + p_root), "all_reduce": 0}
    if replicas > 1:
        out["all_reduce"] = e * (p_blocks + p_root) // w
    return out


def tensor_parallel(L: int, d: int, B: int, T: int, column_all_reduces: int = 5, e: int = 4) -> Dict[str, int]:
    """Megatron layers as ours are built: per block 2 forward + `column_all_reduces` backward all-reduces of
    (B, T, d); the vocabulary-parallel embedding's and head's (B, T, d) all-reduces and the cross-entropy's 3 B T."""
    return {"all_gather": 0, "reduce_scatter": 0,
            "all_reduce": e * B * T * d * (L * (2 + column_all_reduces) + 2) + 3 * e * B * T}


def sequence_parallel(L: int, d: int, B: int, T: int, e: int = 4) -> Dict[str, int]:
    """Tensor + sequence parallelism: gathers and scatters of (B, T, d), the norms' gradient all-reduce and the
    vocabulary-parallel cross-entropy's."""
    btd = e * B * T * d
    return {"all_gather": btd * (4 * L + 2), "reduce_scatter": btd * (4 * L + 2),
            "all_reduce": e * (d * (2 * L + 1) + 3 * B * T)}


def replicas_all_reduce(L: int, d: int, f: int, V: int, t: int = 1, e: int = 4) -> Dict[str, int]:
    """`sync_gradients` without FSDP: one all-reduce of every local gradient over the replicas."""
    return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": e * local_params(L, d, f, V, t)}


def grad_norm(shard_groups: int, tensor_pipeline_groups: int = 0, e: int = 4) -> Dict[str, int]:
    """ParallelModel.grad_norm: one scalar all-reduce over the FSDP shard group (the dense squares), and the
    (dense, experts) pair over each tensor-parallel and pipeline group, counting the groups of size > 1."""
    return {"all_gather": 0, "reduce_scatter": 0, "all_reduce": e * (shard_groups + 2 * tensor_pipeline_groups)}


def total(*parts: Dict[str, int]) -> Dict[str, int]:
    return {k: sum(p.get(k, 0) for p in parts) for k in KINDS}


def context_parallel(L: int, B: int, T: int, kv_channels: int, micro_batches: int = 1, z_loss: bool = False,
                     e: int = 4) -> Dict[str, int]:
    """Context parallelism's own collectives per rank per step: each block's all-gather of the window's keys and
    values (B sequences of T positions, kv_channels = key/value heads x head_dim on this tensor-parallel rank) and
    the reduce-scatter of their gradient, and the loss's all-reduce of its sums and count; per micro-batch."""
    kv = e * 2 * B * T * kv_channels * L * micro_batches
    return {"all_gather": kv, "reduce_scatter": kv, "all_reduce": e * (3 if z_loss else 2) * micro_batches}


def fsdp_step(param_shapes: Dict[str, Shape], w: int, stage: int = 3, micro_batches: int = 1, replicas: int = 1,
              gather_e: int = 4, reduce_e: int = 4, norm_values: int = 1) -> Dict[str, Tuple[int, int]]:
    """{kind: (calls, bytes)} FSDP2 moves per rank per optimizer step, from the architecture table's parameter shapes
    (model/shapes.py param_shapes: every preset's own, GQA's narrower wk/wv, an untied head) rather than `zero`'s
    tied, full-width block of the bench's model; held to `lit-pretrain simulate` (tests/simulate/).

    One FSDP group per block ("blocks.<i>.") and the root (everything else), as apply_plan shards them. Every
    micro-batch of an accumulation gathers and reduce-scatters again (the module leaves FSDP2's gradient sync on):
    micro_batches x (2 gathers at ZeRO-3, 1 at ZeRO-2, and 1 reduce-scatter) per group, HSDP's all-reduce of each
    reduced shard over the replicas too. gather_e / reduce_e: bytes per element gathered (2 under FSDP2's
    bf16 mixed-precision policy, else the parameters' 4) and reduced (4: the policy reduces in fp32). The norm:
    `norm_values` fp32 all-reduced once a step over the shard group (our mesh's grad_norm: 1; Lightning's plain FSDP
    path, optim.grad_norm over DTensors: one per parameter, the per-tensor norms DTensor stacks and reduces)."""
    by_group: Dict[str, List[Shape]] = {}
    for name, shape in param_shapes.items():
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "blocks" else ""
        by_group.setdefault(key, []).append(shape)
    n_groups = len(by_group)
    elements = sum(padded(shapes, w) for shapes in by_group.values())
    gathers = 2 if stage == 3 else 1
    out = {"all_gather": (micro_batches * gathers * n_groups, micro_batches * gathers * gather_e * elements),
           "reduce_scatter": (micro_batches * n_groups, micro_batches * reduce_e * elements),
           "all_reduce": (1, 4 * norm_values)}
    if replicas > 1:
        calls, size = out["all_reduce"]
        out["all_reduce"] = (calls + micro_batches * n_groups, size + micro_batches * reduce_e * elements // w)
    return out


def pipeline_p2p(stages: List[int], n_stages: int, micro_batches: int, accumulation: int, stream_bytes: int
                 ) -> Dict[str, Tuple[int, int]]:
    """{"send"/"recv": (calls, bytes)} of one pipeline rank per optimizer step: `stages` the stage ids it holds of
    `n_stages` (layout.stage_of_rank), `micro_batches` the schedule's m, `accumulation` its calls per step,
    `stream_bytes` one pipeline micro-batch's residual stream (B/m x T' x d x e); held to `lit-pretrain simulate`
    (tests/simulate/)."""
    boundaries = sum(s != n_stages - 1 for s in stages) + sum(s != 0 for s in stages)
    calls = accumulation * micro_batches * boundaries
    return {"send": (calls, calls * stream_bytes), "recv": (calls, calls * stream_bytes)}


def expert_all_to_all(moe_layers: int, tokens: int, top_k: int, d: int, num_experts: int, micro_batches: int = 1,
                      e: int = 4) -> Tuple[int, int]:
    """(calls, bytes) of expert parallelism's all-to-alls per rank per optimizer step under balanced routing:
    `moe_layers` MoE layers on this rank's stage, `tokens` one micro-batch's tokens on this rank, e the bytes of
    the copies (the MoE input's dtype); held to `lit-pretrain simulate` (tests/simulate/)."""
    per_layer = 8 * num_experts + 4 * e * tokens * top_k * d
    return 5 * moe_layers * micro_batches, per_layer * moe_layers * micro_batches
