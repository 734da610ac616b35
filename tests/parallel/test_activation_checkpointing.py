"""Activation checkpointing from outside the GPT: same math, fewer saved bytes by the factor the policy implies."""

import copy

import pytest
import torch
import torch.nn.functional as F

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.parallel.activation_checkpointing import apply_activation_checkpointing, checkpointed_block_indices
from lit_pretrain.parallel.memory import SavedActivations

B, T, D = 2, 16, 32


def gpt(n_layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, n_layers=n_layers, d_model=D, n_heads=4, seq_len=T))


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (B, T), generator=g), torch.randint(0, 128, (B, T), generator=g)


def step(model, mode="none", k=2):
    """Loss, gradients by name (as the plain GPT names them) and saved-activation bytes of one forward/backward."""
    model = copy.deepcopy(model)
    apply_activation_checkpointing(model, mode, k)
    x, y = batch()
    with SavedActivations(model) as meter:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, meter.bytes


@pytest.mark.parametrize("mode, n_layers, k, expected", [
    ("none", 4, 2, []),
    ("full", 4, 2, [0, 1, 2, 3]),
    ("every_k", 4, 2, [0, 2]),
    ("every_k", 5, 2, [0, 2, 4]),
    ("every_k", 6, 3, [0, 3]),
    ("every_k", 3, 1, [0, 1, 2]),
    ("selective", 3, 2, [0, 1, 2]),
])
def test_policy_picks_blocks(mode, n_layers, k, expected):
    assert checkpointed_block_indices(mode, n_layers, k) == expected


def test_unknown_policy_names_the_key():
    with pytest.raises(ValueError, match=r"strategy\.activation_checkpointing='some'"):
        checkpointed_block_indices("some", 4)


