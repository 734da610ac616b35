"""Multi-head latent attention (model.attention=mla, model/mla.py) against DeepSeek-V2's closed forms, the built
model against the architecture table, its KV cache of latents against the full forward, document masking through
the one mask function, and its refusals at load. In-process and tiny; its parity under tensor and context
parallelism is in tests/parallel/test_mesh_parallel.py (MLA_CASES_2), its export in tests/interop/test_hf.py."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lit_pretrain import config
from lit_pretrain.errors import ConfigError
from lit_pretrain.model import shapes
from lit_pretrain.model.config import GPTConfig, MLAConfig
from lit_pretrain.model.gpt import GPT, document_ids
from lit_pretrain.parallel.tensor import partial_params, plan_of
from lit_pretrain.planning.memory import kv_cache_bytes_per_token, memory_plan
from lit_pretrain.planning.plan import ParallelPlan
from tests.conftest import EXPERIMENTS

TINY = dict(vocab_size=64, n_layers=2, d_model=32, n_heads=4, seq_len=16)
RANKS = dict(kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6)


def mla_cfg(q_lora_rank=None, **kw) -> GPTConfig:
    return GPTConfig(**{**TINY, **kw}, attention="mla", mla=MLAConfig(**RANKS, q_lora_rank=q_lora_rank))


def attention_params(d, H, q_lora, kv_lora, rope, nope, v):
    """DeepSeek-V2 §2.1 (eq. 9-14, 37-47): W^DQ (d_c' x d), its norm, W^UQ and W^QR stacked (H(d_h + d_h^R) x d_c'),
    or one W^Q (H(d_h + d_h^R) x d) without query compression; W^DKV and W^KR stacked ((d_c + d_h^R) x d), the latent's
    norm (d_c), W^UK and W^UV stacked (H(d_h + d_h^V) x d_c), W^O (d x H d_h^V)."""
    query = d * H * (nope + rope) if q_lora is None else d * q_lora + q_lora + q_lora * H * (nope + rope)
    return query + d * (kv_lora + rope) + kv_lora + kv_lora * H * (nope + v) + H * v * d


@pytest.mark.parametrize("dims, expected", [
    # DeepSeek-V3 (DeepSeek-AI 2024, §4.2: d 7168, 128 heads, d_c 512, d_c' 1536, d_h^R 64, d_h 128):
    # 11,010,048 + 1,536 + 37,748,736 + 4,128,768 + 512 + 16,777,216 + 117,440,512
    ((7168, 128, 1536, 512, 64, 128, 128), 187_107_328),
    # DeepSeek-V2-Lite (d 2048, 16 heads, no query compression): 6,291,456 + 1,179,648 + 512 + 2,097,152 + 4,194,304
    ((2048, 16, None, 512, 64, 128, 128), 13_763_072),
    # this file's tiny model with query compression: 768 + 24 + 1,152 + 640 + 16 + 896 + 768
    ((32, 4, 24, 16, 4, 8, 6), 4_264),
])
def test_attention_parameters_are_deepseek_v2s_closed_form(dims, expected):
    d, H, q_lora, kv_lora, rope, nope, v = dims
    assert attention_params(*dims) == expected
    cfg = GPTConfig(vocab_size=64, n_layers=1, d_model=d, n_heads=H, seq_len=16, attention="mla",
                    mla=MLAConfig(kv_lora_rank=kv_lora, q_lora_rank=q_lora, qk_rope_head_dim=rope,
                                  qk_nope_head_dim=nope, v_head_dim=v))
    assert sum(s.numel for n, s in cfg.block_modules().items() if n.startswith("attn.")) == expected


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["query_projected", "query_compressed"])
def test_the_built_model_is_the_architecture_table(q_lora_rank):
    """Names, shapes, counts, FLOPs, tensor-parallel roles (heads split like wq, the down-projections and their
    norms replicated, as Megatron-LM's MLA), residual marks and init, from the table alone."""
    cfg = mla_cfg(q_lora_rank, tie_embeddings=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes.param_shapes(cfg)
    assert model.num_params(non_embedding=False) == shapes.params(cfg)
    assert model.flops_per_token() == shapes.flops_per_token(cfg)
    query = {"attn.wq": "column"} if q_lora_rank is None else {"attn.wq_b": "column"}
    roles = {**query, "attn.wkv_b": "column", "attn.wo": "row"}
    assert {k.split(".", 2)[2]: v for k, v in plan_of(model).items() if k.startswith("blocks.0.attn")} == roles
    assert plan_of(model) == shapes.tensor_parallel_plan(cfg) and partial_params(model) == []
    residual = {n for n, m in model.named_modules() if getattr(m, "residual_projection", False)}
    assert residual == {f"blocks.{i}.{name}" for i in range(2) for name in ("attn.wo", "mlp.w_down")}
    # scaled_residual init: wo ~ N(0, 0.02 / sqrt(2 L)) = N(0, 0.01), the other matrices N(0, 0.02), norms 1;
    # 768..1,152 draws each: their std within 10% (4 standard errors of a sample std at n ~ 800)
    attn = model.blocks[0].attn
    assert abs(attn.wo.weight.std().item() / 0.01 - 1) < 0.1
    assert abs(attn.wkv_b.weight.std().item() / 0.02 - 1) < 0.1
    assert torch.equal(attn.kv_norm.weight, torch.ones(16)) and attn.kv_norm.eps == 1e-6


def test_flops_are_6n_plus_the_scores_and_values_width_and_match_the_counter():
    """PaLM appendix B with the value heads' own width: 6·N + 6·L·H·(d_qk + d_v)·T, N the matmul parameters and the
    head; and torch's FlopCounterMode over a forward and backward (MATH SDPA: two bmms forward, four backward)."""
    cfg = mla_cfg(24, seq_len=16)
    B, T = 2, 16
    model = GPT(cfg)
    matmul = shapes.non_embedding_params(cfg) + 64 * 32  # + the head's V·d
    norms = (2 * 2 + 1) * 32 + 2 * (24 + 16)  # the block norms, the final one, each block's q_norm and kv_norm
    # tiny: non-embedding 2 x (4,264 attention + 3·32·128 MLP + 64 norms) + 32 = 33,264; + 2,048 head = 35,312
    assert matmul == 35_312
    # 6·35,312 = 211,872; 6·2·4·(12 + 6)·16 = 13,824
    assert shapes.flops_per_token(cfg) == 211_872 + 13_824 == 225_696
    idx = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    # the counter sees matmuls only: norms are elementwise (6 FLOPs a weight a token counted by PaLM's N); and the
    # value heads zero-padded to the queries' width for SDPA's fused kernel (mla._sdpa), 6·L·H·(d_qk - d_v)·T a
    # token that the model's FLOPs leave out (padding, not the model's work: MFU stays at or below the truth)
    padded = 6 * 2 * 4 * (12 - 6) * T
    assert counter.get_total_flops() == (shapes.flops_per_token(cfg) - 6 * norms + padded) * B * T


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["query_projected", "query_compressed"])
def test_cached_generation_holds_latents_and_equals_the_full_forward(q_lora_rank):
    """The cache holds each position's latent (kv_lora_rank) and shared rotated key (qk_rope_head_dim), not the
    heads' keys and values; a prefix then token-by-token decoding gives the full forward's logits."""
    torch.manual_seed(0)
    model = GPT(mla_cfg(q_lora_rank)).eval()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx)  # (B, T, V)
        cache = model.new_cache(2)
        steps = [model.forward_cached(idx[:, :9], cache)] + [model.forward_cached(idx[:, t:t + 1], cache)
                                                            for t in range(9, 16)]
    # fp32, logits ~0.1: the cached path multiplies the same weights in other shapes (a few ulps); a position off
    # by one or a missing rotation moves them by ~1e-2
    assert (torch.stack(steps, 1) - full[:, 8:]).abs().max() < 1e-5
    assert cache.k.shape == (2, 2, 1, 16, 16) and cache.v.shape == (2, 2, 1, 16, 4)
    per_token = (cache.k[:, 0].numel() + cache.v[:, 0].numel()) * cache.k.element_size() / 16
    assert per_token == kv_cache_bytes_per_token(model.cfg, 4) == 2 * (16 + 4) * 4  # L x (d_c + d_h^R) x fp32


