"""Layout checks, pipeline stage balance and the bubble formula: pure functions, no process groups.

Each impossible layout is refused by `check_layout`, which train.py runs before any process group exists, so the
error comes at once instead of a rank hanging in a collective (shared/CPU-DISTRIBUTED.md, pitfall 9).
"""

from pathlib import Path

import pytest

from lit_pretrain import config
from lit_pretrain.errors import ConfigError
from lit_pretrain.parallel.layout import Layout, balanced_stages, bubble_formula, check_layout, stage_of_rank

TINY = Path(__file__).resolve().parents[1] / "experiments" / "runs" / "tiny.yaml"  # n_heads 4, d 64, 2 layers


def cfg(*overrides):
    return config.to_object(config.load(TINY, list(overrides)))


@pytest.mark.parametrize("overrides, world, layout", [
    ([], 1, Layout(1, 1, 1)),
    (["strategy=ddp"], 4, Layout(4, 1, 1)),
    (["strategy=tensor"], 2, Layout(1, 2, 1)),
    (["strategy=tensor"], 4, Layout(2, 2, 1)),
    (["strategy=pipeline"], 4, Layout(2, 1, 2)),
    (["strategy=pipeline", "strategy.tensor_parallel=2"], 4, Layout(1, 2, 2)),
    (["strategy=pipeline", "strategy.tensor_parallel=2"], 8, Layout(2, 2, 2)),
])
def test_layouts(overrides, world, layout):
    assert check_layout(cfg(*overrides), world) == layout


@pytest.mark.parametrize("overrides, world, key", [
    (["strategy=tensor"], 3, "trainer.devices"),  # 3 processes, t·p = 2
    (["strategy=pipeline", "strategy.tensor_parallel=2"], 6, "trainer.devices"),  # 6 is not a multiple of 4
    (["strategy=tensor", "strategy.tensor_parallel=3"], 3, "model.n_heads"),  # 4 heads over 3 ranks
    (["strategy=tensor", "model.n_heads=8", "model.d_ff=100", "strategy.tensor_parallel=8"], 8, "model.d_ff"),
    (["strategy=pipeline", "strategy.pipeline_parallel=4"], 4, "model.n_layers"),  # 2 blocks, 4 stages
    (["strategy=pipeline", "strategy.pipeline.schedule=interleaved_1f1b"], 2, "stages_per_rank"),
    (["strategy=pipeline", "strategy.pipeline.stages_per_rank=2"], 2, "stages_per_rank"),
    (["strategy=pipeline", "strategy.pipeline.micro_batches=3"], 2, "trainer.micro_batch_size"),  # 8 / 3
    (["strategy=pipeline", "strategy.pipeline.micro_batches=1"], 2, "strategy.pipeline.micro_batches"),  # 1F1B: m < p
    (["strategy=ddp", "strategy.tensor_parallel=2"], 2, "strategy.name"),  # sizes set for a strategy without them
])
def test_impossible_layouts_name_their_key(overrides, world, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_layout(cfg(*overrides), world)


def test_train_refuses_a_layout_before_starting_processes():
    from lit_pretrain.train import accumulation

    with pytest.raises(ConfigError, match="model.n_heads"):
        accumulation(cfg("strategy=tensor", "strategy.tensor_parallel=3", "trainer.devices=3"))
    # Tokens per step count data-parallel replicas: 4 processes as DP2 × TP2 give 2 replicas of 8 × 64 tokens.
    assert accumulation(cfg("strategy=tensor", "trainer.devices=4", "trainer.tokens_per_step=2048")) == (2, 2048)


# Minimax contiguous partitions, checked by hand: the largest stage (with first/last extras) is as small as any
# contiguous cut allows, and ties give the earlier stages more blocks.
@pytest.mark.parametrize("sizes, n, first, last, expected", [
    ([1, 1, 1, 1], 2, 0, 0, [(0, 2), (2, 4)]),
    ([1, 1, 1, 1], 4, 0, 0, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    ([5, 1, 1, 1, 1, 1], 2, 0, 0, [(0, 1), (1, 6)]),  # max 5: nothing better than the big block alone
    ([1, 1, 1, 1], 2, 2, 0, [(0, 1), (1, 4)]),  # embedding of 2 on the first stage: 3 vs 3
    ([1, 1, 1, 1, 1, 1], 2, 0, 3, [(0, 5), (5, 6)]),  # head of 3 on the last: 5 vs 4 (4 vs 5 ties: earlier wins)
    ([1, 1, 1, 1, 1, 1], 2, 0, 4, [(0, 5), (5, 6)]),  # 5 vs 5
    ([3, 3, 3], 3, 1, 1, [(0, 1), (1, 2), (2, 3)]),
    ([2, 2, 2, 2], 1, 5, 5, [(0, 4)]),
])
def test_balanced_stages(sizes, n, first, last, expected):
    assert balanced_stages(sizes, n, first, last) == expected


def test_balanced_stages_is_the_minimax_over_all_cuts():
    """Brute force over every cut of 7 blocks into 3 stages: the same largest stage."""
    from itertools import combinations

    sizes, first, last = [4, 1, 3, 2, 5, 1, 2], 3, 4
    extra = lambda k: (first if k == 0 else 0) + (last if k == 2 else 0)  # noqa: E731
    best = min(max(sum(sizes[a:b]) + extra(k) for k, (a, b) in enumerate(zip((0, i, j), (i, j, 7))))
               for i, j in combinations(range(1, 7), 2))
    got = balanced_stages(sizes, 3, first, last)
    assert max(sum(sizes[a:b]) + extra(k) for k, (a, b) in enumerate(got)) == best
    assert got[0][0] == 0 and got[-1][1] == 7 and all(a < b for a, b in got)


def test_balanced_stages_refuses_more_stages_than_blocks():
    with pytest.raises(ValueError):
        balanced_stages([1, 1], 3)


@pytest.mark.parametrize("p, m, v, expected", [
    # Narayanan et al. 2021 §2.2: (p-1)/(m+p-1) of a step idle; interleaving v stages per rank: (p-1)/(v·m+p-1).
    (1, 4, 1, 0.0), (2, 1, 1, 1 / 2), (2, 2, 1, 1 / 3), (2, 4, 1, 1 / 5), (2, 8, 1, 1 / 9), (4, 4, 1, 3 / 7),
    (4, 8, 2, 3 / 19),
])
def test_bubble_formula(p, m, v, expected):
    assert bubble_formula(p, m, v) == pytest.approx(expected)


def test_stages_of_rank_interleave():
    assert stage_of_rank(0, 2, 2) == [0, 2] and stage_of_rank(1, 2, 2) == [1, 3] and stage_of_rank(1, 4, 1) == [1]
