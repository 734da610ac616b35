"""Sliding-window attention with a local-global pattern (model.sliding_window, model.global_attention_every,
model.layer_types): one mask term (model/mask.py `sliding_window`), one table entry (`GPTConfig.attention_window`),
and what reads them: the FLOP counter (a closed form against the mask itself), the memory planner, document
masking, the KV cache, context parallelism's chunks, the pipeline's stages and the config's checks."""

import pytest
import torch

from lit_pretrain import config
from lit_pretrain.errors import ConfigError
from lit_pretrain.model.config import GPTConfig, flops_per_token_formula
from lit_pretrain.model.gpt import GPT, document_ids
from lit_pretrain.model.mask import Mask, sdpa_mask
from lit_pretrain.model.mask_spec import CAUSAL, MaskSpec, layers_mask_bytes
from lit_pretrain.model.shapes import flops_per_token
from lit_pretrain.planning.memory import context_mask_bytes, memory_plan
from lit_pretrain.planning.plan import ParallelPlan
from tests.conftest import EXPERIMENTS
from tests.model.test_attention_mask import EOD, Recorder, context_group, windows  # noqa: F401 (a fixture)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(seed=0, **window) -> GPT:
    """3 layers of width 32; init_std 0.5 gives logits of a few units, so 1e-5 is a test near fp32's rounding."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=61, n_layers=3, d_model=32, n_heads=4, n_kv_heads=2, seq_len=32, init_std=0.5,
                    **window)
    return GPT(cfg).eval()


TINY = EXPERIMENTS / "runs" / "tiny.yaml"
GEMMA = dict(sliding_window=5, global_attention_every=3)  # layers 0, 1 local, layer 2 global (Gemma 3's 5:1 is 6)


@pytest.mark.parametrize("window,layer_types,want", [
    (dict(sliding_window=8), None, [8] * 6),  # Mistral: every layer local
    (dict(sliding_window=8, global_attention_every=6), None, [8, 8, 8, 8, 8, None]),  # Gemma 3's 5:1
    (dict(sliding_window=8, global_attention_every=2), None, [8, None] * 3),  # GPT-OSS's alternation
    (dict(sliding_window=8), ["full", "sliding", "sliding", "full", "full", "sliding"], [None, 8, 8, None, None, 8]),
    ({}, None, [None] * 6),
])
def test_the_table_entry_names_each_layers_window(window, layer_types, want):
    cfg = GPTConfig(n_layers=6, layer_types=layer_types, **window)
    cfg.check()
    assert [cfg.attention_window(i) for i in range(6)] == want
    assert [m.window for m in cfg.mask_specs()] == want


@pytest.mark.parametrize("T,w", [(16, 1), (16, 4), (16, 15), (33, 7), (16, 16), (16, 40)])
def test_counted_attention_pairs_are_the_closed_form_and_what_the_mask_keeps(T, w):
    """MFU never above the truth: a windowed layer is counted over exactly the pairs its mask keeps, the query at
    position p (from 1) seeing min(w, p) keys; a window that cuts nothing (w >= T) is a full layer, counted as PaLM
    counts full attention (T·T)."""
    closed = sum(min(w, p) for p in range(1, T + 1))
    allowed = sdpa_mask(Mask(window=w), T, T, torch.zeros(1)).attn_mask
    spec = MaskSpec(window=w)
    if w < T:
        assert spec.scored_pairs(T) == closed == int(allowed.sum())
        assert spec.scored_pairs(T) == w * (w + 1) // 2 + (T - w) * w
    else:
        assert allowed is None and spec.scored_pairs(T) == T * T == CAUSAL.scored_pairs(T)
    assert MaskSpec(documents=True, window=w).scored_pairs(T) == spec.scored_pairs(T)


def test_flops_per_token_sums_each_layers_attention():
    # 6·N + 12·H·Q·(sum over layers of the pairs) / T: Gemma-like pattern of 2 local layers (w 5) and 1 global, T 32
    n, H, Q, T, w = 1000, 4, 8, 32, 5
    window_pairs = sum(min(w, p) for p in range(1, T + 1))  # 150
    want = 6 * n + (12 * H * Q * (2 * window_pairs + T * T)) // T
    masks = [MaskSpec(window=w), MaskSpec(window=w), MaskSpec()]
    assert flops_per_token_formula(n, 3, H, Q, T, masks) == want == 6000 + 384 * 1324 // 32  # 21888
    assert flops_per_token_formula(n, 3, H, Q, T) == 6 * n + 12 * 3 * H * Q * T  # full attention, unchanged
    # The model and the pure count agree, and a window can only lower the count.
    model = tiny(**GEMMA)
    assert model.flops_per_token() == flops_per_token(model.cfg)
    assert model.flops_per_token() < tiny().flops_per_token()
    assert tiny(sliding_window=32).flops_per_token() == tiny().flops_per_token()  # w >= T: full layers


@pytest.mark.parametrize("layer_types,reach", [(None, 6), (["sliding", "full"], 31)], ids=["local", "local_global"])
@torch.no_grad()
def test_a_window_bounds_what_each_position_sees(layer_types, reach):
    """Two local layers of window 4: position i reads tokens i - 6 .. i (2 x (w - 1) back), nothing earlier; with
    the last layer global, every earlier token."""
    idx = windows()[:1]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=61, n_layers=2, d_model=32, n_heads=4, seq_len=32, init_std=0.5,
                          sliding_window=4, layer_types=layer_types)).eval()
    changed = idx.clone()
    changed[0, 10] = idx[0, 10] % 60 + 1
    moved = (model(changed) - model(idx)).abs().amax(-1)[0] > 0  # (T,): the positions the change reached
    assert moved.nonzero().flatten().tolist() == list(range(10, min(32, 11 + reach)))


@torch.no_grad()
def test_windows_go_through_sdpa_mask_one_mask_per_window(monkeypatch):
    model, idx = tiny(**GEMMA), windows()
    rec = Recorder(monkeypatch)
    model(idx)
    assert (rec.calls, rec.built) == (3, 3)  # each layer asks; the window layers get the one cached tensor
    assert rec.tensors[0].attn_mask is rec.tensors[1].attn_mask
    model(idx, document_ids=document_ids(idx, EOD))
    assert (rec.calls, rec.built) == (6, 5)  # documents: one mask per distinct window (5 and none), per forward


@torch.no_grad()
def test_documents_and_window_compute_each_document_alone():
    """Document masking composed with the window: each document's logits are those of the document alone in a
    window (positions restart, the window counted inside it)."""
    model, idx = tiny(**GEMMA), windows()
    got = model(idx, document_ids=document_ids(idx, EOD))
    for row, ends in ((0, [5, 17]), (1, [11])):
        start = 0
        for end in ends + [31]:
            alone = model(idx[row:row + 1, start:end + 1])
            # the same sums over the same keys, in SDPA calls of other shapes: fp32 rounding of logits of a few units
            torch.testing.assert_close(got[row:row + 1, start:end + 1], alone, rtol=0, atol=2e-5)
            start = end + 1


@torch.no_grad()
def test_generation_with_the_window_equals_the_full_forward():
    """The KV cache: prefill, a chunk and single tokens past the window: the window counted back from each query."""
    model, idx = tiny(**GEMMA), windows()
    want = model(idx)
    cache = model.new_cache(2)
    got = [model.forward_cached(idx[:, :7], cache)]  # last position 6
    got.append(model.forward_cached(idx[:, 7:12], cache))  # 5 queries over 12 keys, each its own window
    got += [model.forward_cached(idx[:, t:t + 1], cache) for t in range(12, 32)]
    positions = [6, 11] + list(range(12, 32))
    # other SDPA shapes sum the same terms in other orders: fp32 rounding of logits up to ~10, measured 2.6e-5 here
    # (2.0e-5 without the window); 1e-4 as tests/evaluation/test_generate.py, while a window off by one key moves
    # them by 1e-1 or more
    torch.testing.assert_close(torch.stack(got, 1), want[:, positions], rtol=0, atol=1e-4)


def test_context_parallel_chunks_with_a_window_match_one_process(context_group):  # noqa: F811
    """c = 1 still cuts the window into two chunks of 16: a window of 5 crosses their edge."""
    from lit_pretrain.parallel.context import install_context_parallel

    idx = windows()
    docs = document_ids(idx, EOD)
    with torch.no_grad():
        want, want_docs = tiny(**GEMMA)(idx), tiny(**GEMMA)(idx, document_ids=docs)
    model = tiny(**GEMMA)
    install_context_parallel(model, context_group)
    with torch.no_grad():
        got, got_docs = model(idx), model(idx, document_ids=docs)
    # the same sums in other SDPA calls (two chunks, or the window layers' one masked call): fp32 rounding only
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_docs, want_docs, rtol=0, atol=1e-5)


def test_the_pipeline_stages_keep_each_layers_window():
    from lit_pretrain.parallel.pipeline import prune_to_stages

    model, idx = tiny(**GEMMA), windows()
    with torch.no_grad():
        want = model(idx)
        (stage,) = prune_to_stages(model, [(0, 3)], [0])
        assert torch.equal(stage(idx), want)


def test_mask_bytes_are_what_the_forward_builds(context_group):  # noqa: F811
    from lit_pretrain.parallel.context import install_context_parallel

    T = 32
    specs = tiny(**GEMMA).cfg.mask_specs()
    built = sdpa_mask(Mask(window=5), T, T, torch.zeros(1)).attn_mask  # the cached one every window layer reads
    assert layers_mask_bytes(specs, T) == built.numel() * built.element_size() == T * T
    assert layers_mask_bytes(specs, T, cuda=True) == T * T  # no fused kernel takes a window
    docs = document_ids(windows(), EOD)
    by_window = {w: sdpa_mask(Mask(docs, window=w), T, T, docs).attn_mask for w in (5, None)}
    with_documents = [MaskSpec(True, s.window) for s in specs]
    assert layers_mask_bytes(with_documents, T, 2) == sum(m.numel() for m in by_window.values()) == 2 * 2 * T * T
    assert layers_mask_bytes([MaskSpec(window=40)], T) == 0.0  # a window that cuts nothing: is_causal
    # context parallelism: the window layers' (T/c, T) boolean beside the full layers' additive (T/(2c), T) (CPU)
    assert context_mask_bytes(T, 2, masks=specs) == 16 * 32 + 4.0 * 8 * 32
    model = tiny(**GEMMA)
    cp = install_context_parallel(model, context_group)
    with torch.no_grad():
        model(windows())
    (held,) = cp._window_masks.values()
    assert held.numel() * held.element_size() == MaskSpec(window=5).mask_bytes(T, context_parallel=1)
    # the planner's row: the first stage's window layers' mask, on CUDA too
    cfg = tiny(**GEMMA).cfg
    plan = memory_plan(ParallelPlan(), cfg, micro_batch=2)
    assert plan["mask_bytes"] == T * T and memory_plan(ParallelPlan(), tiny().cfg, micro_batch=2)["mask_bytes"] == 0


@pytest.mark.parametrize("overrides,message", [
    (["model.global_attention_every=6"], r"^model\.global_attention_every without model\.sliding_window"),
    (["model.layer_types=[sliding,full]"], r"^model\.layer_types without model\.sliding_window"),
    (["model.sliding_window=64", "model.global_attention_every=2", "model.layer_types=[sliding,full]"],
     r"^model\.layer_types and model\.global_attention_every both set"),
    (["model.sliding_window=64", "model.layer_types=[sliding,full]"], r"^model\.layer_types has 2 entries for "
                                                                       r"model\.n_layers=3"),
    (["model.sliding_window=64", "model.layer_types=[sliding,full,local]"], r"^model\.layer_types holds \['local'\]"),
    (["model.sliding_window=64", "model.global_attention_every=1"], r"model\.global_attention_every.*>= 2"),
    (["model.sliding_window=0"], r"model\.sliding_window.*>= 1"),
])
def test_the_config_refuses_a_pattern_said_twice_or_wrongly(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load(TINY, ["model.n_layers=3", *overrides], check_inputs=False)


def test_the_config_takes_a_layer_list():
    pattern = ["model.n_layers=3", "model.sliding_window=16", "model.layer_types=[sliding,sliding,full]"]
    loaded = config.load(TINY, pattern, check_inputs=False)
    assert [loaded.model.attention_window(i) for i in range(3)] == [16, 16, None]
