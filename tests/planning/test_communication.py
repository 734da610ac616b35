"""The communication formulas (planning/communication.py; derivations in its docstring): pure, no process group.

Two tables: a shape small enough to count by hand (FSDP2's dim-0 padding visible), and the bytes the bench's
counting wrapper measured on a 2-layer model (bench/parallel/compositions.py; torch 2.13, gloo, 4 processes, d 64,
f 192, V 8192, T 32, global batch 8, so 4 sequences per data-parallel rank).
"""

import pytest

from lit_pretrain.planning import communication as cm


def test_padding_by_hand():
    # L 1, d 4, f 6, V 10 over w 4: wq..wo (4, 4) = 16 each; w_gate, w_up (6, 4) pad to (8, 4) = 32 each;
    # w_down (4, 6) = 24; two norms (4,) = 8: block 160 (144 unpadded). Root: (10, 4) pads to (12, 4) = 48, norm 4.
    blocks, root = cm.groups(1, 4, 6, 10)
    assert cm.padded(blocks[0], 4) == 160
    assert cm.padded(root, 4) == 52
    assert cm.local_params(1, 4, 6, 10) == 144 + 44


@pytest.mark.parametrize("parts, expected", [
    # ZeRO-3: every group gathered twice (forward, backward), its gradient reduce-scattered once: 4 bytes x 212.
    (lambda: cm.zero(1, 4, 6, 10, w=4), {"all_gather": 1696, "reduce_scatter": 848, "all_reduce": 0}),
    # ZeRO-2 gathers once; HSDP adds an all-reduce of each reduce-scattered shard (212 / 4 elements).
    (lambda: cm.zero(1, 4, 6, 10, w=4, stage=2, replicas=2),
     {"all_gather": 848, "reduce_scatter": 848, "all_reduce": 212}),
    # TP 2 slices: column dims 0, row dim 1 (wq (2, 4), w_gate (3, 4), w_down (4, 3)), the embedding's vocabulary
    # rows (5, 4), padded to (6, 4) = 24, + norm 4 = 28; then FSDP pads per slice.
    (lambda: cm.zero(1, 4, 6, 10, w=2, t=2), {"all_gather": 8 * (4 * 8 + 2 * 16 + 12 + 8 + 28),
                                             "reduce_scatter": 4 * (4 * 8 + 2 * 16 + 12 + 8 + 28), "all_reduce": 0}),
    # TP: (2 forward + 5 backward) all-reduces of B T d per block, + the vocabulary-parallel embedding's and head's
    # (B T d each), + the cross-entropy's 3 B T: B 2, T 3, d 4, L 2.
    (lambda: cm.tensor_parallel(2, 4, 2, 3), {"all_gather": 0, "reduce_scatter": 0,
                                              "all_reduce": 4 * 24 * (2 * 7 + 2) + 4 * 3 * 6}),
    # TP + SP: 4L + 2 all-gathers and 4L + 2 reduce-scatters of B T d; the 2L + 1 norms' d-element gradients and
    # the cross-entropy's 3 B T all-reduced.
    (lambda: cm.sequence_parallel(2, 4, 2, 3), {"all_gather": 4 * 24 * 10, "reduce_scatter": 4 * 24 * 10,
                                                "all_reduce": 4 * (4 * 5 + 3 * 6)}),
])
def test_formulas_by_hand(parts, expected):
    assert parts() == expected


L, D, F, V, T, B = 2, 64, 192, 8192, 32, 4


@pytest.mark.parametrize("formula, measured", [
    (lambda: cm.total(cm.zero(L, D, F, V, w=4), cm.grad_norm(1)),
     {"all_gather": 5_048_832, "reduce_scatter": 2_524_416, "all_reduce": 4}),
    # Measured again with the vocabulary-parallel embedding, head and cross-entropy (parallel/vocab.py).
    (lambda: cm.total(cm.tensor_parallel(L, D, B, T), cm.replicas_all_reduce(L, D, F, V, t=2),
                      cm.grad_norm(0, 1)),
     {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 1_788_680}),
    (lambda: cm.total(cm.zero(L, D, F, V, w=2, t=2), cm.tensor_parallel(L, D, B, T), cm.grad_norm(1, 1)),
     {"all_gather": 2_525_696, "reduce_scatter": 1_262_848, "all_reduce": 525_836}),
    (lambda: cm.total(cm.sequence_parallel(L, D, B, T), cm.replicas_all_reduce(L, D, F, V, t=2),
                      cm.grad_norm(0, 1)),
     {"all_gather": 327_680, "reduce_scatter": 327_680, "all_reduce": 1_265_672}),
])
def test_formulas_match_the_measured_bytes(formula, measured):
    assert formula() == measured


