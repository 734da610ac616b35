"""Selective activation checkpointing of our block (parallel/activation_checkpointing.py) as pure arithmetic: the
bytes a block keeps and the FLOPs its backward runs again, per policy.

Our block's matmuls, in the order its forward runs them (model/gpt.py), for N = seq_len · micro_batch tokens, h
hidden, Q = h/a head channels, g key/value heads (kv = g·Q channels), f the MLP width, t tensor-parallel ranks:

    wq (h -> h/t), wk (h -> kv/t), wv (h -> kv/t), [attention], wo (h/t -> h),
    SwiGLU: w_gate (h -> f/t), w_up (h -> f/t), w_down (f/t -> h);  GELU: w_up (h -> f/t), w_down (f/t -> h)

A row-parallel matmul's output (wo, w_down) is the whole N·h partial sum on each rank, before its all-reduce (or,
under sequence parallelism, its reduce-scatter); a column-parallel one's is N·out/t.

A mixture-of-experts block (model.moe: E experts, k per token, expert width f_e, s shared experts) replaces the MLP
by, in forward order: the router (h -> E, replicated: N·E on every rank), the routed experts' grouped products over
the R = kN token copies (model/moe_kernels.py: gate and up R·h -> R·f_e/t, down R·f_e/t -> R·h; under expert
parallelism the copies a rank receives, kN on average) and the shared experts' SwiGLU of width s·f_e (column, row
as the dense MLP). Selective also keeps the router's top-k (values fp32 and indices int64: 12 bytes per copy), so
the recomputation routes as the forward did (parallel/activation_checkpointing.py).

Bytes kept by a selectively checkpointed block (torchtitan's op policy: the matmuls' and the attention kernel's
outputs saved, everything else recomputed): its input (the residual stream's dtype; N·h/t under sequence
parallelism), each saved matmul's output, and the attention kernel's output (N·h/t, the activation dtype) and
log-sum-exp (N·a/t, fp32 always). Norms, QK-norm, RoPE, SiLU/GELU and the products save nothing: they run again.
`every_other` keeps the 1st, 3rd, 5th, ... matmul only (torchtitan's save list), the others run again.

Recomputed FLOPs per block, in torch.utils.flop_counter's convention (2·m·n·k a matmul; attention 4·b·a·s²·Q
forward, the whole s×s product though the causal kernel skips half, and a sliding-window layer's too: SDPA computes
every score its boolean mask then drops, unlike the model FLOPs of MFU, which count only the window's pairs,
model/mask_spec.py): under `selective` the matmuls not saved,
under `full` the whole forward, in both but the block's last matmul (w_down): torch's non-reentrant checkpoint
stops the recomputation once it has rebuilt the last tensor the backward needs (`set_checkpoint_early_stop`, on by
default), and nothing in the backward reads w_down's output, only its input. An MoE block's forward ends with its
auxiliary and z losses, whose backward reads tensors computed after every matmul: there nothing is spared.
FlopCounterMode has no formula for `aten._grouped_mm` (torch 2.13): the tests pass it 2·M·K·N. Attention is counted
apart: FlopCounterMode has no formula for the CPU kernel (`_scaled_dot_product_flash_attention_for_cpu`), so on CPU
it measures matmuls only. Measured against FlopCounterMode and the saved-tensor hooks (parallel/memory.py) in
tests/parallel/test_activation_checkpointing.py.
"""

from typing import Dict, List, Optional, Tuple

from lit_pretrain.errors import ConfigError
from lit_pretrain.model.mask_spec import CAUSAL


