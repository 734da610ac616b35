"""The model variants mean what they say (against formulas and hand-written references, not against
themselves), and the architecture is described once: a variant changes the parameter counts, the memory planner,
the tensor-parallel plan and the pipeline balance with no edit outside the table. All in-process and tiny."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from lit_pretrain import config
from lit_pretrain.errors import ConfigError
from lit_pretrain.model import shapes
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT, apply_rope
from lit_pretrain.parallel.memory import SavedActivations
from lit_pretrain.parallel.pipeline import stage_bounds
from lit_pretrain.parallel.sequence import sequence_parallel_params
from lit_pretrain.parallel.tensor import partial_params, plan_of
from lit_pretrain.planning.memory import memory_plan
from lit_pretrain.planning.plan import ParallelPlan
from lit_pretrain.scaling.cli import main as scaling_main
from tests.conftest import EXPERIMENTS

TINY = dict(vocab_size=64, n_layers=2, d_model=32, n_heads=4, seq_len=16)
VARIANTS = [{}, dict(n_kv_heads=2), dict(n_kv_heads=1), dict(qk_norm=True), dict(norm="layernorm"),
            dict(mlp="gelu"), dict(logit_softcap=5.0), dict(n_kv_heads=2, qk_norm=True, norm="layernorm", mlp="gelu")]


def gpt(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **kw}))


def test_gqa_with_as_many_kv_heads_as_heads_is_multi_head_attention_bitwise():
    mha, gqa = gpt(), gpt(n_kv_heads=4)
    assert list(mha.state_dict()) == list(gqa.state_dict())
    for name, tensor in mha.state_dict().items():
        assert torch.equal(tensor, gqa.state_dict()[name]), name  # same weights from the same seed
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(mha(idx), gqa(idx))
    # and the grouped kernel path itself (enable_gqa) with groups of one is the multi-head kernel, bit for bit
    q, k, v = (torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True))


def reference_attention(attn, x, cos, sin, n_heads, n_kv_heads):
    """softmax(q kᵀ / sqrt(Q) + causal) v written out head by head; query head h reads key/value head
    h // (n_heads / n_kv_heads) (Ainslie et al. 2023, §2.2: contiguous groups)."""
    B, T, d = x.shape
    Q = d // n_heads
    q = apply_rope((x @ attn.wq.weight.T).view(B, T, n_heads, Q), cos[:T], sin[:T])
    k = apply_rope((x @ attn.wk.weight.T).view(B, T, n_kv_heads, Q), cos[:T], sin[:T])
    v = (x @ attn.wv.weight.T).view(B, T, n_kv_heads, Q)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    heads = []
    for h in range(n_heads):
        g = h // (n_heads // n_kv_heads)
        scores = (q[:, :, h] @ k[:, :, g].transpose(1, 2)) / math.sqrt(Q)  # (B, T, T)
        heads.append(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, :, g])  # (B, T, Q)
    return torch.cat(heads, dim=-1) @ attn.wo.weight.T  # (B, T, d)


@pytest.mark.parametrize("n_kv_heads", [1, 2], ids=["mqa", "gqa"])
def test_grouped_attention_matches_a_hand_written_reference(n_kv_heads):
    model = gpt(n_kv_heads=n_kv_heads)
    attn = model.blocks[0].attn
    assert attn.wk.weight.shape == (n_kv_heads * 8, 32)  # the key/value projections shrink
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = attn(x, model.rope_cos, model.rope_sin)
        ref = reference_attention(attn, x, model.rope_cos, model.rope_sin, 4, n_kv_heads)
    assert (ours - ref).abs().max() < 1e-6  # fp32 summation order only; a wrong grouping is off by ~1e-2
    # decoding with the (smaller) cache gives the full forward's last logits
    idx = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache(2)
    assert cache.k.shape[2] == n_kv_heads
    with torch.no_grad():
        model.forward_cached(idx[:, :6], cache)
        for t in range(6, 10):
            last = model.forward_cached(idx[:, t:t + 1], cache)
        assert (last - model(idx)[:, -1]).abs().max() < 1e-5


