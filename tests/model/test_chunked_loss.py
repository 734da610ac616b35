"""model.loss_chunk_size: the head and cross-entropy over chunks of positions give the losses and gradients of the
whole-window path (within fp32 rounding of the order of summation), and the (B, T, V) logits never exist whole, in
the forward or in the backward. In-process and tiny; the vocabulary-parallel and pipeline compositions are in
tests/parallel/test_loss_path_parallel.py."""

from dataclasses import replace

import pytest
import torch

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.model.losses import IGNORE_INDEX
from lit_pretrain.parallel.apply import one_process
from lit_pretrain.parallel.memory import SavedActivations
from lit_pretrain.planning.memory import memory_plan
from lit_pretrain.planning.plan import ParallelPlan

TINY = dict(vocab_size=64, n_layers=2, d_model=32, n_heads=4, seq_len=16)
EOD = 3


def step(cfg: GPTConfig, batch, z_loss: float, eod_id=None):
    """(task, z or None, {name: grad}) of one training step's losses through the one loss path."""
    torch.manual_seed(0)
    gpt = GPT(cfg)
    out = one_process(gpt).losses(batch, z_loss, eod_id, training=True)
    out.trained.backward()
    return out.task, out.z, {n: p.grad for n, p in gpt.named_parameters()}


def batch_of(seed=1, B=2, T=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (B, T + 1), generator=g)
    x[0, 5] = x[1, 9] = EOD  # documents end inside the window
    y = x[:, 1:].clone()
    y[1, -3:] = IGNORE_INDEX  # a padded tail
    return x[:, :-1], y


@pytest.mark.parametrize("chunk", [1, 5, 16, 40])
@pytest.mark.parametrize("variant", [dict(), dict(logit_softcap=5.0, tie_embeddings=False)])
def test_chunked_loss_and_gradients_equal_the_whole_windows(chunk, variant):
    cfg = GPTConfig(**TINY, **variant)
    batch = batch_of()
    ref_task, ref_z, ref_grads = step(cfg, batch, 1e-3, EOD)
    task, z, grads = step(replace(cfg, loss_chunk_size=chunk), batch, 1e-3, EOD)
    # The same fp32 terms summed in another order (chunk by chunk, and Σ/count instead of F.cross_entropy's
    # mean): a few ulps of a loss near log(64) ≈ 4.2, i.e. below 1e-6 relative; the gradients are sums of the
    # same per-position products in another grouping, hence the same relative bound with an absolute floor for
    # entries near zero.
    torch.testing.assert_close(task, ref_task, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z, ref_z, rtol=1e-6, atol=1e-9)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_logits_are_computed_a_chunk_at_a_time_forward_and_backward():
    cfg = GPTConfig(**TINY, loss_chunk_size=6)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    shapes = []
    gpt.lm_head.register_forward_hook(lambda _m, _a, out: shapes.append(tuple(out.shape)))
    out = one_process(gpt).losses(batch_of(), 0.0, None, training=True)
    forward = list(shapes)
    out.trained.backward()
    # 16 positions in chunks of 6: 6, 6, 4 in the forward, and each recomputed once in the backward
    assert forward == [(2, 6, 64), (2, 6, 64), (2, 4, 64)]
    assert sorted(shapes[3:]) == sorted(forward)


def test_no_predicted_target_gives_nan_as_the_whole_windows_mean():
    cfg = GPTConfig(**TINY)
    x = torch.randint(0, 64, (1, 16))
    y = torch.full((1, 16), IGNORE_INDEX)
    for c in (None, 4):
        torch.manual_seed(0)
        out = one_process(GPT(replace(cfg, loss_chunk_size=c))).losses((x, y), 1e-3, None, training=False)
        assert torch.isnan(out.task) and out.z == 0


@pytest.mark.parametrize("plan, local_tokens", [(ParallelPlan(), 2 * 6),
                                                (ParallelPlan(tensor_parallel=2, sequence_parallel=True), 2 * 12),
                                                (ParallelPlan(context_parallel=4), 2 * 4)])
def test_the_planners_logit_row_is_one_chunks(plan, local_tokens):
    """4·B·C·V/t bytes: one chunk's fp32 logits (C·t positions once sequence parallelism gathers them; at most
    this rank's T/c), against 4·B·T·V/t (Korthikanti et al. 2022 §4.3) for the whole window."""
    cfg = GPTConfig(**TINY)
    whole = memory_plan(plan, cfg, 2)
    chunked = memory_plan(plan, replace(cfg, loss_chunk_size=6), 2)
    t = plan.tensor_parallel
    assert whole["logits_bytes"] == 4.0 * 2 * 16 // plan.context_parallel * 64 / t
    assert chunked["logits_bytes"] == 4.0 * local_tokens * 64 / t
    assert whole["total_bytes"] - chunked["total_bytes"] >= 2 * (whole["logits_bytes"] - chunked["logits_bytes"])


def test_the_saved_activations_lose_the_whole_logits():
    """Measured: what the forward leaves saved for the backward shrinks by at least the planner's whole-window logit
    row (the fp32 log-softmax F.cross_entropy saves); the chunked path saves each chunk's input only."""
    cfg = GPTConfig(**TINY)
    saved = {}
    for c in (None, 4):
        torch.manual_seed(0)
        gpt = GPT(replace(cfg, loss_chunk_size=c))
        with SavedActivations(gpt) as meter:
            one_process(gpt).losses(batch_of(), 0.0, None, training=True)
        saved[c] = meter.bytes
    assert saved[None] - saved[4] >= 4 * 2 * 16 * 64
