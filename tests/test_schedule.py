"""Learning-rate schedule table.

Convention (lit_pretrain/optim/schedule.py): `step` is the 0-based index of the optimizer update. With warmup_steps=W,
step s < W uses lr_peak·(s+1)/W; decay runs from step W-1 (lr_peak) to the last step max_steps-1 (lr_min).
Rows below: lr_peak 1.0, lr_min 0.1, W 2, max_steps 10, so decay spans steps 1..9 (8 intervals).
"""

import math

import pytest

from lit_pretrain.errors import ConfigError
from lit_pretrain.optim.schedule import lr_at, lr_lambda
from lit_pretrain.schema import ScheduleConfig


def cos_row(s):  # cosine: 0.1 + 0.45 * (1 + cos(pi * (s - 1) / 8)), SGDR without restarts
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - 1) / 8))


TABLE = {
    # warmup: 1·1/2, 1·2/2, then the decay
    "cosine": [0.5, 1.0] + [cos_row(s) for s in range(2, 10)],
    # linear: 1 - 0.9·(s-1)/8
    "linear": [0.5, 1.0, 0.8875, 0.775, 0.6625, 0.55, 0.4375, 0.325, 0.2125, 0.1],
    # wsd with decay_fraction 0.5: stable to step 9 - round(0.5·10) = 4, then 1 - 0.9·(s-4)/5
    "wsd": [0.5, 1.0, 1.0, 1.0, 1.0, 0.82, 0.64, 0.46, 0.28, 0.1],
    "constant": [0.5] + [1.0] * 9,
}


@pytest.mark.parametrize("kind", list(TABLE))
def test_schedule_table(kind):
    got = [lr_at(s, kind=kind, lr_peak=1.0, lr_min=0.1, warmup_steps=2, max_steps=10, decay_fraction=0.5)
           for s in range(10)]
    assert got == pytest.approx(TABLE[kind], abs=1e-12)


def test_cosine_hand_values():
    # step 2: progress 1/8, 0.1 + 0.45·(1 + cos(π/8)) = 0.1 + 0.45·1.9238795 = 0.9657458
    lr = lr_at(2, kind="cosine", lr_peak=1.0, lr_min=0.1, warmup_steps=2, max_steps=10)
    assert lr == pytest.approx(0.9657458, abs=1e-7)
    # midpoint of the decay (step 5, progress 1/2): exactly halfway between peak and min
    assert lr_at(5, kind="cosine", lr_peak=1.0, lr_min=0.1, warmup_steps=2, max_steps=10) == pytest.approx(0.55)


def test_no_warmup_starts_at_peak_and_ends_at_min():
    assert lr_at(0, kind="cosine", lr_peak=3e-4, lr_min=3e-5, warmup_steps=0, max_steps=100) == 3e-4
    assert lr_at(99, kind="cosine", lr_peak=3e-4, lr_min=3e-5, warmup_steps=0, max_steps=100) == pytest.approx(3e-5)


def test_lambda_is_relative_to_peak():
    factor = lr_lambda(ScheduleConfig(kind="linear", warmup_steps=2, lr_min=0.1), lr_peak=2.0, max_steps=10)
    # step 2: 2.0 + (0.1 - 2.0)·1/8 = 1.7625, as a factor of the peak: 0.88125
    assert factor(2) == pytest.approx(0.88125)
    assert factor(9) == pytest.approx(0.1 / 2.0)


def test_unknown_kind_is_an_error():
    with pytest.raises(ValueError, match="schedule.kind"):
        lr_at(0, kind="step", lr_peak=1.0, lr_min=0.0, warmup_steps=0, max_steps=10)


def test_wsd_one_minus_sqrt_table():
    # Hägele et al. 2024 (arXiv 2405.18392) §3: the 1-sqrt cooldown, lr_min + (lr_peak - lr_min)·(1 - sqrt(p)). Same
    # rows as the wsd line of TABLE (lr_peak 1, lr_min 0.1, warmup 2, max_steps 10, decay_fraction 0.5): stable to
    # step 4, then p = (s - 4)/5: 1 - 0.9·sqrt(p) = 1 - 0.9·(0.4472136, 0.6324555, 0.7745967, 0.8944272, 1).
    got = [lr_at(s, kind="wsd", lr_peak=1.0, lr_min=0.1, warmup_steps=2, max_steps=10, decay_fraction=0.5,
                 decay_shape="1-sqrt") for s in range(10)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 0.5975078, 0.4307900, 0.3028629, 0.1950155, 0.1], abs=1e-7)
    # A wsd run of S steps is, up to step S - round(f·S) - 1, the constant-rate run of the same warmup whatever its
    # max_steps: the ladder branches each budget's cooldown from one long run's checkpoint at that step.
    for max_steps in (20, 40, 80):
        start = max_steps - round(0.2 * max_steps)
        assert [lr_at(s, kind="wsd", lr_peak=1.0, lr_min=0.0, warmup_steps=3, max_steps=max_steps,
                      decay_fraction=0.2, decay_shape="1-sqrt") for s in range(start)] == \
            [lr_at(s, kind="constant", lr_peak=1.0, lr_min=0.0, warmup_steps=3, max_steps=1) for s in range(start)]
        assert lr_at(start, kind="wsd", lr_peak=1.0, lr_min=0.0, warmup_steps=3, max_steps=max_steps,
                     decay_fraction=0.2, decay_shape="1-sqrt") < 1.0
    with pytest.raises(ConfigError, match="schedule.decay_shape=1-sqrt shapes the decay of schedule.kind=wsd only"):
        ScheduleConfig(kind="cosine", decay_shape="1-sqrt")
