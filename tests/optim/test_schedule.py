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


# Stages (lit_pretrain/optim/stages.py): a run resumed at step k (updates 0..k-1 trained) under a changed
# trainer.max_steps or a declared schedule.stage. Rows: lr_peak 1.0, lr_min 0.1, warmup 2; rates as lr_at's table
# above, and optim/schedule.py decay_at for the re-planned or declared decays.
def _pieces_at(k, first, *, kind="cosine", max_steps=10, stage=None, lr_min=0.1, decay_fraction=0.5):
    from lit_pretrain.optim import stages
    from lit_pretrain.schema import StageScheduleConfig

    def sched(**kw):
        return ScheduleConfig(kind=kind, warmup_steps=2, lr_min=lr_min, decay_fraction=decay_fraction,
                              decay_shape="linear", **kw)

    before = stages.start(sched(), 1.0, first)
    stage_cfg = None if stage is None else StageScheduleConfig(**stage)
    return stages.resume(before, k, sched(stage=stage_cfg), 1.0, max_steps)


def _rates(pieces, steps):
    from lit_pretrain.optim.stages import factor_at

    return [factor_at(pieces, s) for s in steps]


def test_an_extended_cosine_run_continues_from_the_rate_it_reached():
    # A finished 10-step cosine (step 9 at lr_min 0.1) extended to 20: held at 0.1, where a recomputed cosine over
    # 20 steps would re-warm to 0.1 + 0.45·(1 + cos(pi·9/18)) = 0.55 at step 10.
    pieces = _pieces_at(10, 10, max_steps=20)
    assert pieces[-1]["how"] == "continued" and pieces[-1]["start"] == 10
    assert _rates(pieces, range(10)) == pytest.approx(TABLE["cosine"])
    assert _rates(pieces, range(9, 20)) == pytest.approx([0.1] * 11)
    # Mid-decay (k = 5: step 4 at cos_row(4)), extended to 20: the half cosine from that rate to 0.1 over steps
    # 4..19, so step 5 lies just below step 4 (no jump), step 19 at lr_min.
    mid = _pieces_at(5, 10, max_steps=20)
    r4 = cos_row(4)
    expected = [0.1 + 0.5 * (r4 - 0.1) * (1 + math.cos(math.pi * (s - 4) / 15)) for s in range(4, 20)]
    assert _rates(mid, range(4, 20)) == pytest.approx(expected)
    assert _rates(mid, range(5)) == pytest.approx(TABLE["cosine"][:5])


def test_a_wsd_run_in_its_stable_phase_is_the_wsd_run_of_the_new_length():
    # Recomputed: at the last step trained (3) both lengths are stable at 1.0, so steps 4.. are lr_at's over 20
    # (the ladder's branched cooldowns, shortened as well as extended); in its decay it re-plans instead.
    for max_steps in (8, 20):
        pieces = _pieces_at(4, 10, kind="wsd", max_steps=max_steps)
        assert "lr_at" in pieces[-1]["rule"]
        assert _rates(pieces, range(max_steps)) == [
            lr_at(s, kind="wsd", lr_peak=1.0, lr_min=0.1, warmup_steps=2, max_steps=max_steps, decay_fraction=0.5)
            for s in range(max_steps)]
    decaying = _pieces_at(7, 10, kind="wsd", max_steps=12)  # step 6 at 0.64 (TABLE["wsd"]), then 0.64 → 0.1 linear
    assert _rates(decaying, range(6, 12)) == pytest.approx([0.64 - 0.54 * i / 5 for i in range(6)])


def test_a_declared_stage_decays_from_the_rate_reached_and_a_resume_inside_it_continues_it():
    # An anneal stage from k = 5 (step 4 at cos_row(4)) to 0 at step 9 (max_steps 10), linear: cos_row(4)·(1 - i/5).
    pieces = _pieces_at(5, 20, max_steps=10, stage={"kind": "linear", "lr_min": 0.0})
    assert (pieces[-1]["how"], pieces[-1]["start"]) == ("stage", 5)
    r4 = lr_at(4, kind="cosine", lr_peak=1.0, lr_min=0.1, warmup_steps=2, max_steps=20)
    assert _rates(pieces, range(4, 10)) == pytest.approx([r4 * (1 - i / 5) for i in range(6)])
    # A resume inside the stage (its checkpoint at step 7, the same config): the recorded pieces, unchanged.
    from lit_pretrain.optim import stages
    from lit_pretrain.schema import StageScheduleConfig

    same = ScheduleConfig(kind="cosine", warmup_steps=2, lr_min=0.1, decay_fraction=0.5,
                          stage=StageScheduleConfig(kind="linear", lr_min=0.0))
    assert stages.resume(pieces, 7, same, 1.0, 10) is pieces
    # 1-sqrt and a floor: 0.05 + (r4 - 0.05)(1 - sqrt(i/5)); constant: r4 held.
    sqrt = _pieces_at(5, 20, max_steps=10, stage={"kind": "1-sqrt", "lr_min": 0.05})
    assert _rates(sqrt, range(4, 10)) == pytest.approx([0.05 + (r4 - 0.05) * (1 - math.sqrt(i / 5)) for i in range(6)])
    assert _rates(_pieces_at(5, 20, max_steps=10, stage={"kind": "constant"}), range(4, 10)) == pytest.approx([r4] * 6)


def test_a_checkpoint_before_recorded_pieces_continues_its_config_schedule():
    from lit_pretrain.optim import stages

    flat = {"schedule.kind": "cosine", "schedule.warmup_steps": 2, "schedule.lr_min": 0.1,
            "schedule.decay_fraction": 0.2, "schedule.decay_shape": "linear", "trainer.max_steps": 10,
            "optim.lr_peak": 1.0}
    assert _rates(stages.from_config(flat), range(10)) == pytest.approx(TABLE["cosine"])