@pytest.mark.parametrize("q_lora_rank, v_head_dim", [(None, 6), (24, 6), (24, 12)],
                         ids=["values_padded", "query_compressed", "values_as_wide"])
def test_planned_activations_are_what_a_latent_attention_block_saves(q_lora_rank, v_head_dim):
    """memory's per-block count (planning/memory.py) against the saved-tensor hooks, one process, fp32: exact."""
    from lit_pretrain.parallel.memory import SavedActivations

    cfg = GPTConfig(**{**TINY, "d_ff": 64}, attention="mla",
                    mla=MLAConfig(**{**RANKS, "v_head_dim": v_head_dim}, q_lora_rank=q_lora_rank))
    torch.manual_seed(0)
    model = GPT(cfg)
    h = model.tok_embeddings(torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(7)))
    with SavedActivations(model) as meter:
        out = model.blocks[0](h, model.rope_cos, model.rope_sin)
    out.pow(2).mean().backward()
    assert meter.bytes == memory_plan(ParallelPlan(), cfg, 8, precision="32-true")["activation_bytes_per_layer"]


@pytest.mark.parametrize("cfg, expected", [
    # Llama 3 8B (32 layers, 8 key/value heads of 128), bf16: 32 · 8 · (128 + 128) · 2 = 131,072 B (128 KiB)
    (GPTConfig(vocab_size=128256, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8), 131_072),
    # DeepSeek-V3 (61 layers, d_c 512, d_h^R 64), bf16: 61 · (512 + 64) · 2 = 70,272 B; DeepSeek-V2 table 1's
    # (d_c + d_h^R)·l elements, against multi-head attention's 2·n_h·d_h·l = 61 · 2 · 128 · 128 · 2 = 3,997,696 B
    (GPTConfig(vocab_size=129280, n_layers=61, d_model=7168, n_heads=128, attention="mla",
               mla=MLAConfig(kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
                             v_head_dim=128)), 70_272),
    (GPTConfig(vocab_size=129280, n_layers=61, d_model=16384, n_heads=128), 3_997_696),
])
def test_kv_cache_bytes_per_token(cfg, expected):
    assert kv_cache_bytes_per_token(cfg) == expected
    assert memory_plan(ParallelPlan(), cfg, 1)["kv_cache_bytes_per_token"] == expected


