"""The routed SwiGLU experts of model.moe (model/moe.py) as one autograd Function over grouped matmuls, with
a hand-written backward.

For the token copies xs (M, d) sorted by expert and the stacked weights of the L experts computed here, expert e's
rows xs[offsets[e-1]:offsets[e]] give y = (silu(x W_gate[e]ᵀ) * (x W_up[e]ᵀ)) W_down[e]ᵀ (Shazeer 2020's SwiGLU, as
transformers' OlmoeExperts computes it expert by expert). Every product is one `torch.nn.functional.grouped_mm`
call over all L experts: on CPU torch 2.13 runs it as one MKL GEMM per expert on that expert's contiguous rows
(`_grouped_mm_fallback`, mm_out into a slice of the output), so no row is padded, gathered or copied.

What bounds it, and what was kept (bench case `moe_grouped_vs_loop`: 8 experts, top 2, 4096 copies, d 256, width
352; 2 cores of an AMD EPYC with AVX-512, MKL; a machine shared with other work):
- The GEMMs. Each of the nine products of a step (3 forward, 6 backward: 6.6 GFLOP) runs near the cores' peak, as
  a plain mm of 512 rows, a torch.bmm of 8 or grouped_mm alike (185-199 GFLOP/s on 2 threads, 94-103 on 1, where
  1024³ reaches 98). On 2 threads in a quiet moment the nine grouped_mm calls alone took 39.9 ms, this Function's
  forward + backward 42.3-43.6 ms, the same SwiGLU looped over each expert's rows 48.3 ms: what is left to win
  over a per-expert loop is its overhead, not its arithmetic. The whole layer (medians of 7 alternations, quiet):
  50.5 ms against 50.0 ms for the bench's loop, 7.0 ms of it routing, gathering and adding back outside the
  experts; the bench case itself measured 0.99x (spread 0.18), where the padded torch.bmm this replaces measured
  0.90x. On 1 thread in CPU time (robust to the load): 95.8 ms against 102.2 ms (1.04x), padded bmm 112.4 ms.
- No padding. Padding every expert to the busiest one's count computes L·C/M times the rows (1.09 on the bench's
  routing, up to 2 where it was allowed) and adds an index_copy of xs and of dy and a gather of the outputs and
  of the gradient of xs.
- Memory. Autograd over the same calls saves xs, g, u, silu(g) and h; here xs, g and u, and silu(g) and h are
  recomputed in backward (two elementwise passes over (M, f), within the 6-9% above the GEMMs' time): the MoE
  block's saved expert activations drop from M·d + 4M·f to M·d + 2M·f (planning/memory.py counts this). The
  backward's five (M, f) temporaries share three buffers (out= and in-place).
- Gate and up stay two GEMMs. One over the concatenated (L, 2f, d) weight measured no faster (10.1 ms against
  2 x 4.9 ms for the forward on 2 threads: grouped_mm at N = 704 runs at the rate it runs at 352), and it costs a
  copy of both weights per call, kept for backward (an activation), and strided halves for the elementwise passes.
- Fresh buffers. A fresh (M, f) buffer comes from mmap and costs a page fault per 4 KiB on first touch (3,000-5,000
  faults, 5-10 ms of system time per step, varying with the heap's state); keeping two (M, f) scratch buffers
  between calls cut that to about 650 faults but measured only 1-2% faster, not worth a module-level cache.

Under CPU autocast the GEMMs' operands are cast to the autocast dtype, as autocast casts those of a matmul (and
the per-expert loop's `@`), and the result goes back to xs's dtype; the Function itself runs with autocast off, so
its backward computes in the forward's dtype.
"""

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def _gmm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grouped_mm(a, b, offs=offsets): a (M, K) @ b (L, K, N) per group of rows -> (M, N), or a (K, M) @ b (M, N)
    per group of the shared dimension -> (L, K, N). grouped_mm takes fp32, bf16 and fp16; float64 (gradcheck)
    runs the same grouping as a loop."""
    if a.dtype != torch.float64:
        return F.grouped_mm(a, b, offs=offsets)
    bounds = [0, *offsets.tolist()]
    if b.dim() == 3:
        return torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(zip(bounds, bounds[1:]))])
    return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(bounds, bounds[1:])])


class _SwiGLUExperts(torch.autograd.Function):
    """xs (M, d), offsets (L,) int32, w_gate, w_up (L, f, d), w_down (L, d, f) -> (M, d); see the module
    docstring."""

    @staticmethod
    def forward(ctx, xs, offsets, w_gate, w_up, w_down):
        g = _gmm(xs, w_gate.transpose(1, 2), offsets)  # (M, f)
        u = _gmm(xs, w_up.transpose(1, 2), offsets)  # (M, f)
        h = F.silu(g).mul_(u)  # (M, f): w_down's input, recomputed in backward rather than kept
        ctx.save_for_backward(xs, offsets, w_gate, w_up, w_down, g, u)
        return _gmm(h, w_down.transpose(1, 2), offsets)  # (M, d)

    @staticmethod
    @once_differentiable  # out= into its own buffers: no graph of the backward itself
    def backward(ctx, dy):
        with torch.autocast(dy.device.type, enabled=False):  # the forward's dtype, whatever surrounds backward()
            return _SwiGLUExperts._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy):
        xs, offsets, w_gate, w_up, w_down, g, u = ctx.saved_tensors
        need_x, _, need_gate, need_up, need_down = ctx.needs_input_grad
        dy = dy.contiguous()
        dh = _gmm(dy, w_down, offsets)  # (M, f) = dy_e W_down[e] per expert
        # Three (M, f) buffers serve five tensors (h and du share one, silu(g) and dg another): each fresh buffer
        # of this size is a page fault per 4 KiB on first touch (fresh allocations this large come from mmap).
        sg = F.silu(g)  # (M, f)
        h = torch.mul(sg, u)  # (M, f): w_down's input again
        dw_down = _gmm(dy.T, h, offsets) if need_down else None  # (L, d, f) = dy_eᵀ h_e
        du = torch.mul(dh, sg, out=h)  # (M, f)
        dg = torch.ops.aten.silu_backward.grad_input(dh.mul_(u), g, grad_input=sg)  # dh·u·silu'(g), one pass
        dx = None
        if need_x:
            dx = _gmm(dg, w_gate, offsets)  # (M, d)
            dx += _gmm(du, w_up, offsets)
        dw_gate = _gmm(dg.T, xs, offsets) if need_gate else None  # (L, f, d) = dg_eᵀ x_e
        dw_up = _gmm(du.T, xs, offsets) if need_up else None
        return dx, None, dw_gate, dw_up, dw_down


def swiglu_experts(xs: torch.Tensor, offsets: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """The SwiGLU experts on xs (M, d), rows sorted by expert, expert e's ending at offsets[e] (L,) int32,
    cumulative; w_gate, w_up (L, f, d) and w_down (L, d, f) the stacked weights of those L experts -> (M, d).
    Differentiable in xs and the three weights; an expert with no rows gets zero gradients (M = 0 too)."""
    device, dtype = xs.device.type, xs.dtype
    if torch.is_autocast_enabled(device):  # what autocast does to a matmul's operands
        low = torch.get_autocast_dtype(device)
        xs, w_gate, w_up, w_down = (t.to(low) for t in (xs, w_gate, w_up, w_down))
    with torch.autocast(device, enabled=False):
        ys = _SwiGLUExperts.apply(xs, offsets, w_gate, w_up, w_down)
    # Back in xs's dtype: the caller weighs the copies by their fp32 routing weights and index_add_s them into its
    # (fp32 under autocast) tokens, which takes one dtype.
    return ys.to(dtype)
