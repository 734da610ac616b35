"""The parallel plan, pipeline stage balance and the bubble formula: pure functions, no process groups.

Each impossible layout is refused when the config loads (config.load runs planning/plan.py's build_plan), before
any process group exists, so the error comes at once instead of a rank hanging in a collective
(docs/cpu.md, pitfall 9); `show` and `train` print the same line.
"""

from pathlib import Path

import pytest

from lit_pretrain import cli, config
from lit_pretrain.errors import ConfigError
from lit_pretrain.planning.layout import balanced_stages, bubble_formula, stage_of_rank
from lit_pretrain.planning.plan import ParallelPlan, build_plan

TINY = Path(__file__).resolve().parents[2] / "experiments" / "runs" / "tiny.yaml"  # n_heads 4, d 64, 2 layers


def cfg(*overrides):
    return config.to_object(config.load(TINY, list(overrides)))


# (overrides, (replicate, shard, tensor, pipeline, zero_stage)): the presets and the compositions of the README.
@pytest.mark.parametrize("overrides, degrees", [
    ([], (1, 1, 1, 1, 0)),
    # tiny.yaml's 512 tokens a step split over 4 data-parallel ranks in micro-batches of 2, over 8 in 1s
    (["strategy=ddp", "trainer.devices=4", "trainer.micro_batch_size=2"], (4, 1, 1, 1, 0)),
    (["strategy=zero", "trainer.devices=4", "trainer.micro_batch_size=2"], (1, 4, 1, 1, 3)),
    (["strategy=zero", "strategy.zero_stage=1", "trainer.devices=2"], (1, 2, 1, 1, 1)),
    (["strategy=tensor", "trainer.devices=2"], (1, 1, 2, 1, 0)),
    (["strategy=tensor", "trainer.devices=4"], (2, 1, 2, 1, 0)),
    (["strategy=pipeline", "trainer.devices=4"], (2, 1, 1, 2, 0)),
    (["strategy=pipeline", "strategy.tensor_parallel=2", "trainer.devices=8"], (2, 1, 2, 2, 0)),
    # ZeRO composed with tensor and pipeline parallelism: the data-parallel ranks shard instead of replicating.
    (["strategy=tensor", "strategy.zero_stage=3", "trainer.devices=4"], (1, 2, 2, 1, 3)),
    (["strategy=pipeline", "strategy.zero_stage=2", "trainer.devices=4"], (1, 2, 1, 2, 2)),
    (["strategy=tensor", "strategy.zero_stage=3", "strategy.pipeline_parallel=2", "trainer.devices=8"],
     (1, 2, 2, 2, 3)),
    # HSDP: replicas of shard groups; -1 is the rest of the world.
    (["strategy=zero", "strategy.data_parallel_replicate=2", "trainer.devices=4", "trainer.micro_batch_size=2"],
     (2, 2, 1, 1, 3)),
    (["strategy=zero", "strategy.data_parallel_replicate=-1", "strategy.data_parallel_shard=2",
      "trainer.devices=8", "trainer.micro_batch_size=1"], (4, 2, 1, 1, 3)),
    (["strategy=ddp", "strategy.tensor_parallel=-1", "trainer.devices=4"], (1, 1, 4, 1, 0)),
])
def test_plans(overrides, degrees):
    plan = build_plan(cfg(*overrides))
    assert (plan.data_parallel_replicate, plan.data_parallel_shard, plan.tensor_parallel, plan.pipeline_parallel,
            plan.zero_stage) == degrees
    assert plan.world_size == cfg(*overrides).trainer.devices