def test_context_parallel_bytes_by_hand():
    """Llama 3's all-gather (parallel/context.py): per block the window's stacked K and V gathered and
    their gradient scattered, 2 x B x T x g·Q fp32 elements each; the loss's (sum, count) pair per micro-batch.
    L 4, B 1, T 4096, 4 heads of 64: 4 x 2 x 4096 x 256 x 4 = 33,554,432 bytes (`make bench` measured exactly
    this for CP 2 on the default model)."""
    assert cm.context_parallel(4, 1, 4096, 256) == {"all_gather": 33_554_432, "reduce_scatter": 33_554_432,
                                                    "all_reduce": 8}
    # grouped-query attention gathers only the key/value heads; two micro-batches, with z-loss: 3 scalars each
    assert cm.context_parallel(2, 2, 16, 8, micro_batches=2, z_loss=True) == {
        "all_gather": 4 * 2 * 2 * 16 * 8 * 2 * 2, "reduce_scatter": 4 * 2 * 2 * 16 * 8 * 2 * 2, "all_reduce": 24}


def test_context_parallel_chunks_balance_the_causal_work():
    """Chunks r and 2c-1-r of 2c (Llama 3 §3.3.2): every position once over the group, and each rank's queries see
    the same number of causal keys."""
    from lit_pretrain.parallel.context import chunk_positions, gathered_order

    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert chunk_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert sorted(gathered_order(16, 4).tolist()) == list(range(16))
    work = {int((chunk_positions(64, 4, r) + 1).sum()) for r in range(4)}  # keys each rank's queries attend to
    assert len(work) == 1
    with pytest.raises(ValueError, match="divisible by 8"):
        chunk_positions(12, 4, 0)


def test_fsdp_step_table():
    """fsdp_step by hand: a block of one (3, 2) weight and a root of one (5, 2), 2 shards (dim 0 padded to 4 and 6:
    20 elements), ZeRO-3, 2 micro-batches, 2 replicas, bf16 gathers and fp32 reduce-scatters, one norm value.
    Per micro-batch and group: 2 all-gathers, 1 reduce-scatter, 1 replica all-reduce of the w-th part."""
    out = cm.fsdp_step({"blocks.0.w": (3, 2), "emb": (5, 2)}, w=2, stage=3, micro_batches=2, replicas=2,
                       gather_e=2, reduce_e=4, norm_values=1)
    assert out == {"all_gather": (2 * 2 * 2, 2 * 2 * 2 * 20), "reduce_scatter": (2 * 2, 2 * 4 * 20),
                   "all_reduce": (1 + 2 * 2, 4 + 2 * 4 * 20 // 2)}
    assert cm.fsdp_step({"blocks.0.w": (3, 2), "emb": (5, 2)}, w=2, stage=2)["all_gather"] == (2, 4 * 20)


@pytest.mark.parametrize("stages, n_stages, calls", [
    ([0], 2, 8),  # 1F1B's first of 2 stages: m x accumulation forward sends, as many gradient receives
    ([1], 2, 8),  # the last: the gradients sent back
    ([1], 4, 16),  # a middle stage both ways
    ([0, 2], 4, 24),  # interleaved (v = 2): stage 0 forward, stage 2 both ways
])
def test_pipeline_p2p_table(stages, n_stages, calls):
    """pipeline_p2p by hand: m = 4 pipeline micro-batches, accumulation 2, a 100-byte stream."""
    assert cm.pipeline_p2p(stages, n_stages, 4, 2, 100) == {"send": (calls, 100 * calls), "recv": (calls, 100 * calls)}


def test_expert_all_to_all_table():
    """expert_all_to_all by hand: 2 MoE layers, 3 micro-batches of 10 tokens, top-2 of 4 experts, d 8, fp32: per
    layer and micro-batch the counts (4 x 8 bytes) and four moves of 20 rows of 8 fp32."""
    assert cm.expert_all_to_all(2, 10, 2, 8, 4, micro_batches=3) == (5 * 2 * 3, (32 + 4 * 20 * 8 * 4) * 2 * 3)
