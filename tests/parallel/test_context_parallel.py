"""Context parallelism's attention on CUDA (parallel/context.py): the branch CPU runs cannot reach. The CPU parity of
every layout is in tests/parallel/test_mesh_parallel.py."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_context_attention_on_cuda_matches_one_causal_sdpa(tmp_path):
    """A context-parallel group of one rank (NCCL) computes chunk 0 (a square: SDPA's is_causal) and chunk 1 (n
    queries over 2n keys: PyTorch's CausalBias, lower-right, through the flash kernel) of the window: output and the
    q, k, v gradients against one causal SDPA over the whole window, bf16, grouped-query attention (8:2 heads)."""
    from lit_pretrain.parallel.context import ContextParallel

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        k = torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        v = torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        y = ContextParallel(dist.group.WORLD)(q, k, v, None)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        grads = torch.autograd.grad(y.float().square().sum(), (q, k, v))
        ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
        # bf16 (8 mantissa bits): the two kernels sum in another order; 2e-2 is a few bf16 ulps at these magnitudes,
        # while a wrong alignment of the triangle changes outputs by their own size (~1)
        assert (y.float() - ref.float()).abs().max() < 2e-2
        for a, b in zip(grads, ref_grads):
            assert (a.float() - b.float()).abs().max() < 5e-2 * b.float().abs().max()
    finally:
        dist.destroy_process_group()