def test_plan_carries_schedule_checkpointing_and_compile():
    plan = build_plan(cfg("strategy=pipeline", "trainer.devices=2", "strategy.pipeline.schedule=gpipe",
                          "strategy.pipeline.micro_batches=2", "strategy.activation_checkpointing=full"))
    assert (plan.schedule, plan.micro_batches, plan.stages_per_rank) == ("gpipe", 2, 1)
    assert plan.activation_checkpointing == "full" and not plan.compile
    # selective with model.moe under expert parallelism and tensor parallelism loads (refused before the
    # MoE policy existed: tests/parallel/test_activation_checkpointing.py, tests/parallel/test_expert_parallel.py check
    # it)
    plan = build_plan(cfg("strategy=ddp", "strategy.expert_parallel=2", "strategy.tensor_parallel=2",
                          "trainer.devices=4", "model.moe={num_experts: 4}",
                          "strategy.activation_checkpointing=selective"))
    assert (plan.activation_checkpointing, plan.expert_parallel, plan.tensor_parallel) == ("selective", 2, 2)
    assert ParallelPlan(tensor_parallel=2, pipeline_parallel=2, data_parallel_shard=2, zero_stage=3).uses_mesh
    assert not ParallelPlan(data_parallel_shard=4, zero_stage=3).uses_mesh  # plain FSDP: Lightning's strategy
    assert ParallelPlan(data_parallel_replicate=2, data_parallel_shard=2, zero_stage=3).uses_mesh  # HSDP


BAD = [
    (["strategy=tensor", "trainer.devices=3"], "trainer.devices"),  # 3 processes, t = 2
    (["strategy=pipeline", "strategy.tensor_parallel=2", "trainer.devices=6"], "trainer.devices"),  # 6 = 4k?
    (["strategy=zero", "strategy.data_parallel_replicate=2", "strategy.data_parallel_shard=2", "trainer.devices=8"],
     "product must be the world size"),
    (["strategy=zero", "strategy.data_parallel_replicate=-1", "strategy.data_parallel_shard=-1"], "at most one"),
    (["strategy=single", "trainer.devices=2"], "strategy.name=single"),
    (["strategy=tensor", "strategy.tensor_parallel=3", "trainer.devices=3"], "model.n_heads"),  # 4 heads over 3
    (["strategy=tensor", "model.n_heads=8", "model.d_ff=100", "strategy.tensor_parallel=8", "trainer.devices=8"],
     "model.d_ff"),
    (["strategy=pipeline", "strategy.pipeline_parallel=4", "trainer.devices=4"], "model.n_layers"),  # 2 blocks
    (["strategy=pipeline", "strategy.pipeline.schedule=interleaved_1f1b", "trainer.devices=2"], "stages_per_rank"),
    (["strategy=pipeline", "strategy.pipeline.stages_per_rank=2", "trainer.devices=2"], "stages_per_rank"),
    (["strategy=pipeline", "strategy.pipeline.micro_batches=3", "trainer.devices=2"], "trainer.micro_batch_size"),
    (["strategy=pipeline", "strategy.pipeline.micro_batches=1", "trainer.devices=2"],
     "strategy.pipeline.micro_batches"),  # 1F1B refuses m < p
    (["strategy=ddp", "strategy.sequence_parallel=true", "trainer.devices=2"], "strategy.sequence_parallel"),
    (["strategy=tensor", "strategy.sequence_parallel=true", "model.seq_len=63", "trainer.devices=2"],
     "model.seq_len"),
    (["strategy=tensor", "strategy.zero_stage=1", "trainer.devices=4"], "strategy.zero_stage=1"),
    (["strategy=zero", "strategy.zero_stage=1", "strategy.data_parallel_replicate=2", "trainer.devices=4"],
     "strategy.zero_stage=1"),
    (["strategy=ddp", "strategy.data_parallel_shard=2", "trainer.devices=2"], "strategy.zero_stage"),
    (["strategy=zero", "trainer.precision=16-mixed", "trainer.devices=2"], "trainer.precision"),
    (["strategy=tensor", "trainer.compile=true", "trainer.devices=2"], "trainer.compile"),
    (["strategy=pipeline", "data.document_masking=true", "trainer.devices=2"], "data.document_masking"),
    # context parallelism: 2c chunks of the window (x t under sequence parallelism), what is not built
    (["strategy=ddp", "strategy.context_parallel=2", "model.seq_len=66", "trainer.devices=2"],
     "model.seq_len=66 is not divisible by 2 x strategy.context_parallel=2"),
    (["strategy=tensor", "strategy.sequence_parallel=true", "strategy.context_parallel=2", "model.seq_len=68",
      "trainer.devices=4"], "model.seq_len=68 is not divisible by 2 x strategy.context_parallel=2 x"),
    # ZeRO-1 x CP is built; with tensor parallelism as well it is refused as without CP (whole tensors)
    (["strategy=tensor", "strategy.zero_stage=1", "strategy.context_parallel=2", "trainer.devices=4"],
     "strategy.zero_stage=1 is PyTorch's ZeroRedundancyOptimizer"),
    (["strategy=ddp", "strategy.context_parallel=2", "trainer.compile=true", "trainer.devices=2"],
     "trainer.compile"),
    # expert groups are made of data-parallel x context-parallel ranks (here 1 x 2)
    (["strategy=ddp", "strategy.context_parallel=2", "strategy.expert_parallel=4", "model=olmoe_1b_7b",
      "trainer.devices=2"], "strategy.expert_parallel=4 does not divide the 2 data-parallel ranks"),
    # a capacity would drop tokens by each rank's part of the window
    (["strategy=ddp", "strategy.context_parallel=2", "model=olmoe_1b_7b", "model.moe.capacity_factor=1.25",
      "model.seq_len=64", "trainer.devices=2"], "model.moe.capacity_factor=1.25 with strategy.context_parallel=2"),
    # the embedding and head split their rows over t = 2 (parallel/vocab.py): one line naming both keys and the fix
    (["strategy=tensor", "model.vocab_size=513", "trainer.devices=2"],
     "model.vocab_size=513 is not divisible by strategy.tensor_parallel=2"),
    # context parallelism with what has no parity test under it yet: selective checkpointing, FSDP2's policy, fp8
    (["strategy=ddp", "strategy.context_parallel=2", "strategy.activation_checkpointing=selective",
      "trainer.devices=2"],
     "strategy.activation_checkpointing=selective with strategy.context_parallel=2"),
    (["strategy=zero", "strategy.context_parallel=2", "trainer.precision=bf16-mixed",
      "strategy.mixed_precision_policy=true", "trainer.devices=2"],
     "strategy.mixed_precision_policy=true with strategy.context_parallel=2"),
    (["strategy=zero", "strategy.context_parallel=2", "trainer.precision=bf16-mixed", "trainer.float8={}",
      "trainer.devices=2"], "trainer.float8 with strategy.context_parallel=2"),
    # ZeRO-1 x CP with replicas, pipeline or expert parallelism: refused, as without CP
    (["strategy=zero", "strategy.zero_stage=1", "strategy.context_parallel=2", "strategy.data_parallel_replicate=2",
      "trainer.devices=4"], "strategy.zero_stage=1 is PyTorch's ZeroRedundancyOptimizer"),
    (["strategy=zero", "strategy.zero_stage=1", "strategy.context_parallel=2", "strategy.pipeline_parallel=2",
      "trainer.devices=4"], "strategy.zero_stage=1 is PyTorch's ZeroRedundancyOptimizer"),
    (["strategy=zero", "strategy.zero_stage=1", "strategy.context_parallel=2", "strategy.expert_parallel=2",
      "model=olmoe_1b_7b", "model.seq_len=64", "trainer.devices=2"],
     r"strategy.zero_stage=1 \(ZeroRedundancyOptimizer\) partitions whole tensors"),
]