def test_documents_are_computed_as_if_alone():
    """Document masking through the one mask function: the second document of a packed window gets the logits it
    gets alone in a window (RoPE restarting at its first token)."""
    torch.manual_seed(0)
    model = GPT(mla_cfg(24)).eval()
    idx = torch.randint(1, 64, (1, 16), generator=torch.Generator().manual_seed(3))
    idx[0, 5] = 0  # an end-of-document token: positions 6.. are the second document
    with torch.no_grad():
        packed = model(idx, document_ids=document_ids(idx, 0))
        alone = model(idx[:, 6:])
    assert (packed[:, 6:] - alone).abs().max() < 1e-5  # fp32, another SDPA mask: a few ulps


@pytest.mark.parametrize("overrides, key", [
    (["model.attention=mla"], "model.mla"),
    (["model.mla.kv_lora_rank=8"], "model.mla"),  # ranks given, attention left mha
    (["model.attention=mla", "model.mla.kv_lora_rank=8", "model.n_kv_heads=2"], "model.n_kv_heads"),
    (["model.attention=mla", "model.mla.kv_lora_rank=8", "model.qk_norm=true"], "model.qk_norm"),
    (["model.attention=mla", "model.mla.qk_rope_head_dim=3"], "model.mla.qk_rope_head_dim"),
    (["model.attention=mla", "model.mla.kv_lora_rank=8", "strategy=tensor", "trainer.devices=2",
      "strategy.sequence_parallel=true"], "strategy.sequence_parallel"),
])
def test_bad_latent_attention_is_refused_when_the_config_loads(overrides, key):
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}"):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", overrides)
