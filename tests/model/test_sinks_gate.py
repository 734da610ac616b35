"""Attention sinks (model.attention_sinks) and gated attention (model.attention_gate) against hand-written
references (GPT-OSS's eager attention: the sink logit concatenated to the scores; Qiu et al. 2025's G1 gate), with
document masking and the KV cache, and their rows of the architecture table: shapes, counts, FLOPs, the
tensor-parallel roles, init, the optimizer groups and the memory planner's saved bytes. All in-process and tiny."""

import math

import pytest
import torch

from lit_pretrain import config
from lit_pretrain.errors import ConfigError
from lit_pretrain.model import shapes
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT, apply_rope, document_ids, document_mask, document_positions
from lit_pretrain.optim.optimizers import param_groups
from lit_pretrain.parallel.memory import SavedActivations
from lit_pretrain.parallel.tensor import plan_of
from lit_pretrain.planning.memory import memory_plan
from lit_pretrain.planning.plan import ParallelPlan
from tests.conftest import EXPERIMENTS

TINY = dict(vocab_size=64, n_layers=2, d_model=32, n_heads=4, seq_len=16)
VARIANTS = [dict(attention_sinks=True), dict(attention_gate="headwise"), dict(attention_gate="elementwise"),
            dict(attention_sinks=True, attention_gate="elementwise", n_kv_heads=2)]
IDS = ["sinks", "gate_headwise", "gate_elementwise", "sinks_gate_gqa"]


def gpt(**kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY, **kw}))
    with torch.no_grad():  # sinks start at 0; spread them so each head's sink weighs differently
        for block in model.blocks:
            if block.attn.sinks is not None:
                block.attn.sinks.weight.copy_(torch.tensor([-2.0, 0.0, 1.0, 3.0]))
    return model