@pytest.mark.parametrize("mode", ["full", "every_k", "selective"])
def test_losses_and_gradients_equal_without_it(mode):
    # Non-reentrant recomputation runs the same CPU kernels on the same inputs in the same order: bit-identical.
    loss_ref, grads_ref, _ = step(gpt(4))
    loss, grads, _ = step(gpt(4), mode)
    assert torch.equal(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        assert torch.equal(g, grads_ref[name]), name


def test_saved_bytes_fall_by_the_factor_the_policy_implies():
    # Without checkpointing, each (identical) block adds the same saved bytes S: the difference of a 2- and a
    # 1-block model. A checkpointed block keeps only its input, B·T·d fp32 values, and nothing inside it.
    per_block = step(gpt(2))[2] - step(gpt(1))[2]
    block_input = B * T * D * 4
    none, full, every_2 = step(gpt(4))[2], step(gpt(4), "full")[2], step(gpt(4), "every_k", 2)[2]
    assert step(gpt(3))[2] == none - per_block  # linear in depth: the per-block figure is exact
    assert full == none - 4 * (per_block - block_input)
    assert every_2 == none - 2 * (per_block - block_input)  # blocks 0 and 2 of 4
    # For this shape a block saves 26x its input (q, k, v, attention output, SwiGLU hidden-width tensors, norms).
    assert per_block / block_input == pytest.approx(26.19, abs=0.01)


def test_checkpoint_names_stay_those_of_the_plain_gpt():
    plain = gpt(2)
    wrapped = copy.deepcopy(plain)
    assert apply_activation_checkpointing(wrapped, "full") == [0, 1]
    assert apply_activation_checkpointing(wrapped, "full") == [0, 1]  # idempotent: configure_model may run twice
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    wrapped.load_state_dict(plain.state_dict(), strict=True)


# Selective activation checkpointing (torchtitan's op policy) against the planner's rows (planning/recompute.py):
# grouped-query attention (2 key/value heads of 4), so wk and wv differ from wq in size; both MLPs.
SHAPE = dict(vocab_size=128, d_model=D, n_heads=4, n_kv_heads=2, seq_len=T)


def measured(mode, save_matmuls="all", n_layers=1, mlp="swiglu", autocast=False):
    """(saved-activation bytes, FLOPs of forward and backward) of one step, FlopCounterMode counting."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layers=n_layers, mlp=mlp, **SHAPE))
    apply_activation_checkpointing(model, mode, save_matmuls=save_matmuls)
    x, y = batch()
    with FlopCounterMode(display=False) as flops:
        with SavedActivations(model) as meter, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
    return meter.bytes, flops.get_total_flops()


@pytest.mark.parametrize("save_matmuls, mlp, autocast", [("all", "swiglu", False), ("every_other", "swiglu", False),
                                                         ("every_other", "gelu", False), ("all", "swiglu", True)])
def test_selective_keeps_the_planned_bytes_and_recomputes_the_planned_flops(save_matmuls, mlp, autocast):
    """Like torchtitan's tests of its op policy: FlopCounterMode counts what the backward runs again (the step's FLOPs
    against those of the step without checkpointing), the saved-tensor hooks and the policy's cache the bytes a block
    keeps (the difference of a 2- and a 1-block model: the rest of the model cancels). Both must equal the planner's
    figures within 1%; they are exact here. On CPU FlopCounterMode counts matmuls only (no formula for the CPU
    attention kernel), so the planner's matmul figure is compared; the policy saves attention's output anyway."""
    from lit_pretrain.planning.recompute import recompute_flops, selective_block_bytes

    cfg = GPTConfig(n_layers=1, mlp=mlp, **SHAPE)
    args = (T, B, D, 4, cfg.hidden_dim)
    per_block = measured("selective", save_matmuls, 2, mlp, autocast)[0] - measured("selective", save_matmuls, 1,
                                                                                     mlp, autocast)[0]
    planned = selective_block_bytes(*args, bytes_per_element=2.0 if autocast else 4.0, kv_heads=2, mlp=mlp,
                                    residual_bytes=4.0, save_matmuls=save_matmuls)
    assert per_block == pytest.approx(planned, rel=0.01), (per_block, planned)
    recomputed = measured("selective", save_matmuls, mlp=mlp)[1] - measured("none", mlp=mlp)[1]
    planned_flops = recompute_flops("selective", *args, kv_heads=2, mlp=mlp, save_matmuls=save_matmuls)["matmul"]
    assert recomputed == pytest.approx(planned_flops, rel=0.01, abs=0), (recomputed, planned_flops)
    # every_other runs the matmuls it does not keep again: the count is not trivially 0
    assert (planned_flops > 0) == (save_matmuls == "every_other")


def test_full_recomputes_the_planned_flops_and_selective_sits_between_none_and_full():
    from lit_pretrain.planning.memory import memory_plan
    from lit_pretrain.planning.plan import ParallelPlan
    from lit_pretrain.planning.recompute import recompute_flops

    none, full, selective = measured("none"), measured("full"), measured("selective")
    planned = recompute_flops("full", T, B, D, 4, GPTConfig(**SHAPE).hidden_dim, kv_heads=2)["matmul"]
    assert full[1] - none[1] == pytest.approx(planned, rel=0.01, abs=0)
    assert full[0] < selective[0] < none[0]
    assert selective[1] == none[1]  # every matmul kept: no matmul runs again
    # memory_plan's selective row is this count, per layer and for all layers' recomputation
    cfg = GPTConfig(n_layers=3, **SHAPE)
    plan = memory_plan(ParallelPlan(activation_checkpointing="selective",
                                    activation_checkpointing_save_matmuls="every_other"),
                       cfg, B, precision="32-true")
    every = recompute_flops("selective", T, B, D, 4, cfg.hidden_dim, kv_heads=2, save_matmuls="every_other")
    assert plan["recompute_flops"] == {k: 3 * v for k, v in every.items()}
    assert plan["activation_bytes_per_layer"] == pytest.approx(
        measured("selective", "every_other", 2)[0] - measured("selective", "every_other", 1)[0], rel=0.01)


def test_the_bench_reports_selective_and_full_against_none():
    """bench/step/checkpointing.py (the step group's case) on the tiny experiment: the cases it reports, and the
    saved bytes in the order the modes imply (full keeps least, selective between)."""
    from lit_pretrain import config
    from lit_pretrain.bench.step import checkpointing
    from tests.planning.test_layout import TINY

    c = config.to_object(config.load(TINY, ["model.vocab_size=128", "trainer.micro_batch_size=2"]))
    cases = {case["case"]: case for case in checkpointing.run(c, steps=2, skip=1, alternations=1)}
    assert list(cases) == ["act_ckpt_selective_vs_none_step_seconds", "act_ckpt_selective_vs_none_saved_bytes",
                           "act_ckpt_full_vs_none_step_seconds", "act_ckpt_full_vs_none_saved_bytes"]
    full, selective = cases["act_ckpt_full_vs_none_saved_bytes"], cases["act_ckpt_selective_vs_none_saved_bytes"]
    assert 0 < full["ratio"] < selective["ratio"] < 1 and full["reference"] == selective["reference"]
    assert cases["act_ckpt_selective_vs_none_step_seconds"]["value"] > 0


# model.moe under selective: 4 experts, top 2, width 24, grouped-query attention as above.
MOE = dict(num_experts=4, top_k=2, d_ff_expert=24, aux_loss=1e-2, router_z_loss=1e-3)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs):
    """2·M·K·N for torch's `aten._grouped_mm` (FlopCounterMode has none in torch 2.13): a (M, K) @ b (L, K, N)
    grouped by rows, or a (K, M) @ b (M, N) grouped along M (the weights' gradients), both one GEMM's FLOPs."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def moe_step(mode, n_layers=1, save_matmuls="all", autocast=False, **moe):
    """(loss with the MoE losses, gradients by name, routing counts, saved bytes, FLOPs) of one step."""
    from torch.utils.flop_counter import FlopCounterMode

    from lit_pretrain.model.config import MoEConfig
    from lit_pretrain.model.moe import moe_layers, moe_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layers=n_layers, moe=MoEConfig(**{**MOE, **moe}), **{**SHAPE, "seq_len": T}))
    apply_activation_checkpointing(model, mode, save_matmuls=save_matmuls)
    model.train()
    x, y = batch()
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: _grouped_mm_flops}) as flops:
        with SavedActivations(model) as meter, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) + moe_loss(model)
        loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    counts = [m.load.clone() for m in moe_layers(model)]
    return loss.detach(), grads, counts, meter.bytes, flops.get_total_flops()


