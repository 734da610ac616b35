"""Tests of the GPT module: parameter and FLOP conventions, causality, tying, init, RoPE, errors. CPU, float32."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT, apply_rope, flops_per_token_formula, rope_tables


def tiny(**overrides) -> GPTConfig:
    fields = dict(vocab_size=128, n_layers=2, d_model=64, n_heads=4, seq_len=32)
    fields.update(overrides)
    return GPTConfig(**fields)


def build(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


# PaLM appendix B (Chowdhery et al. 2022): training FLOPs per token = 6·N + 12·L·H·Q·T.
@pytest.mark.parametrize(
    "n_matmul_params, n_layers, n_heads, head_dim, seq_len, expected",
    [
        # Tiny: 6·1000 = 6,000; 12·2·4·8·16 = 12,288; sum 18,288.
        (1000, 2, 4, 8, 16, 18_288),
        # GPT-3 Small shape (Brown et al. 2020, Table 2.1: L=12, d=768, H=12, Q=64, T=2048, V=50257).
        # N = 12·L·d² (Kaplan's non-embedding count, 4d² attention + 8d² MLP) + V·d (head)
        #   = 12·12·589,824 + 50,257·768 = 84,934,656 + 38,597,376 = 123,532,032.
        # 6·N = 741,192,192; 12·12·12·64·2048 = 1,728·131,072 = 226,492,416; sum 967,684,608.
        (123_532_032, 12, 12, 64, 2048, 967_684_608),
        # No attention context: T=0 leaves only 6·N = 6·5 = 30 (checks the terms are added, not multiplied).
        (5, 3, 2, 2, 0, 30),
    ],
)
def test_flops_per_token_formula(n_matmul_params, n_layers, n_heads, head_dim, seq_len, expected):
    assert flops_per_token_formula(n_matmul_params, n_layers, n_heads, head_dim, seq_len) == expected


@pytest.mark.parametrize(
    "cfg, non_embedding, total",
    [
        # V=32, L=1, d=16, hidden=32, tied. Block: 4·16² = 1,024 attn + 3·16·32 = 1,536 MLP + 2·16 = 32 norms
        # = 2,592; final norm 16 -> 2,608. Total adds V·d = 32·16 = 512 once -> 3,120.
        (GPTConfig(vocab_size=32, n_layers=1, d_model=16, n_heads=2, d_ff=32, tie_embeddings=True), 2_608, 3_120),
        # Same, untied: embedding 512 + head 512 -> 2,608 + 1,024 = 3,632.
        (GPTConfig(vocab_size=32, n_layers=1, d_model=16, n_heads=2, d_ff=32, tie_embeddings=False), 2_608, 3_632),
        # V=100, L=2, d=32, d_ff null -> hidden = 64·ceil((8·32//3 = 85)/64) = 128, untied.
        # Block: 4·32² = 4,096 + 3·32·128 = 12,288 + 2·32 = 64 = 16,448; ·2 = 32,896; + final norm 32 = 32,928.
        # Total: + 100·32 embedding + 100·32 head = 32,928 + 6,400 = 39,328.
        (GPTConfig(vocab_size=100, n_layers=2, d_model=32, n_heads=4, tie_embeddings=False), 32_928, 39_328),
    ],
)
def test_num_params(cfg, non_embedding, total):
    model = GPT(cfg)
    assert model.num_params(non_embedding=True) == non_embedding
    assert model.num_params() == non_embedding  # the default is the non-embedding count
    assert model.num_params(non_embedding=False) == total


def test_flops_per_token_method_uses_formula_with_head_matmul():
    model = build(tiny())
    # N = num_params(non_embedding) + V·d: the head is a matmul even when its weight is the embedding's.
    n = model.num_params(non_embedding=True) + 128 * 64
    assert model.flops_per_token() == flops_per_token_formula(n, 2, 4, 16, 32)  # T defaults to model.seq_len
    assert model.flops_per_token(8) == flops_per_token_formula(n, 2, 4, 16, 8)


def test_flops_match_flop_counter():
    B, T = 2, 32
    cfg = tiny(seq_len=T)
    model = build(cfg)
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    # The MATH backend is forced because CPU's default SDPA kernel (_scaled_dot_product_flash_attention_for_cpu)
    # has no flop formula in torch.utils.flop_counter (torch 2.13) and would be counted as 0 FLOPs; MATH
    # decomposes into two bmms forward (QKᵀ, PV) and four backward, which FlopCounterMode counts at 2·m·n·k each.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(idx)
        F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    tokens = B * T  # 64

    # Linears: 2 FLOPs per weight per token forward, 4 backward (input grad + weight grad) = 6 per weight.
    # Every Linear's input grad is computed: even block 0's input needs one, as it flows back to the embedding
    # weight (and to attn_norm's weight). The embedding lookup and its backward are not matmuls: not counted.
    # hidden = 64·ceil(170/64) = 192. Matmul weights: 2·(4·64² + 3·64·192) + 128·64 (head) = 106,496 + 8,192
    # = 114,688 -> 6·114,688·64 = 44,040,192.
    linear_params = 114_688
    assert counts == {"aten.mm": 6 * linear_params * tokens, "aten.bmm": counts["aten.bmm"]}
    assert counts["aten.mm"] == 44_040_192
    # Attention: 2 bmms forward + 4 backward, each 2·B·H·T·T·Q = 6 · 2·B·H·T²·Q per layer, i.e. PaLM's
    # 12·H·Q·T per token per layer. The causal mask is an additive -inf on the full T×T scores, so is_causal
    # changes nothing in the count, matching PaLM's full-matrix convention.
    # 12·2·4·16·32 = 49,152 per token; ·64 tokens = 3,145,728.
    assert counts["aten.bmm"] == 12 * 2 * 4 * 16 * T * tokens == 3_145_728

    # flops_per_token keeps the norm weights in N (PaLM counts all parameters); they are elementwise, not
    # matmuls, so the counter misses exactly 6·(2L+1)·d = 6·5·64 = 1,920 FLOPs per token, and nothing else.
    norm_params = (2 * cfg.n_layers + 1) * cfg.d_model
    assert model.flops_per_token(T) * tokens - 6 * norm_params * tokens == counter.get_total_flops()
    assert counter.get_total_flops() == 47_185_920  # 44,040,192 + 3,145,728


@pytest.mark.parametrize("t", [1, 7, 15])
def test_causality(t):
    cfg = tiny(seq_len=16)
    model = build(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, t] = (idx[:, t] + 1) % cfg.vocab_size
    with torch.no_grad():
        before, after = model(idx), model(changed)
    # Exact: positions < t see the same inputs through the same ops on same-shaped tensors, and the causal
    # mask contributes exp(-inf) = 0 exactly, so no rounding can differ.
    assert torch.equal(before[:, :t], after[:, :t])
    assert not torch.allclose(before[:, t], after[:, t])


def test_forward_shape_dtype_and_shorter_input():
    model = build(tiny())
    idx = torch.randint(0, 128, (3, 10))  # T=10 < seq_len=32
    logits = model(idx)
    assert logits.shape == (3, 10, 128)
    assert logits.dtype == torch.float32


def test_submodule_names_and_checkpoint_keys():
    model = build(tiny(tie_embeddings=False))
    keys = set(model.state_dict())
    block = {"attn_norm.weight", "attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "attn.wo.weight",
             "mlp_norm.weight", "mlp.w_gate.weight", "mlp.w_up.weight", "mlp.w_down.weight"}
    expected = {"tok_embeddings.weight", "norm.weight", "lm_head.weight"}
    expected |= {f"blocks.{i}.{name}" for i in range(2) for name in block}
    assert keys == expected  # RoPE tables are non-persistent buffers: not in checkpoints
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    assert all(not linear.bias for linear in model.modules() if isinstance(linear, torch.nn.Linear))


def test_tied_embeddings():
    tied = build(tiny(tie_embeddings=True))
    untied = build(tiny(tie_embeddings=False))
    assert tied.lm_head.weight is tied.tok_embeddings.weight
    assert untied.lm_head.weight is not untied.tok_embeddings.weight
    assert untied.lm_head.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()

    # Same values in both, so the tied gradient must be the sum of the untied model's two gradients.
    untied.load_state_dict(tied.state_dict())
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    for model in (tied, untied):
        logits = model(idx)
        F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    expected_grad = untied.tok_embeddings.weight.grad + untied.lm_head.weight.grad
    # Same ops on same values; only the order autograd accumulates the two contributions may differ (one
    # rounding of fp32 addition, ~1e-7 relative), well inside assert_close's fp32 defaults.
    torch.testing.assert_close(tied.tok_embeddings.weight.grad, expected_grad)

    before = tied.tok_embeddings.weight.detach().clone()
    torch.optim.SGD(tied.parameters(), lr=0.1).step()
    assert tied.lm_head.weight is tied.tok_embeddings.weight
    assert not torch.equal(tied.lm_head.weight, before)
    torch.testing.assert_close(tied.lm_head.weight.detach(), before - 0.1 * expected_grad)


def test_init_std_and_determinism():
    cfg = tiny(n_layers=4, d_model=128, d_ff=256, vocab_size=256)
    model = build(cfg)
    residual = torch.cat([w.flatten() for b in model.blocks for w in (b.attn.wo.weight, b.mlp.w_down.weight)])
    others = torch.cat(
        [model.tok_embeddings.weight.flatten()]
        + [lin.weight.flatten() for b in model.blocks for lin in (b.attn.wq, b.attn.wk, b.attn.wv, b.mlp.w_gate,
                                                                  b.mlp.w_up)]
    )
    # Sample std of n normal draws has relative standard error ~ 1/sqrt(2n): n = 4·(128² + 256·128) = 196,608
    # residual draws -> 0.16%; n > 300k others -> < 0.13%. A 2% tolerance is > 10 standard errors yet would
    # still catch a wrong factor (sqrt(2L) = 2.83 here) or an unscaled init.
    assert residual.std().item() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.02)
    assert others.std().item() == pytest.approx(0.02, rel=0.02)
    assert all(torch.equal(m.weight, torch.ones(128)) for m in model.modules() if isinstance(m, torch.nn.RMSNorm))

    same, other = build(cfg, seed=0), build(cfg, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values()))
    assert not torch.equal(model.blocks[0].attn.wq.weight, other.blocks[0].attn.wq.weight)


def test_rope_scores_depend_only_on_relative_position():
    # RoPE's defining property (Su et al. 2021, eq. 16): <R_m q, R_n k> depends on m - n only.
    head_dim, seq_len = 16, 64
    cos, sin = rope_tables(head_dim, seq_len, theta=10000.0)
    q, k = torch.randn(2, head_dim, generator=torch.Generator().manual_seed(3))
    rq = apply_rope(q.expand(1, seq_len, 1, head_dim), cos, sin)[0, :, 0]  # (T, head_dim): q at every position
    rk = apply_rope(k.expand(1, seq_len, 1, head_dim), cos, sin)[0, :, 0]  # (T, head_dim)
    scores = rq @ rk.T  # (T, T): scores[m, n] = <R_m q, R_n k>
    # Same diagonal m - n = 3 at different absolute positions; fp32 rotation of unit-scale vectors with angles
    # up to 63 rad, so agreement to ~1e-5 absolute is what rounding allows.
    torch.testing.assert_close(scores[3, 0].expand(60), torch.diagonal(scores, offset=-3)[:60], atol=1e-4, rtol=1e-4)
    # Rotation preserves norms, and position 0 is the identity.
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(seq_len))
    torch.testing.assert_close(rq[0], q)


def test_missing_vocab_size_raises():
    with pytest.raises(ValueError, match=r"model\.vocab_size"):
        GPT(tiny(vocab_size=None))


def test_d_model_not_divisible_by_n_heads_raises():
    with pytest.raises(ValueError, match=r"model\.d_model.*model\.n_heads"):
        GPT(tiny(d_model=30, n_heads=4))


def test_odd_head_dim_raises():
    with pytest.raises(ValueError, match=r"model\.d_model / model\.n_heads"):
        GPT(tiny(d_model=36, n_heads=4))  # head_dim 9: RoPE needs pairs


def test_input_longer_than_seq_len_raises():
    model = build(tiny(seq_len=8))
    with pytest.raises(ValueError, match=r"model\.seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
