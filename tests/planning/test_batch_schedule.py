"""trainer.batch_schedule (planning/batch_schedule.py): the step-to-window map and the learning-rate rule as table
tests, and what the config load refuses (config.check), naming the keys."""

import math
from pathlib import Path

import pytest

from lit_pretrain import config
from lit_pretrain.errors import ConfigError
from lit_pretrain.planning.batch_schedule import StepWindows, check, lr_factor, step_windows

TINY = Path(__file__).resolve().parents[2] / "experiments" / "runs" / "tiny.yaml"  # seq_len 64
SCHEDULE = [(0, 8), (3, 16), (5, 32)]  # windows per step: 8 for steps 0-2, 16 for 3-4, 32 from 5 on


@pytest.mark.parametrize("step, before, size", [
    # before(s) = the sum of the batches of steps 0..s-1, by hand: 8·3 = 24 at step 3, 24 + 16·2 = 56 at step 5.
    (0, 0, 8), (1, 8, 8), (2, 16, 8), (3, 24, 16), (4, 40, 16), (5, 56, 32), (6, 88, 32), (10, 216, 32)])
def test_windows_before_a_step_are_the_sum_of_the_scheduled_batches(step, before, size):
    steps = StepWindows(SCHEDULE)
    assert (steps.before(step), steps.size(step)) == (before, size)
    assert steps.locate(before) == (step, 0)  # the inverse, at each step's first window
    assert steps.locate(before + size - 1) == (step, size - 1)


@pytest.mark.parametrize("windows, steps", [(0, 0), (23, 2), (24, 3), (55, 4), (56, 5), (87, 5), (88, 6)])
def test_whole_steps_within_an_epoch(windows, steps):
    assert StepWindows(SCHEDULE).steps_within(windows) == steps


def test_the_map_in_tokens_and_a_fixed_batch():
    schedule = [{"at_step": 0, "tokens_per_step": 512}, {"at_step": 2, "tokens_per_step": 1024}]
    assert [step_windows(schedule, 64, 0).before(s) for s in range(5)] == [0, 8, 16, 32, 48]
    assert [step_windows(schedule, 1, 0).before(s) for s in range(5)] == [0, 512, 1024, 2048, 3072]
    assert [step_windows([], 64, 1024).before(s) for s in range(3)] == [0, 16, 32]  # no schedule: one batch


@pytest.mark.parametrize("rule, factors", [
    # (batch / first batch) ** p: Malladi et al. 2022 sqrt (p = 1/2), Goyal et al. 2017 linear (p = 1), none.
    ("sqrt", [1.0, 1.0, math.sqrt(2), math.sqrt(4)]),
    ("linear", [1.0, 1.0, 2.0, 4.0]),
    ("none", [1.0, 1.0, 1.0, 1.0])])
def test_the_learning_rate_follows_the_batch_by_the_rule(rule, factors):
    schedule = [{"at_step": 0, "tokens_per_step": 512}, {"at_step": 2, "tokens_per_step": 1024},
                {"at_step": 3, "tokens_per_step": 2048}]
    assert [lr_factor(schedule, rule, s) for s in range(4)] == pytest.approx(factors, rel=1e-15)
    assert lr_factor([], rule, 7) == 1.0


def test_each_entry_splits_into_whole_micro_batches_of_the_layout():
    schedule = [{"at_step": 0, "tokens_per_step": 512}, {"at_step": 4, "tokens_per_step": 2048}]
    assert check(schedule, 64, 2, 2) == [2, 8]  # micro-batches of 512 / (64·2·2) and 2048 / (64·2·2)
    with pytest.raises(ConfigError, match=r"trainer.batch_schedule\[0\].tokens_per_step=512 .* multiple of 1024"):
        check(schedule, 64, 2, 8)  # 64·2·8 = 1024 tokens a micro-batch step


def load(*overrides):
    return config.load(TINY, ["trainer.tokens_per_step=null", *overrides])


GROW = "trainer.batch_schedule=[{at_step: 0, tokens_per_step: 512}, {at_step: 2, tokens_per_step: 2048}]"


def test_the_largest_entry_sets_the_accumulation():
    from lit_pretrain.planning.batch import global_batch

    c = load(GROW, "trainer.micro_batch_size=8")
    b = global_batch(c.trainer, c.model.seq_len, c.plan)
    assert (b.micro_batch_size, b.accumulation, b.tokens_per_step) == (8, 4, 2048)


@pytest.mark.parametrize("overrides, message", [
    # accumulation 2048 / (2·64) = 16: the 512 entry would need micro-batches of half a window.
    ([GROW, "trainer.micro_batch_size=2"], r"trainer.batch_schedule\[0\].tokens_per_step=512 .* 1024 tokens"),
    ([GROW, "trainer.micro_batch_size=8", "trainer.tokens_per_step=1024"], r"trainer.tokens_per_step=1024 with "),
    (["trainer.batch_schedule=[{at_step: 1, tokens_per_step: 512}]"], r"batch_schedule\[0\].at_step=1"),
    ([GROW.replace("at_step: 2", "at_step: 0")], r"batch_schedule\[1\].at_step=0"),
    ([GROW, "trainer.micro_batch_size=8", "data.sources=[{name: a}, {name: b}]"], r"with data.sources"),
    ([GROW, "trainer.micro_batch_size=8", "strategy.pipeline_parallel=2", "trainer.devices=2",
      "strategy.name=ddp"],
     r"with strategy.pipeline_parallel=2"),
])
def test_refused_at_load_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load(*overrides)


def test_the_line_train_prints():
    from lit_pretrain.planning.batch import GlobalBatch
    from lit_pretrain.planning.batch_schedule import schedule_line

    schedule = [{"at_step": 0, "tokens_per_step": 512}, {"at_step": 2, "tokens_per_step": 1024}]
    assert schedule_line(schedule, GlobalBatch(8, 64, 1, 2, 1024), "sqrt") == (
        "batch schedule (trainer.batch_schedule_lr=sqrt): 512 tokens (micro-batch 4, lr x 1) from step 0; 1,024 "
        "tokens (micro-batch 8, lr x 1.414) from step 2")