def test_moe_selective_gives_the_losses_gradients_and_routing_of_none():
    # The kept top-k routes the recomputation as the forward did; the rest reruns the same CPU kernels on the same
    # inputs: bit-identical. A shared expert, a capacity (a data-dependent mask) and the balancing bias on; the
    # routing counts (aux and z statistics included) accumulated once per forward, not again in the recomputation.
    moe = dict(num_shared_experts=1, capacity_factor=1.0, bias_update_rate=1e-2)
    ref, sel = moe_step("none", 2, **moe), moe_step("selective", 2, **moe)
    assert torch.equal(sel[0], ref[0])
    assert sel[1].keys() == ref[1].keys()
    for name, g in sel[1].items():
        assert torch.equal(g, ref[1][name]), name
    assert all(torch.equal(a, b) for a, b in zip(sel[2], ref[2])) and len(sel[2]) == 2


@pytest.mark.parametrize("shared, save_matmuls, autocast", [(1, "all", False), (1, "every_other", True),
                                                            (0, "every_other", False)])
def test_moe_selective_keeps_the_planned_bytes_and_recomputes_the_planned_flops(shared, save_matmuls, autocast):
    """As the dense test above, on an MoE block: the router's, the grouped experts' and the shared experts' outputs
    and the top-k kept, measured against planning/recompute.py's MoE row within 1% (exact here). `all` recomputes no
    matmul; every_other the 2nd, 4th, ... including the last, since the block's auxiliary losses follow it."""
    from lit_pretrain.planning.recompute import recompute_flops, selective_block_bytes

    moe = dict(num_shared_experts=shared)
    shape = (4, 2, 24, shared)
    per_block = moe_step("selective", 2, save_matmuls, autocast, **moe)[3] - moe_step(
        "selective", 1, save_matmuls, autocast, **moe)[3]
    planned = selective_block_bytes(T, B, D, 4, 128, bytes_per_element=2.0 if autocast else 4.0, kv_heads=2,
                                    residual_bytes=4.0, save_matmuls=save_matmuls, moe=shape)
    assert per_block == pytest.approx(planned, rel=0.01), (per_block, planned)
    recomputed = moe_step("selective", 1, save_matmuls, autocast, **moe)[4] - moe_step("none", 1, autocast=autocast,
                                                                                          **moe)[4]
    planned_flops = recompute_flops("selective", T, B, D, 4, 128, kv_heads=2, save_matmuls=save_matmuls,
                                    moe=shape)["matmul"]
    assert recomputed == pytest.approx(planned_flops, rel=0.01, abs=0), (recomputed, planned_flops)
    assert (planned_flops > 0) == (save_matmuls == "every_other")


def test_moe_memory_plan_counts_selective_and_full_by_block_kind():
    """memory_plan with model.moe: a dense first block and two MoE blocks. Full recomputes an MoE block's every
    matmul (FlopCounterMode's count); the selective row per layer is the larger block's (the dense one here), its
    recomputed FLOPs the sum over the blocks of their kinds (their own counts are measured in the tests above)."""
    from lit_pretrain.model.config import MoEConfig
    from lit_pretrain.planning.memory import memory_plan
    from lit_pretrain.planning.plan import ParallelPlan
    from lit_pretrain.planning.recompute import recompute_flops

    shape = (4, 2, 24, 1)
    full = moe_step("full", num_shared_experts=1)[4] - moe_step("none", num_shared_experts=1)[4]
    assert full == pytest.approx(recompute_flops("full", T, B, D, 4, 128, kv_heads=2, moe=shape)["matmul"], rel=0.01)
    cfg = GPTConfig(n_layers=3, moe=MoEConfig(**MOE, num_shared_experts=1, first_dense_layers=1), **SHAPE)
    plan = memory_plan(ParallelPlan(activation_checkpointing="selective",
                                    activation_checkpointing_save_matmuls="every_other"),
                       cfg, B, precision="32-true")
    dense = recompute_flops("selective", T, B, D, 4, cfg.hidden_dim, kv_heads=2, save_matmuls="every_other")
    moe = recompute_flops("selective", T, B, D, 4, cfg.hidden_dim, kv_heads=2, save_matmuls="every_other", moe=shape)
    assert plan["recompute_flops"] == {k: dense[k] + 2 * moe[k] for k in dense}
    moe_block = moe_step("selective", 2, "every_other", num_shared_experts=1)[3] - moe_step(
        "selective", 1, "every_other", num_shared_experts=1)[3]
    dense_block = measured("selective", "every_other", 2)[0] - measured("selective", "every_other", 1)[0]
    # here the dense block (SwiGLU width 128 over N tokens) keeps more than the MoE one (width 24 over 2N copies)
    assert dense_block > moe_block
    assert plan["activation_bytes_per_layer"] == pytest.approx(max(dense_block, moe_block), rel=0.01)