@pytest.mark.parametrize("overrides, key", BAD)
def test_impossible_layouts_are_refused_when_the_config_loads(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config.load(TINY, overrides)


@pytest.mark.parametrize("overrides, key", [BAD[0], BAD[5], BAD[12], BAD[14]])
def test_show_and_train_refuse_with_the_same_line(overrides, key, capsys):
    lines = []
    for command in ("show", "train"):
        assert cli.main([command, str(TINY), *overrides]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and key in err[0], err
        lines.append(err[0].split(": error: ", 1)[1])
    assert lines[0] == lines[1]


def test_tokens_per_step_count_data_parallel_ranks():
    from lit_pretrain.planning.batch import global_batch

    def accumulation(c):
        b = global_batch(c.trainer, c.model.seq_len, build_plan(c))
        return b.accumulation, b.tokens_per_step

    # Data-parallel ranks, not processes: 4 processes as DP2 x TP2 give 2 replicas of 4 x 64 tokens, and ZeRO-3 x
    # TP2 gives 2 shards of the same batch size.
    assert accumulation(cfg("strategy=tensor", "trainer.devices=4", "trainer.tokens_per_step=2048")) == (4, 2048)
    assert accumulation(cfg("strategy=tensor", "strategy.zero_stage=3", "trainer.devices=4",
                            "trainer.tokens_per_step=2048")) == (4, 2048)


def test_context_parallel_ranks_share_their_replica_batch_and_multiply_the_world():
    """strategy.context_parallel is a degree of the world, not of the data: the ranks of a context-parallel group
    read one micro-batch, so the accumulation is that of the data-parallel ranks alone."""
    from lit_pretrain.planning.batch import global_batch

    for overrides, degrees, accumulation in [
        # 4 processes as 2 replicas x CP 2: 512 tokens = 4 x 64 x 2 replicas, accumulation 1
        (["strategy=ddp", "strategy.context_parallel=2", "trainer.devices=4"], (2, 1, 2, 0), 1),
        # 2 processes as CP 2 alone: one data-parallel rank, so 512 tokens take 2 micro-batches of 4 x 64
        (["strategy=ddp", "strategy.context_parallel=2", "trainer.devices=2"], (1, 1, 2, 0), 2),
        # ZeRO-3 shards over data_parallel_shard x context_parallel; the data is split over the 2 shards only
        (["strategy=zero", "strategy.context_parallel=2", "trainer.devices=4"], (1, 2, 2, 3), 1),
        # ZeRO-1 likewise: ZeroRedundancyOptimizer over the 4 shard x context ranks, the data over the 2 shards
        (["strategy=zero", "strategy.zero_stage=1", "strategy.context_parallel=2", "trainer.devices=4"],
         (1, 2, 2, 1), 1),
    ]:
        c = cfg(*overrides)
        plan = build_plan(c)
        assert (plan.data_parallel_replicate, plan.data_parallel_shard, plan.context_parallel,
                plan.zero_stage) == degrees, overrides
        assert plan.world_size == c.trainer.devices and plan.uses_mesh
        assert global_batch(c.trainer, c.model.seq_len, plan).accumulation == accumulation, overrides
        assert f"context_parallel={degrees[2]}" in plan.describe()
    # model.moe under CP 2, and CP 2 x EP 2 on 2 processes (the experts split over the context-parallel pair, which
    # route different tokens): both load (tests/parallel/test_moe_mesh.py checks them against one process)
    for extra in ([], ["strategy.expert_parallel=2"]):
        plan = build_plan(cfg("strategy=ddp", "strategy.context_parallel=2", "model=olmoe_1b_7b", "model.seq_len=64",
                              "trainer.devices=2", *extra))
        assert plan.context_parallel == 2 and plan.expert_parallel == (2 if extra else 1)


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


def test_a_tokenizer_size_tensor_parallelism_does_not_divide_is_refused_before_any_rank_starts(tmp_path, capsys):
    # model.vocab_size=null: at the config load V is data.vocab_size (the tokenizer's target); train checks again
    # with the prepared tokenizer's own size, here a given tokenizer of 301 tokens while data.vocab_size is 512.
    from lit_pretrain.data.tokenizer import save_tokenizer, train_tokenizer

    at_load = ["model.vocab_size=null", "data.vocab_size=301", "strategy=tensor", "trainer.devices=2"]
    with pytest.raises(ConfigError, match=r"model\.vocab_size=null takes data\.vocab_size=301 \(the tokenizer's "
                                          r"target size\), which is not divisible by strategy\.tensor_parallel=2"):
        config.load(TINY, at_load)
    words = [f"w{i} x{i % 7} y{i % 11}" for i in range(400)]
    tokenizer = train_tokenizer(words, vocab_size=301)
    assert tokenizer.get_vocab_size() == 301
    save_tokenizer(tokenizer, tmp_path / "odd.json")
    prepared, runs = tmp_path / "odd-vocab", tmp_path / "runs"
    args = ["train", str(TINY), f"data.prepared_dir={prepared}", "data.max_documents=60", "model.vocab_size=null",
            f"data.tokenizer_path={tmp_path / 'odd.json'}", "strategy=tensor", "trainer.devices=2",
            f"run.root_dir={runs}"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert ("model.vocab_size=null takes the tokenizer's 301 tokens, which is not divisible by "
            "strategy.tensor_parallel=2" in err[0]) and "such as 302" in err[0], err[0]
    # Refused after prepare (the size comes from there) and before any checkpoint.
    assert (prepared / "manifest.json").is_file() and not any(runs.glob("*/checkpoints/*"))
