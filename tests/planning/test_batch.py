"""The global batch (planning/batch.py): tokens per optimizer step fixed by the config, only the accumulation
changes with the layout; a layout that cannot split it is refused when the config loads, naming what works; `train`
prints the plan it applied in one line. The slow test trains six layouts of one MoE config and compares their
tokens per step, `train/tokens_seen` and sizes."""

import json
from pathlib import Path

import pytest

from lit_pretrain import cli, config
from lit_pretrain.callbacks.memory_log import layout_record
from lit_pretrain.errors import ConfigError
from lit_pretrain.planning.batch import GlobalBatch, global_batch, plan_line
from lit_pretrain.planning.plan import ParallelPlan, build_plan
from lit_pretrain.runs.folder import read_metrics, series
from tests.conftest import run_module, train_args
from tests.helpers.global_sizes import assert_global_sizes

TINY = Path(__file__).resolve().parents[2] / "experiments" / "runs" / "tiny.yaml"  # 512 tokens: micro 4 x 64 x 2


def batch(*overrides):
    c = config.to_object(config.load(TINY, list(overrides)))
    b = global_batch(c.trainer, c.model.seq_len, build_plan(c))
    return b.micro_batch_size, b.data_parallel, b.accumulation, b.tokens_per_step


@pytest.mark.parametrize("overrides, expected", [
    ([], (4, 1, 2, 512)),
    (["strategy=ddp", "trainer.devices=2"], (4, 2, 1, 512)),
    (["strategy=fsdp", "trainer.devices=2"], (4, 2, 1, 512)),
    (["strategy=zero", "strategy.zero_stage=1", "trainer.devices=2"], (4, 2, 1, 512)),
    # tensor- and pipeline-parallel ranks share their replica's batch
    (["strategy=tensor", "trainer.devices=2"], (4, 1, 2, 512)),
    (["strategy=pipeline", "trainer.devices=2"], (4, 1, 2, 512)),
    (["strategy=tensor", "trainer.devices=4"], (4, 2, 1, 512)),
    (["strategy=pipeline", "strategy.zero_stage=2", "trainer.devices=4"], (4, 2, 1, 512)),
    # expert parallelism lives inside the data-parallel ranks
    (["strategy=ddp", "strategy.expert_parallel=2", "trainer.devices=2", "model.moe={num_experts: 4}"],
     (4, 2, 1, 512)),
    (["strategy=zero", "strategy.data_parallel_replicate=2", "trainer.devices=4", "trainer.micro_batch_size=2"],
     (2, 4, 1, 512)),
    # null: one micro-batch of one process, whatever the micro-batch size
    (["trainer.tokens_per_step=null"], (4, 1, 1, 256)),
    (["trainer.tokens_per_step=null", "strategy=tensor", "trainer.devices=2"], (4, 1, 1, 256)),
])
def test_the_layout_sets_only_the_accumulation(overrides, expected):
    assert batch(*overrides) == expected


@pytest.mark.parametrize("overrides, fix", [
    # the README's swap with one process's micro-batch of 8: halve it, or double the batch
    (["strategy=fsdp", "trainer.devices=2", "trainer.micro_batch_size=8"],
     "set trainer.micro_batch_size=4 (accumulation 1), or trainer.tokens_per_step=1024 (accumulation 1)"),
    (["strategy=zero", "strategy.data_parallel_replicate=2", "trainer.devices=4"],
     "set trainer.micro_batch_size=2 (accumulation 1), or trainer.tokens_per_step=1024 (accumulation 1)"),
    # the largest micro-batch not above the given one that divides, and the nearest multiple of the given one
    # (1536 / (64 x 2) = 12 windows a rank: 4 divides it; 2 x 640 = 1280 is nearer 1536 than 3 x 640 = 1920)
    (["strategy=ddp", "trainer.devices=2", "trainer.micro_batch_size=5", "trainer.tokens_per_step=1536"],
     "set trainer.micro_batch_size=4 (accumulation 3), or trainer.tokens_per_step=1280 (accumulation 2)"),
    # null gives one process's 256 tokens: set it, with the micro-batch that splits it, or the batch of 2 ranks
    (["trainer.tokens_per_step=null", "strategy=ddp", "trainer.devices=2"],
     "set trainer.tokens_per_step=256 with trainer.micro_batch_size=2 (accumulation 1), or "
     "trainer.tokens_per_step=512 (accumulation 1)"),
    # under pipeline parallelism a micro-batch splits into strategy.pipeline.micro_batches (4): none below 4 works
    (["strategy=pipeline", "trainer.devices=8"], "set trainer.tokens_per_step=1024 (accumulation 1)"),
])
def test_a_layout_that_cannot_split_the_batch_is_refused_naming_what_works(overrides, fix):
    with pytest.raises(ConfigError) as err:
        config.load(TINY, overrides)
    message = str(err.value)
    assert message.endswith(fix), message
    for key in ("trainer.tokens_per_step=", "trainer.micro_batch_size=", "data-parallel degree",
                "strategy.data_parallel_replicate=", "data_parallel_shard=", "trainer.devices"):
        assert key in message, key


