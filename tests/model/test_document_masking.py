"""Document masking (data.document_masking): attention inside each document, positions restarted per document, no
loss across a boundary; and with masking off, the forward and the loss of before."""

import pytest
import torch
import torch.nn.functional as F

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT, document_ids, document_mask, document_positions
from lit_pretrain.module import PretrainModule
from lit_pretrain.schema import OptimConfig, ScheduleConfig

EOD = 3
CFG = dict(vocab_size=61, n_layers=2, d_model=32, n_heads=4, seq_len=48)
# fp32 logits of order 1 computed by the same operations on the same values, in kernels whose blocking (GEMM tiles,
# SDPA over 48 keys with the other document masked, against 20 or 28 keys alone) differs with the shapes, so sums may
# round differently in the last bits: measured 6e-8 (one ulp at 0.8). 1e-5 leaves room for other CPUs' kernels and
# stays far below what a leak shows: without the mask the second document's logits differ from alone by 9e-2, and
# changing one token of the first document moves them by 8e-3.
ATOL = 1e-5


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**CFG)).eval()


def doc(n, seed):
    """n tokens of one document ending with the EOD id (ids never EOD before the end)."""
    ids = torch.randint(EOD + 1, CFG["vocab_size"], (n - 1,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([ids, torch.tensor([EOD])])


def test_document_ids_positions_and_mask_from_the_eod_id():
    idx = torch.tensor([[5, EOD, 7, 8, EOD, EOD, 9]])
    ids = document_ids(idx, EOD)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 3]]  # an EOD ends its document; the next token starts one
    assert document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 0, 0]]
    mask = document_mask(ids)[0, 0]  # (T, T)
    assert mask[3].tolist() == [False, False, True, True, False, False, False]  # 8 sees 7 and itself only
    assert mask.diagonal().all() and not mask.triu(1).any()  # every query sees itself; nothing ahead


@torch.no_grad()
def test_second_document_computed_exactly_as_if_alone_and_first_unchanged_by_what_follows():
    model = tiny_gpt()
    a, b, c = doc(20, 1), doc(28, 2), doc(28, 3)
    window = torch.cat([a, b])[None]  # (1, 48): two documents
    other = torch.cat([a, c])[None]  # the same first document, another second one
    masked = model(window, document_ids=document_ids(window, EOD))
    alone_b, alone_a = model(b[None]), model(a[None])  # plain causal forward, positions from 0
    assert (masked[0, 20:] - alone_b[0]).abs().max() < ATOL
    assert (masked[0, :20] - alone_a[0]).abs().max() < ATOL
    masked_other = model(other, document_ids=document_ids(other, EOD))
    assert torch.equal(masked[0, :20], masked_other[0, :20])  # causal: what follows cannot reach the first
    # Without masking the second document attends to the first and sits at positions 20..47: far from alone.
    assert (model(window)[0, 20:] - alone_b[0]).abs().max() > 1e-2


@torch.no_grad()
def test_rows_of_a_batch_keep_their_own_documents():
    model = tiny_gpt()
    rows = torch.stack([torch.cat([doc(10, 4), doc(38, 5)]), torch.cat([doc(30, 6), doc(18, 7)])])  # (2, 48)
    masked = model(rows, document_ids=document_ids(rows, EOD))
    assert (masked[0, 10:] - model(rows[:1, 10:])[0]).abs().max() < ATOL
    assert (masked[1, 30:] - model(rows[1:, 30:])[0]).abs().max() < ATOL


def before_document_masking(model, idx):
    """The forward as it was before document masking, written out: RoPE over positions 0..T-1, is_causal SDPA."""
    B, T = idx.shape
    cos, sin = model.rope_cos[:T][:, None, :], model.rope_sin[:T][:, None, :]  # (T, 1, head_dim)

    def rope(t):
        t1, t2 = t.float().chunk(2, dim=-1)
        return (t.float() * cos + torch.cat([-t2, t1], dim=-1) * sin).type_as(t)

    x = model.tok_embeddings(idx)
    for block in model.blocks:
        h = block.attn_norm(x)
        q, k, v = (w(h).view(B, T, -1, model.cfg.head_dim) for w in (block.attn.wq, block.attn.wk, block.attn.wv))
        q, k, v = rope(q).transpose(1, 2), rope(k).transpose(1, 2), v.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + block.attn.wo(y)
        x = x + block.mlp(block.mlp_norm(x))
    return model.lm_head(model.norm(x))


def module(eod_id=None, seed=0):
    return PretrainModule(GPTConfig(**CFG), OptimConfig(), ScheduleConfig(), max_steps=1, tokens_per_step=96,
                          seed=seed, eod_id=eod_id)


