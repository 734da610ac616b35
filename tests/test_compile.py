"""Regional compile (parallel/compile.py): same math as eager, with activation checkpointing and through the
strategies' wrapping, and a clear error when the C++ toolchain inductor needs is missing."""

import copy

import pytest
import torch
import torch.nn.functional as F

from lit_pretrain.errors import ConfigError
from lit_pretrain.model import GPT
from lit_pretrain.model_config import GPTConfig
from lit_pretrain.parallel.activation_checkpointing import is_checkpointed
from lit_pretrain.parallel.apply import apply_plan
from lit_pretrain.parallel.compile import check_toolchain, compile_blocks, compiler_available, is_compiled
from lit_pretrain.parallel.plan import ParallelPlan

needs_compiler = pytest.mark.skipif(not compiler_available(), reason="torch.compile on CPU needs a C++ compiler")

B, T = 2, 16
# Inductor fuses RMSNorm, RoPE, SiLU·up and the attention softmax into generated C++ loops whose fp32 reductions
# run in another order than ATen's: each reordered sum differs by a few ulps (~1e-7 relative), amplified through 2
# blocks and the backward to ~1e-6 on values of order 1 (measured: loss 5e-7, gradients 3e-6). 1e-5 absolute
# (gradients are 1e-3..1e-1 here) leaves a margin of about 3 yet fails on any real error (a wrong mask, a
# dropped term: differences of order 1e-2).
ATOL = 1e-5


def gpt(activation_checkpointing: str = "none") -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, n_layers=2, d_model=32, n_heads=4, seq_len=T,
                         activation_checkpointing=activation_checkpointing))


def loss_and_grads(model: GPT):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 128, (B, T), generator=g), torch.randint(0, 128, (B, T), generator=g)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads


def assert_same(eager, compiled):
    (loss_e, grads_e), (loss_c, grads_c) = eager, compiled
    assert torch.allclose(loss_c, loss_e, atol=ATOL, rtol=0)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        assert torch.allclose(grads_c[name], grads_e[name], atol=ATOL, rtol=0), name


@needs_compiler
@pytest.mark.parametrize("activation_checkpointing", ["none", "full"])
def test_compiled_blocks_match_eager(activation_checkpointing):
    """Through `apply_plan`, as the module applies it: checkpointing first, then compile inside the wrapper."""
    eager = gpt(activation_checkpointing)
    compiled = copy.deepcopy(eager)
    apply_plan(eager, ParallelPlan(activation_checkpointing=activation_checkpointing))
    apply_plan(compiled, ParallelPlan(activation_checkpointing=activation_checkpointing, compile=True))
    assert all(is_compiled(b) for b in compiled.blocks) and not any(is_compiled(b) for b in eager.blocks)
    assert all(is_checkpointed(b) for b in compiled.blocks) == (activation_checkpointing == "full")
    assert_same(loss_and_grads(eager), loss_and_grads(compiled))
    # Compiling again is a no-op (Lightning may call configure_model twice), and names are the plain GPT's.
    assert compile_blocks(compiled) == 0
    assert compiled.state_dict().keys() == gpt().state_dict().keys()


@needs_compiler
def test_compiled_blocks_under_ddp_and_zero3(tmp_path):
    """The strategies' wrapping around compiled blocks: DDP (strategy ddp, and ZeRO stage 1's DDP) wraps the whole
    module after `apply_plan`; FSDP2 (ZeRO stage 3) shards each compiled block, its hooks outside the graph.
    One rank is enough to run the wrapping code paths and their hooks (the reductions are identities); the
    multi-rank math of each strategy is tested eagerly in test_strategies_parity.py. In this process, not a
    spawned one, so the block graph compiled above is reused instead of compiled again (~30 s)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        eager = loss_and_grads(gpt())
        ddp = gpt()
        apply_plan(ddp, ParallelPlan(compile=True))
        loss, grads = loss_and_grads(DistributedDataParallel(ddp))
        assert_same(eager, (loss, {k.removeprefix("module."): g for k, g in grads.items()}))

        zero3 = gpt()
        apply_plan(zero3, ParallelPlan(zero_stage=3, compile=True), fsdp_mesh=init_device_mesh("cpu", (1,)))
        assert isinstance(zero3.blocks[0], FSDPModule) and is_compiled(zero3.blocks[0])
        loss, grads = loss_and_grads(zero3)
        assert_same(eager, (loss, {k: g.full_tensor() for k, g in grads.items()}))
    finally:
        dist.destroy_process_group()


def test_missing_compiler_is_a_config_error(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(ConfigError, match=r"trainer\.compile"):
        check_toolchain()


def test_missing_compiler_stops_apply_plan_before_compiling(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    model = gpt()
    with pytest.raises(ConfigError, match=r"trainer\.compile=false"):
        apply_plan(model, ParallelPlan(compile=True))
    assert not any(is_compiled(b) for b in model.blocks)
