"""trainer.loggers (csv, TensorBoard, Weights & Biases offline) and trainer.profile (a PyTorch profiler trace)."""

import csv
import json

import pytest

from lit_pretrain import config, train
from lit_pretrain.errors import ConfigError
from lit_pretrain.resume import compat
from lit_pretrain.resume.metrics_csv import ResumableCSVLogger
from tests.conftest import EXPERIMENTS, tiny_data_overrides

RUN_FILE = EXPERIMENTS / "runs" / "tiny.yaml"


@pytest.mark.parametrize("value, message", [
    ("[tensorboard]", r"trainer\.loggers=\['tensorboard'\] lacks csv: .*add csv"),
    ("[csv,mlflow]", r"trainer\.loggers=.*unknown logger 'mlflow'; choose from csv, tensorboard, wandb"),
    ("[csv,csv]", r"trainer\.loggers=.*names a logger twice"),
])
def test_loggers_list_is_checked_when_the_config_loads(value, message):
    with pytest.raises(ConfigError, match=message):
        config.load(RUN_FILE, [f"trainer.loggers={value}"])


def test_profile_section_is_checked_when_the_config_loads():
    cfg = config.load(RUN_FILE, ["trainer.profile.start_step=2"])
    assert (cfg.trainer.profile.start_step, cfg.trainer.profile.steps) == (2, 3)
    assert config.load(RUN_FILE).trainer.profile is None
    # an optional section's fields are range-checked like every other key's (config._check_section)
    with pytest.raises(ConfigError, match=r"config key 'trainer\.profile\.steps' = 0: expected a value >= 1"):
        config.load(RUN_FILE, ["trainer.profile={steps: 0}"])


def test_a_resume_may_change_loggers_and_profile():
    """They say how a run is observed, not what it computes; a checkpoint from before these keys existed resumes."""
    manifest = {"tokenizer": {"sha256": "t"}, "splits": {}}
    old = {"trainer": {"devices": 1}}
    saved = compat.run_meta(old, manifest, 512)
    for trainer in ({"devices": 1, "loggers": ["csv", "tensorboard"], "profile": None},
                    {"devices": 1, "loggers": ["csv", "wandb"], "profile": {"start_step": 5, "steps": 3}}):
        assert compat.check_resume(saved, compat.run_meta({"trainer": trainer}, manifest, 512), [], "c", "t") == []


def test_missing_packages(tmp_path, monkeypatch, capsys):
    real = train.importlib.util.find_spec
    monkeypatch.setattr(train.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "tensorboardX", "wandb") else real(name, *a))
    # The default list names tensorboard: without it the run still trains, with metrics.csv only, and says so.
    c = config.to_object(config.load(RUN_FILE))
    out = train.loggers(tmp_path, c)
    assert [type(lg) for lg in out] == [ResumableCSVLogger]
    assert "tensorboard is not installed" in capsys.readouterr().out
    # wandb is asked for by name only: its absence is an error naming the key.
    # Refused when the config loads (so `show` refuses it too), and by loggers() for a config made without load.
    with pytest.raises(ConfigError, match=r"trainer\.loggers lists wandb, which is not installed.*\[logging\]"):
        config.load(RUN_FILE, ["trainer.loggers=[csv,wandb]"])
    c.trainer.loggers = ["csv", "wandb"]
    with pytest.raises(ConfigError, match=r"trainer\.loggers lists wandb, which is not installed.*\[logging\]"):
        train.loggers(tmp_path, c)


@pytest.mark.slow
def test_tensorboard_wandb_and_profile_in_one_tiny_run(tmp_path, tiny_data_dir, monkeypatch):
    """One 3-step run with every logger and its second step profiled (trainer.profile.start_step=1: after 1 step)."""
    # The logging extra (lit-pretrain[logging], pulled by [dev]): installed by `make install` and CI.
    pytest.importorskip("tensorboard")
    wandb = pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wb"),
                       "WANDB_CACHE_DIR": str(tmp_path / "wb"), "WANDB_DATA_DIR": str(tmp_path / "wb")}.items():
        monkeypatch.setenv(var, value)
    cfg = config.load(RUN_FILE, [
        *tiny_data_overrides(tiny_data_dir), f"run.root_dir={tmp_path / 'runs'}", "run.name=logged",
        "trainer.progress_bar=false", "trainer.max_steps=3", "trainer.val_every_n_steps=3", "trainer.val_windows=8",
        "trainer.log_every_n_steps=1", "schedule.warmup_steps=1", "callbacks.throughput.peak_flops_per_s=1e11",
        "trainer.loggers=[csv,tensorboard,wandb]", "trainer.profile={start_step: 1, steps: 1}",
    ])
    try:
        train.train(cfg)
        assert wandb.run is None  # train() finished its run: a later train() in this process starts its own
    finally:
        wandb.finish()  # a process-wide run: the next WandbLogger in this process would reuse it
    run_dir = tmp_path / "runs" / "logged"

    with open(run_dir / "metrics.csv") as f:
        csv_losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r["train/loss"]]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert "train/loss" in events.Tags()["scalars"]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(csv_losses, rel=1e-6)
    assert len(csv_losses) == 3
    # TensorBoard's steps are metrics.csv's: optimizer steps completed (W&B is written through the same step).
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("val/loss")] == [3]

    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb")), list((run_dir / "wandb").iterdir())

    trace = json.loads((run_dir / "profile" / "trace-rank0.json").read_text())
    names = [e.get("name", "") for e in trace["traceEvents"]]
    assert {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul"} & set(names)
    # Exactly one optimizer step in the window (torch.optim records each step under this name).
    assert sum(n.startswith("Optimizer.step#") for n in names) == 1
    assert not list((run_dir / "profile").glob(".*"))  # no temporary file left