def test_qk_norm_normalizes_each_head_before_rope():
    model = gpt(qk_norm=True)
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(4))
    cos, sin = model.rope_cos, model.rope_sin
    with torch.no_grad():
        q, k, _ = attn.qkv(x, cos, sin)  # (B, H, T, Q)

        def rms_norm(y, w):  # Zhang & Sennrich 2019, eq. 4, over each head's Q channels
            return y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * w

        want_q = apply_rope(rms_norm((x @ attn.wq.weight.T).view(2, 16, 4, 8), attn.q_norm.weight), cos, sin)
        want_k = apply_rope(rms_norm((x @ attn.wk.weight.T).view(2, 16, 4, 8), attn.k_norm.weight), cos, sin)
    assert (q.transpose(1, 2) - want_q).abs().max() < 1e-5
    assert (k.transpose(1, 2) - want_k).abs().max() < 1e-5
    # the point of it: queries stay bounded however large wq grows. Scaled 1000x then 2000x (eps, 1e-5 against mean
    # squares of ~1e-3 here, is negligible at both) the queries do not move; without QK-norm they would double.
    with torch.no_grad():
        attn.wq.weight.mul_(1000.0)
        q_big, _, _ = attn.qkv(x, cos, sin)
        attn.wq.weight.mul_(2.0)
        q_bigger, _, _ = attn.qkv(x, cos, sin)
    assert (q_bigger - q_big).abs().max() < 1e-5 and q_big.abs().max() < 2 * q.abs().max()


def test_logit_softcap_is_cap_tanh_of_the_logits():
    plain, capped = gpt(tie_embeddings=False), gpt(tie_embeddings=False, logit_softcap=0.05)
    capped.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        raw, out = plain(idx), capped(idx)
    assert raw.abs().max() > 0.05  # the cap binds on some logits (so tanh is not ~identity here)
    assert torch.allclose(out, 0.05 * torch.tanh(raw / 0.05), atol=1e-7)
    assert out.abs().max() < 0.05


def test_layernorm_and_gelu_mlp_are_their_formulas():
    model = gpt(norm="layernorm", mlp="gelu")
    block = model.blocks[0]
    assert block.attn_norm.bias is None and block.mlp.w_up.weight.shape == (4 * 32, 32)  # GPT-2's 4·d
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        block.mlp_norm.weight.uniform_(0.5, 1.5)
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        want = (x - mean) / torch.sqrt(var + 1e-5) * block.mlp_norm.weight  # Ba et al. 2016, no bias (PaLM)
        assert (block.mlp_norm(x) - want).abs().max() < 1e-5
        h = x @ block.mlp.w_up.weight.T
        gelu = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))  # Hendrycks & Gimpel 2016, exact form
        assert (block.mlp(x) - gelu @ block.mlp.w_down.weight.T).abs().max() < 1e-6


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={v}" for k, v in v.items()) or "base")
def test_the_built_model_is_the_architecture_table(variant):
    """The GPT on the meta device (no memory) against the torch-free table the planner sums: names, shapes, counts,
    the tensor-parallel roles and residual marks on the built modules, and the pipeline's balance."""
    cfg = GPTConfig(**{**TINY, "tie_embeddings": False, **variant})
    with torch.device("meta"):
        model = GPT(cfg)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes.param_shapes(cfg)
    assert model.num_params(non_embedding=False) == shapes.params(cfg)
    assert model.num_params() == shapes.non_embedding_params(cfg)
    assert model.flops_per_token() == shapes.flops_per_token(cfg)
    assert plan_of(model) == shapes.tensor_parallel_plan(cfg)
    residual = {n for n, m in model.named_modules() if getattr(m, "residual_projection", False)}
    assert residual == {f"blocks.{i}.{name}" for i in range(2) for name in ("attn.wo", "mlp.w_down")}
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    assert per_block == shapes.block_params(cfg)
    assert stage_bounds(model, 2) == [(0, 1), (1, 2)]


