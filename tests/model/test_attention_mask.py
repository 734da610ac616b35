"""One mask function (model/mask.py `sdpa_mask`) for every attention path, and the pure description the planners
read (model/mask_spec.py)."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lit_pretrain.model import mask as masks
from lit_pretrain.model.config import GPTConfig, flops_per_token_formula
from lit_pretrain.model.gpt import GPT, document_ids
from lit_pretrain.model.mask import CAUSAL, Mask, sdpa_mask
from lit_pretrain.model.mask_spec import MaskSpec
from lit_pretrain.planning.memory import context_mask_bytes

EOD = 0


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(n_kv_heads=2, seed=0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=61, n_layers=3, d_model=32, n_heads=4, n_kv_heads=n_kv_heads, seq_len=32,
                    init_std=0.5)
    return GPT(cfg).eval()


def windows(B=2, T=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, 61, (B, T), generator=g)
    idx[0, [5, 17]] = EOD
    idx[1, [11]] = EOD
    return idx


class Recorder:
    """Wraps `sdpa_mask` wherever a loaded module of ours holds it, and SDPA itself: every SDPA call must pass a
    mask `sdpa_mask` returned (the same tensor object, or a no-mask answer it gave, used once). A path that builds
    its own mask, or sets is_causal itself, fails."""

    def __init__(self, monkeypatch):
        self.tensors, self.plain, self.calls, self.built = [], [], 0, 0
        original, sdpa = masks.sdpa_mask, F.scaled_dot_product_attention

        def counting(*args, **kwargs):
            out = original(*args, **kwargs)
            self.built += 1
            (self.plain if out.attn_mask is None else self.tensors).append(out)
            return out

        def checked(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
            self.calls += 1
            if attn_mask is None:
                assert masks.SdpaMask(None, is_causal) in self.plain, "an SDPA call whose is_causal no sdpa_mask gave"
                self.plain.remove(masks.SdpaMask(None, is_causal))
            else:
                assert any(t.attn_mask is attn_mask and not is_causal for t in self.tensors), \
                    "an SDPA call with a mask sdpa_mask did not make"
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("lit_pretrain") and \
                    getattr(module, "sdpa_mask", None) is original:
                monkeypatch.setattr(module, "sdpa_mask", counting)
        monkeypatch.setattr(F, "scaled_dot_product_attention", checked)


@torch.no_grad()
def test_the_training_forward_causal_and_documents_go_through_sdpa_mask(monkeypatch):
    model, idx = tiny(), windows()
    rec = Recorder(monkeypatch)
    model(idx)
    assert (rec.calls, rec.built) == (3, 3)  # one is_causal answer per layer
    model(idx, document_ids=document_ids(idx, EOD))
    assert (rec.calls, rec.built) == (6, 4)  # one document mask per forward, read by the 3 layers


@torch.no_grad()
def test_the_kv_cache_goes_through_sdpa_mask(monkeypatch):
    model, idx = tiny(), windows()
    rec = Recorder(monkeypatch)
    cache = model.new_cache(2)
    model.forward_cached(idx[:, :7], cache)  # prefill: is_causal
    model.forward_cached(idx[:, 7:12], cache)  # 5 queries over 12 keys: lower right
    model.forward_cached(idx[:, 12:13], cache)  # one query: no mask
    assert rec.calls == rec.built == 9
    assert not rec.plain  # every answer used


def test_the_pipeline_stages_go_through_sdpa_mask(monkeypatch):
    from lit_pretrain.parallel.pipeline import prune_to_stages

    model, idx = tiny(), windows()
    with torch.no_grad():
        want = model(idx)
    (stage,) = prune_to_stages(model, [(0, 3)], [0])  # one stage: embedding, every block, head
    rec = Recorder(monkeypatch)
    with torch.no_grad():
        got = stage(idx)
    assert rec.calls == rec.built == 3
    assert torch.equal(got, want)  # the stage calls the same blocks with the same mask


@pytest.fixture
def context_group(tmp_path):
    """A one-rank gloo group in this process: context parallelism with c = 1 still cuts the window into two chunks
    (the second one's causal triangle aligned to the bottom right)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_context_parallel_chunks_go_through_sdpa_mask_and_match_one_process(monkeypatch, context_group):
    from lit_pretrain.parallel.context import install_context_parallel

    idx = windows()
    docs = document_ids(idx, EOD)
    with torch.no_grad():
        want, want_docs = tiny()(idx), tiny()(idx, document_ids=docs)
    model = tiny()
    install_context_parallel(model, context_group)
    rec = Recorder(monkeypatch)
    with torch.no_grad():
        got = model(idx)
        assert (rec.calls, rec.built) == (6, 6)  # two chunks per layer, each its own answer
        got_docs = model(idx, document_ids=docs)
        assert (rec.calls, rec.built) == (9, 7)
    # The first chunk is SDPA's is_causal over its own keys, the second reads 2n keys with the additive mask: the
    # sums run in other orders than one causal SDPA over the window, so fp32 rounding (logits up to ~10) only.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_docs, want_docs, rtol=0, atol=1e-5)
    assert (got - want).abs().max() < 1e-3 * want.abs().max()


def test_sdpa_mask_answers_cheapest_first():
    q = torch.zeros(1, 1, 4, 8)
    assert sdpa_mask(CAUSAL, 6, 6, q) == (None, True)  # top left: the fused kernel's own triangle
    assert sdpa_mask(Mask(queries=9), 1, 10, q) == (None, False)  # the last query sees every key
    lower = sdpa_mask(Mask(queries=3), 4, 7, q)  # 4 queries ending at key 7, off CUDA: a boolean mask
    assert torch.equal(lower.attn_mask, torch.arange(7)[None, :] <= torch.arange(3, 7)[:, None])
    shared = sdpa_mask(Mask(queries=3), 4, 7, q, shared_width=12)  # cut from one additive mask of 12 columns
    assert shared.attn_mask.shape == (4, 7) and shared.attn_mask.dtype == q.dtype
    assert torch.equal(shared.attn_mask == 0, lower.attn_mask)
    assert sdpa_mask(Mask(queries=8), 4, 12, q, shared_width=12).attn_mask.data_ptr() == \
        shared.attn_mask.data_ptr() - 5 * shared.attn_mask.element_size()  # the same storage, 5 columns to the left
    docs = torch.tensor([[0, 0, 1, 1, 1, 2]])
    built = sdpa_mask(Mask(docs), 6, 6, q).attn_mask  # (1, 1, 6, 6)
    want = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                         [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(built[0, 0], want)
    rows = sdpa_mask(Mask(docs, torch.tensor([4, 1])), 2, 6, q).attn_mask  # scattered queries: their rows
    assert torch.equal(rows[0, 0], want[[4, 1]])


def test_boolean_and_additive_masks_give_bitwise_the_same_attention():
    """The additive mask off CUDA is chosen for sharing, not numerics: SDPA turns a boolean mask into it."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, generator=g, requires_grad=True)
    k, v = torch.randn(2, 2, 24, 16, generator=g), torch.randn(2, 2, 24, 16, generator=g)
    boolean = sdpa_mask(Mask(queries=16), 8, 24, q).attn_mask
    additive = sdpa_mask(Mask(queries=16), 8, 24, q, shared_width=24).attn_mask
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=boolean, enable_gqa=True)
    b = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, enable_gqa=True)
    assert torch.equal(a, b)
    assert torch.equal(*(torch.autograd.grad(y.square().sum(), q)[0] for y in (a, b)))


def test_the_planners_read_the_description_with_todays_numbers():
    # FLOPs: the full T×T score matrix, PaLM's count, under the causal mask and document masking alike
    assert flops_per_token_formula(1000, 2, 4, 8, 64) == 6 * 1000 + 12 * 2 * 4 * 8 * 64
    assert flops_per_token_formula(1000, 2, 4, 8, 64, MaskSpec(documents=True)) == 6 * 1000 + 12 * 2 * 4 * 8 * 64
    # mask bytes: none for is_causal; context parallelism off CUDA: T/(2c) x T elements; documents: B·(T/c)·T bools
    assert MaskSpec().mask_bytes(256, 8) == 0.0
    assert MaskSpec().mask_bytes(256, 8, context_parallel=2) == 4.0 * 64 * 256 == context_mask_bytes(256, 2)
    assert MaskSpec().mask_bytes(256, 8, context_parallel=2, cuda=True) == 0.0
    assert context_mask_bytes(256, 1) == 0.0 and context_mask_bytes(256, 4, 2.0) == 2.0 * 32 * 256
    assert MaskSpec(documents=True).mask_bytes(256, 8) == 8 * 256 * 256
    assert MaskSpec(documents=True).mask_bytes(256, 8, context_parallel=2) == 8 * 128 * 256


def test_the_document_mask_bytes_are_what_the_forward_builds():
    idx = windows()
    built = sdpa_mask(Mask(document_ids(idx, EOD)), 32, 32, idx).attn_mask
    assert built.numel() * built.element_size() == MaskSpec(documents=True).mask_bytes(32, 2)


def test_the_description_imports_without_torch():
    code = ("import sys; import lit_pretrain.model.mask_spec, lit_pretrain.model.shapes; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
