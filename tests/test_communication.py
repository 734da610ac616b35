"""The communication formulas (scaling/communication.py; derivations in its docstring): pure, no process group.

Two tables: a shape small enough to count by hand (FSDP2's dim-0 padding visible), and the bytes the bench's
counting wrapper measured on a 2-layer model (bench/parallel/compositions.py; torch 2.13, gloo, 4 processes, d 64,
f 192, V 8192, T 32, global batch 8, so 4 sequences per data-parallel rank).
"""

import pytest

from lit_pretrain.scaling import communication as cm


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
