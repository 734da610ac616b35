"""A researcher's own code meets no traps: own callbacks, run files outside experiments/, a plain lightning.Trainer."""

import json
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_pretrain import cli, config
from lit_pretrain.callbacks.user import user_callbacks
from lit_pretrain.errors import ConfigError
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.module import PretrainModule
from lit_pretrain.runs.folder import read_metrics, series
from lit_pretrain.schema import CallbacksConfig, CallbackSpec, OptimConfig, ScheduleConfig
from tests.conftest import EXPERIMENTS, ROOT, launcher_env, run_module, tiny_data_overrides, train_args


class ChecksItsArguments(L.Callback):
    """The README's pattern: check constructor arguments in __init__ and say which one is wrong."""

    def __init__(self, every_n_steps: int = 1):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps


class FailsOnTwoLines(L.Callback):
    def __init__(self):
        raise RuntimeError("first line\n  second line")


class RaisesTypeErrorInside(L.Callback):
    def __init__(self, n: int = 1):
        raise TypeError("n must be an int, not str")


class NotACallback:
    pass


def build(class_path, **init_args):
    return user_callbacks(CallbacksConfig(extra=[CallbackSpec(class_path=class_path, init_args=init_args)]))


@pytest.mark.parametrize("class_path, args, message", [
    ("tests.test_user_code:ChecksItsArguments", {"every_n_steps": 0},
     r"^callbacks\.extra\[0\] \(tests\.test_user_code:ChecksItsArguments\): ValueError: every_n_steps must be >= 1, "
     r"got 0$"),
    ("tests.test_user_code:FailsOnTwoLines", {}, r"RuntimeError: first line second line$"),
    # A TypeError raised by the constructor's own check is the constructor's message, not "init_args do not fit".
    ("tests.test_user_code:RaisesTypeErrorInside", {"n": "x"},
     r"\(tests\.test_user_code:RaisesTypeErrorInside\): TypeError: n must be an int, not str$"),
    ("tests.test_user_code:ChecksItsArguments", {"every_n_step": 3},
     r"^callbacks\.extra\[0\]\.init_args do not fit tests\.test_user_code:ChecksItsArguments: .*every_n_step"),
    ("no_such_module_xyz:Thing", {}, r"^callbacks\.extra\[0\]\.class_path='no_such_module_xyz:Thing': cannot import"),
    ("tests.test_user_code:Missing", {}, r"module tests\.test_user_code has no 'Missing'"),
    ("tests.test_user_code:NotACallback", {}, r"'NotACallback' is not a Lightning Callback class"),
])
def test_every_bad_callback_spec_is_one_config_error_line(class_path, args, message):
    with pytest.raises(ConfigError, match=message) as err:
        build(class_path, **args)
    assert "\n" not in str(err.value)


def test_a_module_with_a_syntax_error_is_one_line_naming_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "broken_cb.py").write_text("import lightning\n\nclass Cb(lightning.Callback:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^callbacks\.extra\[0\]\.class_path='broken_cb:Cb': cannot import module "
                                          r"'broken_cb': SyntaxError: .*broken_cb\.py, line 3\)$"):
        build("broken_cb:Cb")


