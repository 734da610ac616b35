"""The order read under trainer.batch_schedule (data/scheduled.py), in-process: each optimizer step holds the
windows the step map gives it, [before(s), before(s + 1)) of the global order, under any process count and
accumulation, and a loader resumed from another layout's state at any step continues with the same windows."""

import pytest
import torch

from lit_pretrain.data.datamodule import GlobalOrderSampler
from lit_pretrain.data.scheduled import ScheduledOrderSampler
from lit_pretrain.data.train_loader import TrainLoader
from lit_pretrain.planning.batch_schedule import StepWindows

STEPS = StepWindows([(0, 8), (2, 16), (3, 32)])  # windows per step: 8, 8, 16, 32, 32, ...
WINDOWS = 120  # whole steps 0-4 fit (8 + 8 + 16 + 32 + 32 = 96; a sixth would need 128)


def loaders(world_size: int, accumulation: int, shuffle: str):
    """One TrainLoader per rank over a dataset whose item i is i, so a batch is its window indices."""
    data = torch.arange(WINDOWS)
    bases = [GlobalOrderSampler(WINDOWS, 1, r, world_size, 3, shuffle=shuffle) for r in range(world_size)]
    return [TrainLoader(data, ScheduledOrderSampler(base, STEPS, accumulation), None) for base in bases]


def steps_read(ranks, accumulation: int, first_step: int = 0):
    """{step: sorted windows of its micro-batches on every rank}, iterating the ranks' loaders in lockstep."""
    out = {}
    for m, batches in enumerate(zip(*ranks)):
        out.setdefault(first_step + m // accumulation, []).extend(i for b in batches for i in b.tolist())
    return {s: sorted(w) for s, w in out.items()}


@pytest.mark.parametrize("shuffle", ["stored", "feistel"])
def test_each_step_holds_its_windows_of_the_order_under_every_layout(shuffle):
    ref = loaders(1, 1, shuffle)[0].order
    order = ref.global_order(0).tolist()
    # By hand: before(s) = 0, 8, 16, 32, 64, 96.
    expected = {s: sorted(order[a:b]) for s, (a, b) in enumerate([(0, 8), (8, 16), (16, 32), (32, 64), (64, 96)])}
    assert (ref.steps_per_epoch, ref.samples_per_epoch) == (5, 96)
    for world_size, accumulation in [(1, 1), (1, 4), (2, 2), (4, 2)]:  # micro-batches of 1-32 windows
        assert steps_read(loaders(world_size, accumulation, shuffle), accumulation) == expected, \
            (world_size, accumulation)


@pytest.mark.parametrize("stop_step", [1, 2, 3])
def test_resumed_on_another_layout_at_any_step_it_continues_the_same_windows(stop_step):
    full = steps_read(loaders(1, 2, "stored"), 2)
    first = loaders(1, 2, "stored")[0]
    it = iter(first)
    for _ in range(stop_step * 2):  # the micro-batches of steps 0 .. stop_step - 1, each taken as training does
        next(it)
        first.take_trained_indices()
    state = first.state_dict()
    assert state["trained_samples"] == STEPS.before(stop_step)
    resumed = loaders(2, 4, "stored")  # another process count and accumulation
    for loader in resumed:
        loader.load_state_dict(state)
    assert steps_read(resumed, 4, stop_step) == {s: full[s] for s in range(stop_step, 5)}


def test_a_position_inside_a_micro_batch_of_this_layout_is_refused():
    from lit_pretrain.errors import ConfigError

    loader = loaders(1, 1, "stored")[0]
    with pytest.raises(ConfigError, match="not a whole number of micro-batches"):
        loader.order.micro_at(20)  # step 2 holds 16..31 in one micro-batch on one process