def reference_attention(attn, x, cos, sin, allowed, n_kv_heads):
    """The attention output written head by head: scores softmax(q kᵀ/sqrt(Q) masked), the sink logit appended as
    one more column and dropped after the softmax (GPT-OSS's eager_attention_forward), then each head times
    sigmoid(x W_g) (one gate per head or per channel), then wo. allowed: (B, T, T) bool."""
    B, T, d = x.shape
    H = attn.wq.weight.shape[0] // attn.head_dim
    Q = d // H
    q = apply_rope((x @ attn.wq.weight.T).view(B, T, H, Q), cos, sin)
    k = apply_rope((x @ attn.wk.weight.T).view(B, T, n_kv_heads, Q), cos, sin)
    v = (x @ attn.wv.weight.T).view(B, T, n_kv_heads, Q)
    heads = []
    for h in range(H):
        g = h // (H // n_kv_heads)
        scores = ((q[:, :, h] @ k[:, :, g].transpose(1, 2)) / math.sqrt(Q)).masked_fill(~allowed, float("-inf"))
        if attn.sinks is not None:
            scores = torch.cat([scores, attn.sinks.weight[h].expand(B, T, 1)], dim=-1)  # (B, T, T + 1)
        y = scores.softmax(-1)[..., :T] @ v[:, :, g]  # (B, T, Q)
        if attn.wg is not None:
            gates = torch.sigmoid(x @ attn.wg.weight.T).view(B, T, H, -1)  # (B, T, H, 1 or Q)
            y = y * gates[:, :, h]
        heads.append(y)
    return torch.cat(heads, dim=-1) @ attn.wo.weight.T  # (B, T, d)


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_attention_is_the_hand_written_reference(variant, documents):
    """Forward and the sinks' and gate's gradients, fp32: only summation order differs (1e-6 at outputs ~1e-2)."""
    model = gpt(**variant)
    attn, kv = model.blocks[0].attn, model.cfg.kv_heads
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    idx = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    idx[0, 5], idx[1, 10] = 0, 0  # EOD id 0: two documents in each row
    if documents:
        docs = document_ids(idx, 0)
        positions = document_positions(docs)
        cos, sin = model.rope_cos[positions], model.rope_sin[positions]  # (B, T, Q)
        mask = document_mask(docs)  # (B, 1, T, T)
        allowed = mask[:, 0]
    else:
        cos, sin, mask = model.rope_cos, model.rope_sin, None
        allowed = torch.ones(16, 16, dtype=torch.bool).tril().expand(2, 16, 16)
    ours = attn(x, cos, sin, mask)
    ref = reference_attention(attn, x, cos, sin, allowed, kv)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
    params = [p for p in (attn.sinks, attn.wg) if p is not None]
    g_ours = torch.autograd.grad(ours.square().sum(), [p.weight for p in params])
    g_ref = torch.autograd.grad(ref.square().sum(), [p.weight for p in params])
    for a, b in zip(g_ours, g_ref):
        assert a.abs().max() > 0  # the sinks and the gate learn
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_sink_far_below_every_score_is_no_sink():
    """exp(-1e4) underflows to 0: the model with sinks at -1e4 computes the sink-free model's logits (the math path
    against the fused kernel: summation order only)."""
    plain, sunk = gpt(), gpt(attention_sinks=True)
    sunk.load_state_dict({**plain.state_dict(), **{f"blocks.{i}.attn.sinks.weight": torch.full((4,), -1e4)
                                                    for i in range(2)}})
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(sunk(idx), plain(idx), atol=1e-6, rtol=1e-5)
        assert (gpt(attention_sinks=True)(idx) - plain(idx)).abs().max() > 1e-3  # the spread sinks change them


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_cached_decoding_matches_the_full_forward(variant):
    """The KV cache's chunks (a prefix, then one token at a time) see the sink once per query, as the forward does."""
    model = gpt(**variant)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(idx)  # (B, T, V)
        cache = model.new_cache(2)
        steps = [model.forward_cached(idx[:, :9], cache)] + [model.forward_cached(idx[:, t:t + 1], cache)
                                                              for t in range(9, 16)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 8:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_the_built_model_is_the_architecture_table(variant):
    cfg = GPTConfig(**{**TINY, **variant})
    with torch.device("meta"):
        model = GPT(cfg)
    assert list((n, tuple(p.shape)) for n, p in model.named_parameters()) == list(shapes.param_shapes(cfg).items())
    assert model.num_params(non_embedding=False) == shapes.params(cfg)
    assert model.flops_per_token() == shapes.flops_per_token(cfg)
    assert plan_of(model) == shapes.tensor_parallel_plan(cfg)
    H, Q, d = 4, 8, 32
    extra = {"attn.sinks": H if cfg.attention_sinks else 0,
             "attn.wg": {None: 0, "headwise": H * d, "elementwise": H * Q * d}[cfg.attention_gate]}
    base = GPTConfig(**{**TINY, "n_kv_heads": cfg.n_kv_heads})
    assert shapes.params(cfg) - shapes.params(base) == 2 * sum(extra.values())  # two blocks
    # the gate is a matmul (6 FLOPs a parameter a token, PaLM appendix B); a sink is a bias counted like a norm gain
    assert shapes.flops_per_token(cfg) - shapes.flops_per_token(base) == 6 * 2 * sum(extra.values())
    roles = shapes.tensor_parallel_plan(cfg)
    assert all(roles[f"blocks.0.{name}"] == "column" for name, n in extra.items() if n)


def test_sinks_start_at_zero_undecayed_and_the_gate_decays():
    """Sinks: biases of the logits, so optim's "biases" kind (undecayed by default, on AdamW under Muon); the gate
    is a hidden matrix like wq, drawn from N(0, init_std). Sinks draw nothing: a seed gives the sink-free weights."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, attention_sinks=True, attention_gate="headwise"))
    sinks = [b.attn.sinks.weight for b in model.blocks]
    assert all(torch.equal(s, torch.zeros(4)) for s in sinks)
    assert 0.01 < model.blocks[0].attn.wg.weight.std() < 0.03
    groups = param_groups(model, 0.1)
    decayed = {id(p) for g in groups if g["weight_decay"] for p in g["params"]}
    assert not decayed & {id(s) for s in sinks}
    assert id(model.blocks[0].attn.wg.weight) in decayed
    torch.manual_seed(0)
    plain = GPT(GPTConfig(**TINY)).state_dict()
    torch.manual_seed(0)
    sunk = GPT(GPTConfig(**TINY, attention_sinks=True)).state_dict()
    assert set(sunk) - set(plain) == {"blocks.0.attn.sinks.weight", "blocks.1.attn.sinks.weight"}
    assert all(torch.equal(w, sunk[name]) for name, w in plain.items())


@pytest.mark.parametrize("variant", VARIANTS + [dict(attention_sinks=True, qk_norm=True, n_kv_heads=1)],
                         ids=IDS + ["sinks_qk_norm_mqa"])
def test_planned_activations_are_what_a_block_saves(variant):
    """memory's per-block count (planning/memory.py) against the saved-tensor hooks, one process, fp32: exact."""
    cfg = GPTConfig(**{**TINY, "d_ff": 64, **variant})
    model = gpt(**{"d_ff": 64, **variant})
    h = model.tok_embeddings(torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(7)))
    with SavedActivations(model) as meter:
        out = model.blocks[0](h, model.rope_cos, model.rope_sin)
    out.pow(2).mean().backward()
    assert meter.bytes == memory_plan(ParallelPlan(), cfg, 8, precision="32-true")["activation_bytes_per_layer"]


def test_an_unknown_gate_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"model[.]attention_gate"):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", ["model.attention_gate=channelwise"])
