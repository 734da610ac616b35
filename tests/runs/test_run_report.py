"""The end-of-run summary's words follow its numbers: above/below by the sign, time labelled by its scope."""

import pytest

from lit_pretrain.train import loss_against_entropy, timing_line


@pytest.mark.parametrize("val_loss, entropy, expected", [
    (4.000, 3.460, "the model is 0.540 nats/token above it"),  # the reported case: worse than unigram
    (3.000, 3.460, "the model is 0.460 nats/token below it"),  # uses context beyond token frequencies
    (3.4601, 3.460, "the model is level with it"),  # equal to the 3 decimals printed
    (5.0, 5.0, "the model is level with it"),
    (3.4596, 3.460, "the model is level with it"),
    (3.458, 3.460, "the model is 0.002 nats/token below it"),
])
def test_loss_against_entropy_says_above_or_below_by_the_sign(val_loss, entropy, expected):
    assert loss_against_entropy(val_loss, entropy) == expected
    assert "−" not in expected and "-" not in loss_against_entropy(val_loss, entropy)  # never a negative distance


def test_timing_line_of_a_resumed_finished_run_labels_each_scope():
    # Resuming a finished run: 41.9 s of training in earlier sessions, none now, 0.3 s of wall time.
    line = timing_line(steps=60, train_seconds=41.9, tokens_per_second=1466.4, session_train_seconds=0.0,
                       wall_seconds=0.3)
    assert line == ("60 steps, 41.9 s of training in all sessions (1,466 tokens/s); this session 0.0 s of training, "
                    "0.3 s wall time")


def test_timing_line_without_a_rate():
    assert timing_line(0, 0.0, None, 0.0, 1.26) == ("0 steps, 0.0 s of training in all sessions; this session 0.0 s "
                                                    "of training, 1.3 s wall time")


@pytest.mark.slow
def test_resuming_a_finished_run_reports_earlier_training_apart_from_this_session(tmp_path, tiny_data_dir, capsys):
    from lit_pretrain import config
    from lit_pretrain.train import train
    from tests.conftest import EXPERIMENTS, tiny_data_overrides

    def run(*extra):
        return train(config.load(EXPERIMENTS / "runs" / "tiny.yaml", [
            *tiny_data_overrides(tiny_data_dir), f"run.root_dir={tmp_path}", "trainer.progress_bar=false",
            "trainer.max_steps=2", "trainer.val_every_n_steps=2", "schedule.warmup_steps=1", *extra]))

    first = run()
    assert 0 < first["session_train_seconds"] == pytest.approx(first["train_seconds"], abs=0.05)
    capsys.readouterr()
    again = run("run.resume=auto")  # nothing left to train
    out = capsys.readouterr().out
    # Lightning's Timer restored the first session's training time (up to its checkpoint) ...
    assert again["steps"] == 2 and again["train_seconds"] == pytest.approx(first["train_seconds"], rel=0.2)
    # ... and this session trained for no time: the two are reported apart, and neither exceeds the wall time.
    assert again["session_train_seconds"] < 0.05 and again["session_train_seconds"] <= again["wall_seconds"]
    assert f"{again['train_seconds']:.1f} s of training in all sessions" in out
    assert f"this session {again['session_train_seconds']:.1f} s of training" in out