def test_qk_norm_weights_are_summed_over_heads_not_over_sequence_chunks():
    """Under tensor parallelism a rank's QK-norm weights see its heads on the whole (gathered) sequence: their
    gradients are summed over the group once, as partial; the pre-norms see a sequence chunk under sequence
    parallelism and are summed as such. Counting one in both sums would double it (the mesh parity cases fail)."""
    model = gpt(qk_norm=True, norm="layernorm")
    partial = {id(p) for p in partial_params(model)}
    assert partial == {id(m.weight) for b in model.blocks for m in (b.attn.q_norm, b.attn.k_norm)}
    chunked = {id(p) for p in sequence_parallel_params(model)}
    assert chunked == {id(m.weight) for b in model.blocks for m in (b.attn_norm, b.mlp_norm)} | {id(model.norm.weight)}


def run_cli(argv):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert scaling_main(argv + ["--json"]) == 0
    return json.loads(out.getvalue())


def test_a_variant_moves_plan_memory_tp_plan_and_num_params_with_no_other_edit():
    """Grouped-query attention (8 heads -> 2 key/value heads) is one key: every derived quantity follows."""
    base = dict(vocab_size=512, n_layers=2, d_model=64, n_heads=8, seq_len=32)
    mha, gqa = GPTConfig(**base), GPTConfig(**base, n_kv_heads=2)
    saved = 2 * 2 * 64 * 64 - 2 * 2 * 16 * 64  # per layer: wk and wv shrink from 64x64 to 16x64, two layers
    assert GPT(mha).num_params() - GPT(gqa).num_params() == saved
    with torch.device("meta"):
        sharded = [plan_of(GPT(c)) for c in (mha, gqa)]
    assert sharded[0] == sharded[1]  # the same roles; the k/v rows they split are fewer
    exact = [memory_plan(ParallelPlan(data_parallel_shard=2, zero_stage=3),
                         c, 1, exact=True, precision="32-true") for c in (mha, gqa)]
    assert exact[0]["param_bytes"] - exact[1]["param_bytes"] == 4 * saved / 2  # fp32, halved over 2 shards
    cli = ["memory", "--layers", "2", "--hidden", "64", "--heads", "8", "--vocab", "512", "--seq-len", "32",
           "--exact", "--data-parallel", "2", "--zero-stage", "3", "--precision", "32-true"]
    assert run_cli(cli)["param_bytes"] - run_cli(cli + ["--model", "n_kv_heads=2"])["param_bytes"] == 2 * saved
    planned = [run_cli(["plan", "--params", "1e8"] + extra) for extra in ([], ["--model", "n_kv_heads=2"])]
    assert planned[1]["shape"]["n_kv_heads"] is not None and planned[0]["shape"]["n_kv_heads"] is None
    # the searched shape counts what the GQA model holds: its own parameter count, not multi-head attention's
    s = planned[1]["shape"]
    cfg = GPTConfig(vocab_size=s["vocab_size"], n_layers=s["n_layers"], d_model=s["d_model"], n_heads=s["n_heads"],
                    n_kv_heads=s["n_kv_heads"], seq_len=s["seq_len"])
    assert s["params"] == shapes.params(cfg) < shapes.params(GPTConfig(**{**vars(cfg), "n_kv_heads": None}))


@pytest.mark.parametrize("variant", VARIANTS[:6], ids=lambda v: ",".join(f"{k}={v}" for k, v in v.items()) or "base")
def test_planned_activations_of_a_variant_are_what_a_block_saves(variant):
    """memory's per-block count (planning/memory.py) against the saved-tensor hooks, one process, fp32: exact."""
    cfg = GPTConfig(**{**TINY, "d_ff": 64, **variant})
    model = gpt(**{"d_ff": 64, **variant})
    h = model.tok_embeddings(torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(7)))
    with SavedActivations(model) as meter:
        out = model.blocks[0](h, model.rope_cos, model.rope_sin)
    out.pow(2).mean().backward()
    assert meter.bytes == memory_plan(ParallelPlan(), cfg, 8, precision="32-true")["activation_bytes_per_layer"]


@pytest.mark.parametrize("overrides,key", [
    (["model.n_kv_heads=3"], "model.n_kv_heads=3"),  # tiny.yaml has 4 heads
    (["strategy=tensor", "trainer.devices=2", "model.n_kv_heads=1"], "model.n_kv_heads=1"),
    (["model.norm=batchnorm"], "model.norm"),
    (["model.logit_softcap=0"], "model.logit_softcap"),
])
def test_bad_variants_are_refused_when_the_config_loads(overrides, key):
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}"):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", overrides)