def test_a_callback_refusing_its_arguments_exits_2_with_one_line(tmp_path, tiny_data_dir, capsys):
    spec = "{class_path: 'tests.test_user_code:ChecksItsArguments', init_args: {every_n_steps: 0}}"
    rc = cli.main(["train", str(EXPERIMENTS / "runs" / "tiny.yaml"), *tiny_data_overrides(tiny_data_dir),
                   f"run.root_dir={tmp_path}", "trainer.progress_bar=false", f"callbacks.extra=[{spec}]"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err == ("lit-pretrain train: error: callbacks.extra[0] (tests.test_user_code:ChecksItsArguments): "
                   "ValueError: every_n_steps must be >= 1, got 0")


def test_a_callback_beside_the_run_file_is_imported_when_the_config_loads(tmp_path, monkeypatch, capsys):
    """A module beside a run file outside the repository: found when the config loads (and so by `train`, which
    loads it again in every rank a launcher starts), from any working directory; one that is missing is refused by
    `show` and the load, naming the key and where it was looked for."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "beside_cb.py").write_text("import lightning\n\n\nclass Beside(lightning.Callback):\n"
                                         "    def __init__(self, every: int = 1):\n        self.every = every\n")
    run = folder / "zl.yaml"
    spec = "- {class_path: 'beside_cb:Beside', init_args: {every: 3}}"
    head = "defaults: [base, {model: tiny}]\ncallbacks:\n  extra:\n    "
    run.write_text(f"{head}{spec}\n")
    monkeypatch.chdir(tmp_path)  # not the run file's folder
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the test
    monkeypatch.delitem(sys.modules, "beside_cb", raising=False)
    cfg = config.load(run)
    assert "beside_cb" in sys.modules and sys.path[-1] == str(folder)  # kept: spawned processes get sys.path
    (callback,) = user_callbacks(config.to_object(cfg).callbacks)
    assert type(callback).__name__ == "Beside" and callback.every == 3

    run.write_text(f"{head}{spec.replace('every: 3', 'evry: 3')}\n")
    with pytest.raises(ConfigError, match=r"^callbacks\.extra\[0\]\.init_args do not fit beside_cb:Beside: .*evry"):
        config.load(run)
    run.write_text(f"{head}{spec.replace('beside_cb', 'gone_cb')}\n")
    assert cli.main(["show", str(run)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"lit-pretrain show: error: callbacks.extra[0].class_path='gone_cb:Beside': cannot import module 'gone_cb' "
        f"(No module named 'gone_cb'); looked on sys.path (PYTHONPATH, installed packages), then in {folder}, "
        f"{tmp_path}: put it beside the run file or in the working directory, or add its folder to PYTHONPATH")


# --- run files outside experiments/ -------------------------------------------------------------------------------

def test_a_run_file_anywhere_composes_the_shipped_groups(tmp_path):
    run = tmp_path / "x" / "zl.yaml"
    run.parent.mkdir()
    run.write_text("defaults: [base, {model: tiny}, {strategy: single}]\ntrainer: {max_steps: 700}\n")
    cfg = config.load(run, ["data=stdlib"])
    shipped = config.load(EXPERIMENTS / "runs" / "tiny.yaml")
    assert cfg.model == shipped.model and cfg.trainer.max_steps == 700


def test_the_run_files_own_root_comes_first(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny.yaml").write_text("d_model: 48\nn_heads: 4\nn_layers: 1\nseq_len: 32\n")
    (tmp_path / "model" / "mine.yaml").write_text("d_model: 16\nn_heads: 2\nn_layers: 1\nseq_len: 32\n")
    run = tmp_path / "zl.yaml"
    run.write_text("defaults: [base, {model: tiny}]\n")
    assert config.load(run).model.d_model == 48  # its own tiny.yaml, not the shipped one
    assert config.load(run, ["model=mine"]).model.d_model == 16  # a choice the project does not ship
    assert config.load(run, ["model=small"]).model.d_model == config.load(  # the rest from the shipped folder
        EXPERIMENTS / "runs" / "tiny.yaml", ["model=small", "trainer.tokens_per_step=null"]).model.d_model


def test_a_missing_name_says_where_it_looked(tmp_path, monkeypatch):
    run = tmp_path / "zl.yaml"
    run.write_text("defaults: [base, {model: huge}]\n")
    with pytest.raises(ConfigError, match=rf"model=huge .*no file model/huge\.yaml in {tmp_path}, {EXPERIMENTS}; "
                                          r"choose one of: .*tiny"):
        config.load(run)
    # An installed wheel has no experiments/: the error says so instead of naming a folder that is not there.
    monkeypatch.setattr(config, "shipped_experiments", lambda: None)
    run.write_text("defaults: [base]\n")
    with pytest.raises(ConfigError, match=rf"'base' in the defaults of {run}: no file base\.yaml in {tmp_path} "
                                          r"\(the project's experiments/ folder is not installed"):
        config.load(run)


# --- a plain lightning.Trainer -------------------------------------------------------------------------------------

def test_trainer_gradient_clip_val_is_refused_naming_optim_grad_clip_norm(tmp_path):
    torch.manual_seed(0)
    module = PretrainModule(GPTConfig(vocab_size=97, n_layers=1, d_model=32, n_heads=4, seq_len=16),
                            OptimConfig(grad_clip_norm=1.0), ScheduleConfig(warmup_steps=0), max_steps=2,
                            tokens_per_step=64)
    data = torch.randint(0, 97, (8, 17))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, gradient_clip_val=0.5, logger=False,
                        default_root_dir=tmp_path, limit_val_batches=0, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    with pytest.raises(ConfigError, match=r"gradient_clip_val=0\.5\).*optim\.grad_clip_norm \(now 1\.0\).*"
                                          r"set optim\.grad_clip_norm=0\.5"):
        trainer.fit(module, loader)
    assert trainer.global_step == 0  # refused before any step ran


@pytest.mark.slow
@pytest.mark.parametrize("init_args, status, reason", [
    ("{step: 7, done: true}", "finished", "stop_at: step 7 reached"),
    ("{step: 7, bare: true}", "stopped", "a callback set trainer.should_stop at step 7 of trainer.max_steps=20 without "
                                         "giving a reason (a callback gives one with "
                                         "lit_pretrain.resume.stop.stop_run)"),
])
def test_a_callback_that_stops_the_run_is_recorded_as_the_stop_it_is(tmp_path, tiny_data_dir, init_args, status,
                                                                     reason):
    """`lit-pretrain train` whose own callback ends the run after step 7 of 20: exit 0, the checkpoint of step 7, and
    summary.json says finished (the callback declared the run done) or stopped (a bare trainer.should_stop), with the
    reason, never failed."""
    spec = f"{{class_path: 'tests.helpers.stability_helpers:StopAt', init_args: {init_args}}}"
    args = [*train_args(tiny_data_dir, tmp_path, "stops"), "trainer.progress_bar=false", "trainer.max_steps=20",
            "trainer.val_every_n_steps=20", f"callbacks.extra=[{spec}]"]
    fresh = status == "stopped"  # this one in a fresh interpreter, as a user starts it, to time its start-up
    before = time.time()
    if fresh:
        out = subprocess.run([sys.executable, "-m", *args], env=launcher_env(), cwd=ROOT, capture_output=True,
                             text=True, timeout=480)
        assert out.returncode == 0, out.stderr[-3000:]
    else:
        run_module(*args)
    run = tmp_path / "stops"
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["max_steps"], summary["stop_reason"]) == \
        (status, 7, 20, reason)
    assert "error" not in summary and summary["resume_step"] == 7
    assert (run / "checkpoints" / "latest").read_text().strip() == "step0000007.ckpt"
    # The loss of step 7 is logged (train/loss every 5 steps), and the summary's is it: Lightning writes a row where
    # a run stops, which repeated step 5's values under step 7 (tokens_seen 2560) when step 7 was not logged.
    rows = read_metrics(run / "metrics.csv")
    assert [r["train/tokens_seen"] for r in rows if r["step"] == 7 and "train/tokens_seen" in r] == [7 * 512]
    assert (summary["final_train_loss_step"], summary["final_train_loss"]) == series(rows, "train/loss")[-1]
    assert summary["final_train_loss_step"] == 7
    if fresh:
        # wall_seconds counts from the command's start (importing torch, Lightning and our code, loading the config:
        # several seconds that train()'s own start left out), less the interpreter's start before it imports
        # lit_pretrain and the moments after wall_seconds is taken (0.5 s allows for them on a loaded machine).
        assert summary["wall_seconds"] >= (run / "summary.json").stat().st_mtime - before - 0.5
