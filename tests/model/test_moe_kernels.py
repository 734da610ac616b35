"""model/moe_kernels.py: the routed SwiGLU experts' Function against the per-expert loop it replaces, forward
and every gradient, for balanced and skewed routing, an expert without rows and no rows at all; gradcheck in
float64; bf16 autocast. CPU."""

import pytest
import torch
import torch.nn.functional as F

from lit_pretrain.model.moe_kernels import swiglu_experts

L, D, FF = 8, 32, 48  # experts, d, expert width: multiples of 8 (grouped_mm's 16-byte strides, model/config.py)


def loop_experts(xs, offsets, w_gate, w_up, w_down):
    """Expert by expert over each one's rows, autograd through it: what transformers' OlmoeExperts computes."""
    out, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        x = xs[start:end]
        out.append((F.silu(x @ w_gate[e].T) * (x @ w_up[e].T)) @ w_down[e].T)
        start = end
    return torch.cat(out)


def inputs(counts, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(sum(counts), D, generator=g, dtype=dtype)
    weights = [torch.randn(L, FF, D, generator=g, dtype=dtype) * D ** -0.5,
               torch.randn(L, FF, D, generator=g, dtype=dtype) * D ** -0.5,
               torch.randn(L, D, FF, generator=g, dtype=dtype) * FF ** -0.5]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    dy = torch.randn(sum(counts), D, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (xs, *weights)], offsets, dy


def forward_backward(fn, leaves, offsets, dy):
    for t in leaves:
        t.grad = None
    y = fn(leaves[0], offsets, *leaves[1:])
    y.backward(dy.to(y.dtype))
    return [y.detach()] + [t.grad for t in leaves]


ROUTINGS = {"balanced": [24] * L,  # each expert its share
            "skewed": [150, 6, 2, 8, 4, 10, 2, 10],  # one expert holds 78% of the rows (a collapsing router)
            "an_expert_without_rows": [30, 0, 25, 20, 35, 30, 22, 30],
            "no_rows": [0] * L}


@pytest.mark.parametrize("routing", ROUTINGS)
def test_forward_and_every_gradient_equal_the_per_expert_loop(routing):
    leaves, offsets, dy = inputs(ROUTINGS[routing])
    ours = forward_backward(swiglu_experts, leaves, offsets, dy)
    ref = forward_backward(loop_experts, leaves, offsets, dy)
    assert ours[0].shape == (sum(ROUTINGS[routing]), D)
    # The same products: grouped_mm on CPU is one MKL GEMM per expert on that expert's rows, and each gradient is
    # the GEMM autograd does for the loop (measured bitwise equal at 1 and 2 threads). The tolerance is a few fp32
    # ulps of these O(1..50) values, room for MKL to block a transposed operand differently elsewhere.
    for name, mine, theirs in zip(("y", "xs", "w_gate", "w_up", "w_down"), ours, ref):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-5,
                                   msg=lambda m, name=name: f"{routing} {name}: {m}")
    for e in torch.nonzero(torch.tensor(ROUTINGS[routing]) == 0).flatten().tolist():
        assert all((grad[e] == 0).all() for grad in ours[2:])  # an expert without rows gets exact zero gradients


def test_gradcheck_in_float64():
    # Finite differences against the hand-written backward on a tiny case with an expert without rows; float64 runs
    # the same grouping through _gmm's loop (grouped_mm takes no float64).
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(3, 6, 4, generator=g, dtype=torch.float64, requires_grad=True),
               torch.randn(3, 6, 4, generator=g, dtype=torch.float64, requires_grad=True),
               torch.randn(3, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)]
    offsets = torch.tensor([3, 3, 7], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda x, a, b, c: swiglu_experts(x, offsets, a, b, c), (xs, *weights))


def test_bf16_autocast_computes_as_autocast_computes_the_loop():
    leaves, offsets, dy = inputs(ROUTINGS["balanced"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = forward_backward(swiglu_experts, leaves, offsets, dy)
        ref = forward_backward(loop_experts, leaves, offsets, dy)
    assert ref[0].dtype == torch.bfloat16  # the loop's; the kernel hands its bf16 values back in xs's dtype
    assert all(t.dtype == torch.float32 for t in ours)
    # The same bf16 GEMMs and elementwise ops (measured bitwise equal), except xs's gradient: autocast casts xs once
    # per matmul in the loop, so its two parts (through gate and through up) are summed in fp32, while the kernel
    # casts xs once and sums them in bf16: one bf16 rounding, half an ulp, 2^-9 of the value.
    for name, mine, theirs in zip(("y", "xs", "w_gate", "w_up", "w_down"), ours, ref):
        rtol = 2 ** -8 if name == "xs" else 0.0
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=rtol, atol=0.0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_an_moe_layer_trains_under_bf16_autocast():
    # The layer adds the experts' outputs into its fp32 tokens with index_add_ (one dtype): it raised under autocast
    # while the experts' output was bf16.
    from lit_pretrain.model.config import GPTConfig, MoEConfig
    from lit_pretrain.model.gpt import GPT

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, n_layers=1, d_model=64, n_heads=4, seq_len=32,
                    moe=MoEConfig(num_experts=4, top_k=2, d_ff_expert=32))
    model, idx = GPT(cfg), torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        ref = model(idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(idx)
    out.float().square().mean().backward()
    grad = model.blocks[0].mlp.experts["w_gate"].weight.grad
    assert grad.dtype == torch.float32 and grad.abs().sum() > 0
    # bf16 operands (8 significant bits) through one block: logits up to 1.6, where a bf16 ulp is 2^-7 = 0.0078;
    # measured 0.013 off the fp32 forward, allowed 5 ulps.
    torch.testing.assert_close(out.float(), ref, rtol=0.0, atol=0.04)
