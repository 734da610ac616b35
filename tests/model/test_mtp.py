"""model.mtp_depth (DeepSeek-V3 §2.2): the depths' tokens and targets as a table, the loss against a hand-written
reference of eq. 21-25, the next-token loss and the generated logits untouched by the modules, and the architecture
table (parameters, FLOPs) counting them. In-process and tiny; the tensor- and context-parallel compositions are in
tests/parallel/test_loss_path_parallel.py."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lit_pretrain.model import shapes
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT, document_ids
from lit_pretrain.model.losses import IGNORE_INDEX as X
from lit_pretrain.model.mtp import mtp_tokens
from lit_pretrain.parallel.apply import one_process

TINY = dict(vocab_size=64, n_layers=2, d_model=32, n_heads=4, seq_len=16)
EOD = 3


def test_depth_tokens_and_targets_stop_at_the_window_and_at_a_document_end():
    # window x = 10 11 EOD 12 13 14 with next token 15: y = 11 EOD 12 13 14 15
    x = torch.tensor([[10, 11, EOD, 12, 13, 14]])
    y = torch.tensor([[11, EOD, 12, 13, 14, 15]])
    inputs, targets = mtp_tokens(x, y, 1)
    assert inputs.tolist() == [[11, EOD, 12, 13, 14, 15]]  # x_{t+1}
    assert targets.tolist() == [[EOD, 12, 13, 14, 15, X]]  # x_{t+2}
    inputs, targets = mtp_tokens(x, y, 2, eod_id=EOD)
    assert inputs.tolist() == [[EOD, 12, 13, 14, 15, 0]]  # x_{t+2}; none past the window
    # t=0 predicts x_3 = 12 across the EOD at 2; t=1 predicts x_3 too late (EOD at 2 ends its document)
    assert targets.tolist() == [[X, X, X, 15, X, X]]  # t=2 is the EOD itself: x_4 = 13 is the next document's
    _, targets = mtp_tokens(x, y, 1, eod_id=EOD)
    assert targets.tolist() == [[EOD, X, X, 14, 15, X]]  # the EOD is predicted inside its document; then the next
    padded = torch.tensor([[11, EOD, 12, X, X, X]])  # a validation window's padding: never an input id
    inputs, targets = mtp_tokens(x, padded, 1)
    assert inputs.tolist() == [[11, EOD, 12, 0, 0, 0]] and targets.tolist() == [[EOD, 12, X, X, X, X]]


def reference_mtp(gpt, x, y, eod_id=None):
    """(next-token loss, [CE_k]) written out from DeepSeek-V3 eq. 21-24 on the truncated sequences 1..T-k, with
    the model's own modules, without the padding the loss path uses."""
    T = x.shape[1]
    docs = None if eod_id is None else document_ids(x, eod_id)
    h = gpt(x, document_ids=docs, output=lambda model, hidden, rope: (hidden, rope))
    hidden, (cos, sin, mask) = h
    from lit_pretrain.model.losses import loss_targets

    main_y = y if eod_id is None else loss_targets(x, y, eod_id)
    main = F.cross_entropy(gpt.head(hidden).flatten(0, 1), main_y.flatten(), ignore_index=X)
    ce = []
    for k in range(1, gpt.cfg.mtp_depth + 1):
        n = T - k  # eq. 22: positions 1..T-k
        emb = gpt.tok_embeddings(y[:, k - 1:k - 1 + n])  # Emb(t_{i+k})
        m = gpt.mtp[k - 1]
        x_k = m.proj(torch.cat([m.hnorm(hidden[:, :n]), m.enorm(emb)], dim=-1))  # eq. 21
        sub_mask = None if mask is None else mask[..., :n, :n]
        cs, sn = (cos[:n], sin[:n]) if cos.dim() == 2 else (cos[:, :n], sin[:, :n])
        hidden = m.block(x_k, cs, sn, sub_mask)  # eq. 22
        logits = gpt.mtp_head(k - 1)(hidden)  # eq. 23
        target = y[:, k:k + n]
        if eod_id is not None:
            target = mtp_tokens(x, y, k, eod_id)[1][:, :n]
        ce.append(F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=X))  # eq. 24
    return main, ce