def block_matmuls(seq_len: int, micro_batch: int, hidden: int, heads: int, mlp_hidden: int,
                  tensor_parallel: int = 1, *, kv_heads: Optional[int] = None,
                  mlp: str = "swiglu", moe: Optional[tuple] = None) -> List[Tuple[str, float, float]]:
    """(name, output elements, FLOPs) of each of our block's matmuls on one tensor-parallel rank, in forward order.
    moe: (E experts, k per token, expert width f_e, s shared experts) for an MoE block (see the module docstring)."""
    n, h, f, t = seq_len * micro_batch, hidden, mlp_hidden, tensor_parallel
    kv = (heads if kv_heads is None else kv_heads) * (h // heads)
    # (name, rows, inner dimension, output width): output rows·width elements, 2·rows·inner·width FLOPs
    shapes = [("wq", n, h, h / t), ("wk", n, h, kv / t), ("wv", n, h, kv / t), ("wo", n, h / t, h)]
    if moe is not None:
        experts, k, f_e, shared = moe
        r = k * n
        shapes += [("router", n, h, experts), ("experts.w_gate", r, h, f_e / t), ("experts.w_up", r, h, f_e / t),
                   ("experts.w_down", r, f_e / t, h)]
        if shared:
            shapes += [("shared.w_gate", n, h, shared * f_e / t), ("shared.w_up", n, h, shared * f_e / t),
                       ("shared.w_down", n, shared * f_e / t, h)]
    elif mlp == "swiglu":
        shapes += [("w_gate", n, h, f / t), ("w_up", n, h, f / t), ("w_down", n, f / t, h)]
    else:
        shapes += [("w_up", n, h, f / t), ("w_down", n, f / t, h)]
    return [(name, rows * out, 2.0 * rows * k * out) for name, rows, k, out in shapes]


def saved_matmuls(names: List[str], save_matmuls: str = "all") -> List[str]:
    """The matmuls a selective policy keeps: all, or the 1st, 3rd, ... (every_other)."""
    if save_matmuls not in ("all", "every_other"):
        raise ConfigError(f"strategy.activation_checkpointing_save_matmuls={save_matmuls!r}: expected all or "
                          "every_other")
    return list(names) if save_matmuls == "all" else list(names[::2])


def selective_block_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, mlp_hidden: int,
                          tensor_parallel: int = 1, sequence_parallel: bool = False, bytes_per_element: float = 4.0,
                          *, kv_heads: Optional[int] = None, mlp: str = "swiglu", residual_bytes: float = 4.0,
                          save_matmuls: str = "all", moe: Optional[tuple] = None) -> float:
    """Bytes one selectively checkpointed block keeps on one tensor-parallel rank (see the module docstring).
    bytes_per_element: the matmuls' and attention's output dtype (2 under autocast); residual_bytes: the block
    input's (4 under autocast, whose residual stream stays fp32)."""
    n, h, a, t = seq_len * micro_batch, hidden, heads, tensor_parallel
    mms = block_matmuls(seq_len, micro_batch, hidden, heads, mlp_hidden, t, kv_heads=kv_heads, mlp=mlp, moe=moe)
    kept = set(saved_matmuls([m[0] for m in mms], save_matmuls))
    outputs = sum(elements for name, elements, _ in mms if name in kept)
    attention = n * h / t
    block_input = residual_bytes * n * h / (t if sequence_parallel else 1)
    routing = 12.0 * moe[1] * n if moe is not None else 0.0  # the top-k's fp32 values and int64 indices
    return block_input + bytes_per_element * (outputs + attention) + 4.0 * n * a / t + routing


def recompute_flops(mode: str, seq_len: int, micro_batch: int, hidden: int, heads: int, mlp_hidden: int,
                    tensor_parallel: int = 1, *, kv_heads: Optional[int] = None, mlp: str = "swiglu",
                    save_matmuls: str = "all", moe: Optional[tuple] = None) -> Dict[str, float]:
    """{"matmul", "attention"} FLOPs one checkpointed block's backward runs again (FlopCounterMode's convention;
    see the module docstring). mode: none, selective or full (every_k: full on the blocks it checkpoints)."""
    mms = block_matmuls(seq_len, micro_batch, hidden, heads, mlp_hidden, tensor_parallel, kv_heads=kv_heads, mlp=mlp,
                        moe=moe)
    # An MoE block's forward ends with its auxiliary and z losses, whose backward reads the router's logits: the
    # recomputation runs to them, through the last matmul too.
    rerun = mms if moe is not None else mms[:-1]
    if mode == "none":
        return {"matmul": 0.0, "attention": 0.0}
    if mode == "selective":
        kept = set(saved_matmuls([m[0] for m in mms], save_matmuls))
        return {"matmul": sum(flops for name, _, flops in rerun if name not in kept), "attention": 0.0}
    if mode == "full":
        q = hidden // heads  # the scores and the weighted sum over the keys the mask has counted (model/mask_spec.py)
        return {"matmul": sum(flops for _, _, flops in rerun),
                "attention": 4.0 * micro_batch * heads / tensor_parallel * (seq_len * CAUSAL.scored_keys(seq_len)) * q}
    raise ConfigError(f"strategy.activation_checkpointing={mode!r}: expected none, selective or full here")
