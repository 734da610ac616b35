"""End to end: `lit-pretrain train` on a tiny model learns, fills its run folder, and protects it."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from lit_pretrain import cli, config
from lit_pretrain.data.datamodule import TokenShardDataModule
from lit_pretrain.errors import DataError, RunFolderError
from lit_pretrain.resume.weights import load_gpt
from lit_pretrain.runs import table as run_table
from lit_pretrain.runs.folder import read_metrics, series
from lit_pretrain.train import train
from tests.conftest import EXPERIMENTS, tiny_data_overrides

pytestmark = pytest.mark.slow


def tiny_cfg(tmp_path, data_dir, *extra):
    return config.load(EXPERIMENTS / "runs" / "tiny.yaml", [
        *tiny_data_overrides(data_dir), f"run.root_dir={tmp_path / 'runs'}", "trainer.progress_bar=false",
        "trainer.max_steps=60", "trainer.val_every_n_steps=30", "schedule.warmup_steps=5", "optim.lr_peak=3e-3",
        *extra,
    ])


def test_tiny_fit_learns_and_fills_the_run_folder(tmp_path, tiny_data_dir, capsys):
    summary = train(tiny_cfg(tmp_path, tiny_data_dir, "trainer.tokens_per_step=1024",
                             "trainer.checkpoint_every_n_steps=30"))
    out = capsys.readouterr().out
    # trainer.compile=auto, the default, says why this tiny run stays eager.
    assert re.search(r"torch\.compile: off — this run's [0-9.e+]+ training FLOPs a process are under the", out)
    # One line, before the first step, with the plan and the batch it applied.
    plan = [line for line in out.splitlines() if line.startswith("plan: ")]
    assert plan == ["plan: data parallel 1 replicate x 1 shard, context parallel 1, tensor parallel 1, pipeline "
                    "parallel 1, expert parallel 1; micro-batch 8 x seq_len 64 x data-parallel degree 1 x "
                    "accumulation 2 = 1,024 tokens per step"]
    run_dir = tmp_path / "runs" / "tiny"
    on_disk = json.loads((run_dir / "summary.json").read_text())
    for key in ("params", "non_embedding_params", "tokens_seen", "tokens_per_param", "steps", "final_train_loss",
                "final_val_loss", "val_perplexity", "wall_seconds", "tokens_per_second"):
        assert on_disk[key] is not None, key
    # micro-batch 8 × 64 tokens = 512 per micro-step, so tokens_per_step 1024 means 2 micro-batches per step.
    assert on_disk["accumulate_grad_batches"] == 2
    assert on_disk["steps"] == 60 and on_disk["tokens_seen"] == 60 * 1024
    assert on_disk["tokens_per_param"] == pytest.approx(60 * 1024 / on_disk["params"])
    # An untrained model predicts ~uniformly: loss ln(512) = 6.24. 60 steps must beat the unigram entropy of the
    # corpus, i.e. the model uses context, not only token frequencies.
    assert summary["final_val_loss"] < summary["unigram_entropy_nats"] < 6.24
    assert summary["val_perplexity"] == pytest.approx(2.718281828 ** summary["final_val_loss"], rel=1e-6)
    for name in ("config.yaml", "metrics.csv", "loss_curve.png", "summary.json"):
        assert (run_dir / name).is_file(), name
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert "last.ckpt" in checkpoints and "step0000030.ckpt" in checkpoints
    saved = config.load(run_dir / "config.yaml")
    assert saved.model.vocab_size == 512 and saved.trainer.tokens_per_step == 1024

    # The last checkpoint reads back (weights only) into a plain GPT that gives the run's final validation loss.
    model = load_gpt(run_dir)
    datamodule = TokenShardDataModule(config.to_object(saved).data, seq_len=64, micro_batch_size=8, seed=1337,
                                      val_windows=32)
    datamodule.setup()
    losses, tokens = 0.0, 0
    with torch.no_grad():
        for x, y in datamodule.val_dataloader():
            losses += F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
            tokens += y.numel()
    # Same weights, same windows, fp32 both times; only the summation order of the mean differs (~1e-7).
    assert losses / tokens == pytest.approx(summary["final_val_loss"], abs=1e-5)
    last = (run_dir / "checkpoints" / "last.ckpt").read_bytes()
    (run_dir / "checkpoints" / "cut.ckpt").write_bytes(last[: len(last) // 2])
    with pytest.raises(DataError, match=r"checkpoint .*cut\.ckpt has no checksum file cut\.ckpt\.json"):
        load_gpt(run_dir, "cut.ckpt")


def test_existing_run_folder_is_never_overwritten_unless_asked(tmp_path, tiny_data_dir):
    run_dir = tmp_path / "runs" / "tiny"
    (run_dir / "checkpoints").mkdir(parents=True)
    precious = run_dir / "checkpoints" / "last.ckpt"
    precious.write_bytes(b"weeks of training")
    stale = run_dir / "notes-from-the-old-run.txt"
    stale.write_text("left by the previous run")
    (run_dir / "config.yaml").write_text("run:\n  name: tiny\n")  # a run of ours (overwrite deletes only those)
    with pytest.raises(RunFolderError, match=r"run\.resume=auto starts run folder .*tiny again.* already exists.*"
                                             r"run\.overwrite=true"):
        train(tiny_cfg(tmp_path, tiny_data_dir))
    assert precious.read_bytes() == b"weeks of training"
    # 5 steps, validation every 4: the final validation runs after fit, and must not wipe the train loss.
    summary = train(tiny_cfg(tmp_path, tiny_data_dir, "run.overwrite=true", "trainer.max_steps=5",
                             "trainer.val_every_n_steps=4", "trainer.log_every_n_steps=1"))
    assert summary["final_train_loss"] is not None and summary["final_val_loss"] is not None
    # Asked to overwrite, the run starts from an empty folder: nothing of the old run is left to mix in.
    assert not stale.exists()
    assert precious.read_bytes() != b"weeks of training"
    # One step count: 5 optimizer steps completed, validation after step 4 and after step 5 (the final one).
    rows = read_metrics(run_dir / "metrics.csv")
    assert [s for s, _ in series(rows, "train/loss")] == [1, 2, 3, 4, 5]
    assert [s for s, _ in series(rows, "val/loss")] == [4, 5]
    assert (run_dir / "checkpoints" / "step0000005.ckpt").is_file()
    assert (summary["status"], summary["steps"], summary["max_steps"]) == ("finished", 5, 5)

    # An exception inside fit (max_steps raised to 7, resumed; a fault at the start of step 7) leaves the summary
    # `failed` with the error, the steps completed and the checkpoint a resume continues from; `runs` says so.
    with pytest.raises(RuntimeError, match="injected fault at step 6"):
        train(tiny_cfg(tmp_path, tiny_data_dir, "trainer.max_steps=7", "trainer.val_every_n_steps=4",
                       "trainer.log_every_n_steps=1", "run.resume=auto", "run.resume_allow_changes=[trainer.max_steps]",
                       "callbacks.extra=[{class_path: 'tests.helpers.resume_helpers:Raise', init_args: {step: 6}}]"))
    failed = json.loads((run_dir / "summary.json").read_text())
    assert (failed["status"], failed["steps"], failed["max_steps"], failed["resume_step"]) == ("failed", 6, 7, 5)
    assert failed["error"] == "RuntimeError: injected fault at step 6"
    assert run_table.status(run_table.read_run(run_dir)) == "failed, resumes from step 5"
    # The resumed attempt's rows continue the numbering: step 6 once, after the first attempt's 1..5.
    assert [s for s, _ in series(read_metrics(run_dir / "metrics.csv"), "train/loss")] == [1, 2, 3, 4, 5, 6]


def test_stages_continue_the_schedule_or_follow_the_one_they_declare(tmp_path, tiny_data_dir, capsys):
    """docs/resume.md, "Stages": a 6-step cosine run (warmup 1, lr_peak 3e-3, lr_min 1e-4, checkpoints at 3 and 6),
    then two stages in new run folders: extended to 9 steps from its end (the rate stays at lr_min, where a cosine
    recomputed over 9 steps re-warmed to 8.3e-4), and an anneal stage from step 3 to 0 at step 7 (linear from the
    rate step 3 had). Rates compared to 1e-6 relative: self.log stores them as float32 (7 digits)."""
    from lit_pretrain.resume.store import step_file

    def lrs(name):
        return dict(series(read_metrics(tmp_path / "runs" / name / "metrics.csv"), "train/lr"))

    common = ["schedule.warmup_steps=1", "trainer.log_every_n_steps=1", "trainer.val_windows=8"]
    train(tiny_cfg(tmp_path, tiny_data_dir, *common, "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=3"))
    first = lrs("tiny")
    assert first[6] == pytest.approx(1e-4, rel=1e-6) and first[3] > first[4] > first[6]
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    capsys.readouterr()

    extended = train(tiny_cfg(tmp_path, tiny_data_dir, *common, "run.name=extended", "trainer.max_steps=9",
                              f"run.resume={checkpoints / step_file(6)}",
                              "run.resume_allow_changes=[trainer.max_steps]"))
    assert [lrs("extended")[s] for s in (7, 8, 9)] == pytest.approx([first[6]] * 3, rel=1e-6)
    assert (extended["schedule"]["how"], extended["schedule"]["from_step"]) == ("continued", 6)
    assert "schedule: continued from step 6: held from lr 0.0001 (the rate of step 6)" in capsys.readouterr().out

    anneal = train(tiny_cfg(tmp_path, tiny_data_dir, *common, "run.name=anneal", "trainer.max_steps=7",
                            f"run.resume={checkpoints / step_file(3)}", "schedule.stage={kind: linear, lr_min: 0}",
                            "run.resume_allow_changes=[trainer.max_steps, schedule.stage]"))
    rates = lrs("anneal")
    assert [rates[s] for s in (4, 5, 6, 7)] == pytest.approx([first[3] * (1 - i / 4) for i in (1, 2, 3, 4)],
                                                             rel=1e-6, abs=1e-15)
    assert (anneal["schedule"]["how"], anneal["schedule"]["from_step"]) == ("stage", 3)
    assert "schedule: a new stage from step 3: linear from lr" in capsys.readouterr().out


def test_cli_reports_usage_errors_without_a_traceback(tmp_path, tiny_data_dir, capsys):
    code = cli.main(["train", str(EXPERIMENTS / "runs" / "tiny.yaml"), "trainer.max_stepz=3"])
    assert code == 2
    assert "did you mean trainer.max_steps?" in capsys.readouterr().err
    code = cli.main(["train", str(EXPERIMENTS / "runs" / "tiny.yaml"), "data=text", "data.paths=[/no/such/corpus]",
                     f"data.prepared_dir={tmp_path / 'prep'}", f"run.root_dir={tmp_path / 'runs'}"])
    assert code == 2
    assert "/no/such/corpus" in capsys.readouterr().err


def test_tokens_per_step_must_divide(tmp_path, tiny_data_dir):
    from lit_pretrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"trainer\.tokens_per_step=1000 does not split .* = 512 tokens per "):
        train(tiny_cfg(tmp_path, tiny_data_dir, "trainer.tokens_per_step=1000"))


def test_a_full_disk_while_saving_ends_in_one_line_and_keeps_the_newest_checkpoint(tmp_path, tiny_data_dir,
                                                                                    monkeypatch, capsys):
    """ENOSPC while writing the step-2 checkpoint (injected into the atomic writer: no mount
    privileges needed). One line names the file, the bytes needed and free, the newest checkpoint and the fix; exit
    2; `latest` still names step 1, and no temporary or partial file is left."""
    import errno

    from lit_pretrain import atomic
    from lit_pretrain.resume import verified

    class FullAtStep2(atomic.HashingWriter):
        def write(self, data):
            if "step0000002" in self.f.f.name and self.bytes > 4096:  # WriteBehind over the temporary file
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(data)

    monkeypatch.setattr(verified, "HashingWriter", FullAtStep2)
    code = cli.main(["train", str(EXPERIMENTS / "runs" / "tiny.yaml"), *tiny_data_overrides(tiny_data_dir),
                     f"run.root_dir={tmp_path / 'runs'}", "trainer.progress_bar=false", "trainer.max_steps=3",
                     "trainer.val_every_n_steps=3", "schedule.warmup_steps=1", "trainer.checkpoint_every_n_steps=1"])
    err = capsys.readouterr().err
    folder = tmp_path / "runs" / "tiny" / "checkpoints"
    lines = [line for line in err.splitlines() if line.startswith("lit-pretrain train: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert re.fullmatch(
        rf"lit-pretrain train: error: disk full while writing {re.escape(str(folder / 'step0000002.ckpt'))}: it needs "
        r"about [\d,]+ bytes, [\d,]+ bytes are free; the newest complete checkpoint is "
        rf"{re.escape(str(folder / 'step0000001.ckpt'))} \(step 1\): free space, keep fewer checkpoints "
        r"\(run\.keep_last_checkpoints\), or set another run\.root_dir, then resume with run\.resume=auto", lines[0])
    assert (folder / "latest").read_text() == "step0000001.ckpt\n"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "last.ckpt.json", "latest", "step0000001.ckpt",
                                                        "step0000001.ckpt.json"]


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs (room for three of the tiny model's 1.7 MB checkpoints); skipped where mounting is not
    permitted (CI's unprivileged container): the injected test above covers the same path everywhere."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True,
                         text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a 6 MiB tmpfs here ({(out.stderr or out.stdout).strip()}): needs root or "
                    "CAP_SYS_ADMIN; test_a_full_disk_while_saving_... injects the error instead")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_real_full_disk_ends_in_one_line(small_disk, tiny_data_dir, capsys):
    from lit_pretrain.resume import store

    code = cli.main(["train", str(EXPERIMENTS / "runs" / "tiny.yaml"), *tiny_data_overrides(tiny_data_dir),
                     f"run.root_dir={small_disk}", "trainer.progress_bar=false", "trainer.max_steps=6",
                     "trainer.val_every_n_steps=6", "schedule.warmup_steps=1", "trainer.checkpoint_every_n_steps=1",
                     "run.keep_last_checkpoints=0"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("lit-pretrain train: error: disk full")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    folder = small_disk / "tiny" / "checkpoints"
    newest = folder / (folder / "latest").read_text().strip()
    assert store.is_valid(newest) and f"the newest complete checkpoint is {newest} (step" in lines[0]
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
    # No step file newer than `latest` (a torn one, or one without its sidecar).
    assert max(store.step_of(p) for p in store.step_files(folder)) == store.step_of(newest)