def test_show_and_train_refuse_the_batch_with_the_same_line(capsys):
    lines = []
    for command in ("show", "train"):
        assert cli.main([command, str(TINY), "strategy=fsdp", "trainer.devices=2", "trainer.micro_batch_size=8"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "trainer.tokens_per_step=512 does not split" in err[0], err
        lines.append(err[0].split(": error: ", 1)[1])
    assert lines[0] == lines[1]


def test_plan_line_names_every_dimension_in_the_glossary_s_words():
    plan = ParallelPlan(data_parallel_replicate=2, data_parallel_shard=2, zero_stage=3, tensor_parallel=2,
                        sequence_parallel=True, pipeline_parallel=2, schedule="gpipe", micro_batches=4,
                        expert_parallel=2)
    assert plan_line(plan, GlobalBatch(4, 64, 4, 3, 3072)) == (
        "plan: data parallel 2 replicate x 2 shard (ZeRO stage 3), context parallel 1, tensor parallel 2 with "
        "sequence parallelism, pipeline parallel 2 (gpipe, 4 pipeline micro-batches), expert parallel 2; "
        "micro-batch 4 x seq_len 64 x data-parallel degree 4 x accumulation 3 = 3,072 tokens per step")
    # FSDP2's mixed-precision policy (strategy.mixed_precision_policy) is said beside the ZeRO stage
    policy = ParallelPlan(data_parallel_shard=2, zero_stage=2, mixed_precision_policy=True)
    assert plan_line(policy, GlobalBatch(4, 64, 2, 1, 512)).startswith(
        "plan: data parallel 1 replicate x 2 shard (ZeRO stage 2, bf16 parameters gathered, fp32 gradients reduced), ")
    assert plan_line(ParallelPlan(), GlobalBatch(8, 64, 1, 1, 512)) == (
        "plan: data parallel 1 replicate x 1 shard, context parallel 1, tensor parallel 1, pipeline parallel 1, "
        "expert parallel 1; micro-batch 8 x seq_len 64 x data-parallel degree 1 x accumulation 1 = 512 tokens per step")
    # Context parallelism is a degree of the layout too: its ranks share a micro-batch, so the data-parallel degree
    # alone (1 here) hid a 2-process run; memory.json says the same layout, not the preset's name (ddp).
    cp = ParallelPlan(context_parallel=2)
    assert plan_line(cp, GlobalBatch(8, 64, 1, 1, 512)).startswith(
        "plan: data parallel 1 replicate x 1 shard, context parallel 2, tensor parallel 1, ")
    record = layout_record(cp, "ddp")
    assert (record["strategy"], record["strategy_preset"], record["context_parallel"]) == (
        "data parallel 1 replicate x 1 shard, context parallel 2, tensor parallel 1, pipeline parallel 1, "
        "expert parallel 1", "ddp", 2)


# One config, six layouts, each one key set (and the processes it needs): tiny.yaml's own 512-token batch (micro-batch
# 4), and an MoE block so that expert parallelism runs the same model. 4 steps, logged every 2.
STEPS = 4
MOE = "model.moe={num_experts: 4, top_k: 2, d_ff_expert: 32, aux_loss: 0.0}"
COMMON = [f"trainer.max_steps={STEPS}", f"trainer.val_every_n_steps={STEPS}", "trainer.log_every_n_steps=2",
          "schedule.warmup_steps=1", "trainer.progress_bar=false", "strategy.timeout_seconds=60",
          "trainer.val_windows=8", "trainer.micro_batch_size=4", MOE]
LAYOUTS = {  # name: (overrides, accumulation)
    "single": ([], 2),
    "ddp2": (["strategy=ddp", "trainer.devices=2"], 1),
    "zero3_2": (["strategy=fsdp", "trainer.devices=2"], 1),
    "tp2": (["strategy=tensor", "trainer.devices=2"], 2),
    "pp2": (["strategy=pipeline", "trainer.devices=2"], 2),
    "ep2": (["strategy=ddp", "strategy.expert_parallel=2", "trainer.devices=2"], 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_six_layouts_of_one_config_train_the_same_tokens(name, tmp_path, tiny_data_dir):
    """Single, DDP 2, ZeRO-3 2, TP 2, PP 2 and EP 2: the same tokens per step and `train/tokens_seen` at every logged
    step (on main, DDP, ZeRO-3 and EP trained twice one process's tokens); one plan line each, from rank 0; and the
    sizes summary.json records are one process's (on main, EP 2 recorded rank 0's half of the experts). One test per
    layout, so that xdist spreads the six runs over its workers; each is held to the tokens one process trains."""
    overrides, accumulation = LAYOUTS[name]
    out = run_module(*train_args(tiny_data_dir, tmp_path, name), *COMMON, *overrides).stdout
    plan = [line for line in out.splitlines() if line.startswith("plan: ")]
    assert len(plan) == 1 and plan[0].endswith(f"x accumulation {accumulation} = 512 tokens per step"), out
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert (summary["tokens_per_step"], summary["accumulate_grad_batches"]) == (512, accumulation), name
    assert summary["tokens_seen"] == STEPS * 512, name
    seen = series(read_metrics(tmp_path / name / "metrics.csv"), "train/tokens_seen")
    # One process's count at each logged step (every 2 of 4): 512 tokens a step, whatever the layout.
    assert seen == [(step, step * 512) for step in range(2, STEPS + 1, 2)], name
    assert_global_sizes(tmp_path / name)