def batch_of(seed=1, B=2, T=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(4, 64, (B, T + 1), generator=g)
    x[0, 5] = x[1, 9] = EOD
    return x[:, :-1], x[:, 1:].clone()


# the last case: a sliding window on the last block, whose kind (and window) the MTP blocks take
@pytest.mark.parametrize("depth, eod_id, chunk, window", [(1, None, None, None), (2, EOD, None, None),
                                                          (2, EOD, 5, None), (1, EOD, None, 4)])
def test_the_loss_is_deepseek_v3s_eq_25_and_train_loss_stays_the_next_token_loss(depth, eod_id, chunk, window):
    cfg = GPTConfig(**TINY, mtp_depth=depth, mtp_loss_weight=0.3, loss_chunk_size=chunk, sliding_window=window,
                    layer_types=None if window is None else ["full", "sliding"])
    torch.manual_seed(0)
    gpt = GPT(cfg)
    batch = batch_of()
    out = one_process(gpt).losses(batch, 0.0, eod_id, training=True)
    main, ce = reference_mtp(gpt, *batch, eod_id)
    # The same fp32 operations except the padding past T-k (causal: it never reaches the scored positions) and,
    # chunked, the order of summation: a few ulps of losses near log(64) ≈ 4.2.
    torch.testing.assert_close(out.task, main, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.mtp, torch.stack(ce).mean(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.trained, main + 0.3 / depth * sum(ce), rtol=1e-6, atol=1e-6)
    # validation and train/loss: the next-token loss alone, bit for bit that of the model without the modules
    torch.manual_seed(0)
    plain = GPT(replace(cfg, mtp_depth=0))
    plain.load_state_dict({k: v for k, v in gpt.state_dict().items() if not k.startswith("mtp.")})
    alone = one_process(plain).losses(batch, 0.0, eod_id, training=True)
    assert torch.equal(alone.task, out.task) and alone.mtp is None
    assert one_process(gpt).losses(batch, 0.0, eod_id, training=False).mtp is None


def test_the_modules_get_gradients_and_generation_ignores_them():
    cfg = GPTConfig(**TINY, mtp_depth=1)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    one_process(gpt).losses(batch_of(), 0.0, None, training=True).trained.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in gpt.named_parameters() if "mtp." in n)
    plain = GPT(replace(cfg, mtp_depth=0))
    plain.load_state_dict({k: v for k, v in gpt.state_dict().items() if not k.startswith("mtp.")})
    x = batch_of()[0]
    with torch.no_grad():
        assert torch.equal(gpt(x), plain(x))  # the logits (and so HF export's and generate's) are the main head's
        cache = gpt.new_cache(2)
        torch.testing.assert_close(gpt.forward_cached(x, cache), plain(x)[:, -1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_the_architecture_table_counts_the_modules(depth):
    cfg = GPTConfig(**TINY, mtp_depth=depth, tie_embeddings=False)
    with torch.device("meta"):
        gpt = GPT(cfg)
    assert shapes.param_shapes(cfg) == {n: tuple(p.shape) for n, p in gpt.named_parameters()}
    d, V, L, T, f = 32, 64, 2, 16, cfg.hidden_dim
    block = 4 * d * d + 3 * d * f + 2 * d
    assert shapes.non_embedding_params(cfg) == L * block + d + depth * (block + 2 * d * d + 3 * d)
    # PaLM appendix B with each depth's block one more layer and the shared head's matmul once more per depth
    n = shapes.non_embedding_params(cfg) + (1 + depth) * V * d
    assert shapes.flops_per_token(cfg) == gpt.flops_per_token() == 6 * n + 12 * (L + depth) * 4 * 8 * T


def test_the_modules_attention_is_counted_with_the_last_blocks_window():
    # layers full, sliding (W 4), and the MTP block the last one's kind: PaLM's T·T pairs for the full layer, the
    # window's W(W+1)/2 + (T-W)·W = 10 + 48 = 58 for each sliding one (docs/model.md, "Sliding-window attention")
    cfg = GPTConfig(**TINY, mtp_depth=1, sliding_window=4, layer_types=["full", "sliding"], tie_embeddings=False)
    n = shapes.non_embedding_params(cfg) + 2 * 64 * 32
    assert shapes.flops_per_token(cfg) == GPT(cfg).flops_per_token() == 6 * n + 12 * 4 * 8 * (256 + 58 + 58) // 16


def test_the_memory_planner_adds_a_block_and_a_logit_row_per_depth():
    from lit_pretrain.planning.memory import memory_plan
    from lit_pretrain.planning.plan import ParallelPlan

    cfg = GPTConfig(**TINY)
    base, two = (memory_plan(ParallelPlan(), replace(cfg, mtp_depth=d), 2) for d in (0, 2))
    assert two["activation_bytes"] - base["activation_bytes"] == \
        2 * (base["activation_bytes_per_layer"] + base["logits_bytes"])
    assert two["params"] - base["params"] == 2 * (shapes.block_params(cfg) + 2 * 32 * 32 + 3 * 32)


@pytest.mark.parametrize("overrides, key", [  # trainer.compile's needs a compiler: refused the same way
    (["strategy.name=ddp", "strategy.tensor_parallel=2", "strategy.sequence_parallel=true", "trainer.devices=2"],
     "strategy.sequence_parallel=true"),
])
def test_a_layout_without_the_modules_is_refused_when_the_config_loads(overrides, key):
    from lit_pretrain import config
    from lit_pretrain.errors import ConfigError
    from tests.conftest import EXPERIMENTS

    with pytest.raises(ConfigError, match=rf"^model\.mtp_depth=1 with {key}: .* or model\.mtp_depth=0$"):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", ["model.mtp_depth=1", *overrides], check_inputs=False)