def batch():
    # Row 0 ends its second document at its last input, so its last target starts a third one.
    w = torch.stack([torch.cat([doc(20, 8), doc(28, 9), torch.tensor([9])]), torch.cat([doc(5, 10), doc(44, 11)])])
    return w[:, :-1], w[:, 1:]


def test_masking_off_is_bit_identical_to_before():
    m = module(eod_id=None)
    x, y = batch()
    with torch.no_grad():
        logits = before_document_masking(m.model, x)
        assert torch.equal(m.model(x), logits)
        assert torch.equal(m.loss((x, y)), F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))


def test_loss_skips_the_target_after_each_eod_and_nothing_else():
    m = module(eod_id=EOD)
    x, y = batch()
    assert (x == EOD).sum() == 3  # two boundaries in row 0 (one is its last input), one in row 1
    with torch.no_grad():
        logits = m.model(x, document_ids=document_ids(x, EOD)).float()
        nats = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(y)
        kept = x != EOD
        loss = m.loss((x, y))
        assert loss.item() == pytest.approx(nats[kept].mean().item(), rel=1e-6)
        # Whatever the next document starts with, the loss is the same: it is never predicted across the boundary
        # (a loss that counted those targets would change: the unmasked mean does).
        assert (y[x == EOD] != 7).all()
        y2 = y.masked_fill(x == EOD, 7)
        assert torch.equal(m.loss((x, y2)), loss)
        assert not torch.equal(F.cross_entropy(logits.flatten(0, 1), y2.flatten()),
                               F.cross_entropy(logits.flatten(0, 1), y.flatten()))
        # The EOD as a target (where a document ends) still counts.
        assert (y[kept] == EOD).sum() == 4


def test_validation_weighs_batches_by_the_targets_it_predicts():
    m = module(eod_id=EOD).eval()
    m._token_bytes = torch.arange(CFG["vocab_size"]) % 4  # what token_bytes_table caches: bytes of each id
    x, y = batch()
    batches = [(x, y), (x[:1, 15:25], y[:1, 15:25])]  # 96 - 3 and 10 - 1 predicted targets
    with torch.no_grad():
        total, count = 0.0, 0
        for i, (bx, by) in enumerate(batches):
            m.validation_step((bx, by), i)
            logits = m.model(bx, document_ids=document_ids(bx, EOD)).float()
            nats = F.cross_entropy(logits.flatten(0, 1), by.flatten(), reduction="none").view_as(by)
            total, count = total + nats[bx != EOD].sum().item(), count + int((bx != EOD).sum())
    assert count == 93 + 9
    nats, tokens, n_bytes = m._val_totals.tolist()
    assert nats / tokens == pytest.approx(total / count, rel=1e-6)
    # Bits per byte counts the bytes of the predicted targets only: the nats of the others are not in the loss.
    kept_bytes = sum(int((by[bx != EOD] % 4).sum()) for bx, by in batches)
    assert tokens == count and n_bytes == kept_bytes
    assert kept_bytes != sum(int((by % 4).sum()) for _, by in batches)


def test_activation_checkpointing_passes_the_mask_through():
    from lit_pretrain.parallel.activation_checkpointing import apply_activation_checkpointing

    x, y = batch()
    grads = []
    for checkpointed in (False, True):
        m = module(eod_id=EOD)
        if checkpointed:
            apply_activation_checkpointing(m.model, "full")
        m.loss((x, y)).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.model.parameters()]))
    # The recomputation runs the same kernels on the same values: the gradients agree to the last bit here; 1e-6 of
    # the gradient's scale leaves room for another CPU's kernels while a block recomputed without its mask (or with
    # positions from 0..T-1) would differ by far more.
    assert (grads[0] - grads[1]).abs().max() <= 1e-6 * grads[0].abs().max()


@pytest.mark.slow
def test_train_builds_the_module_with_the_eod_id_when_document_masking_is_on(tmp_path, tiny_data_dir, monkeypatch):
    from lit_pretrain import config
    from lit_pretrain import train as train_lib
    from lit_pretrain.data.shards import load_manifest
    from tests.conftest import EXPERIMENTS, tiny_data_overrides

    built = []  # off (the default), every other training test builds it with eod_id=None
    real = train_lib.PretrainModule
    monkeypatch.setattr(train_lib, "PretrainModule", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    cfg = config.load(EXPERIMENTS / "runs" / "tiny.yaml", [
        *tiny_data_overrides(tiny_data_dir), f"run.root_dir={tmp_path}", "trainer.progress_bar=false",
        "trainer.max_steps=2", "trainer.val_every_n_steps=2", "trainer.val_windows=8", "schedule.warmup_steps=1",
        "data.document_masking=true"])
    summary = train_lib.train(cfg)
    assert summary["final_val_loss"] > 0  # trained and validated with the mask
    assert [m.eod_id for m in built] == [load_manifest(tiny_data_dir)["tokenizer"]["eod_id"]]
