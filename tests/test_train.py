"""End to end: `lit-pretrain train` on a tiny model learns, fills its run folder, and protects it."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from lit_pretrain import cli, config
from lit_pretrain.checkpoints import load_gpt
from lit_pretrain.data.datamodule import TokenShardDataModule
from lit_pretrain.errors import DataError, RunFolderError
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
    assert re.search(r"trainer\.compile: not compiling \(auto: [0-9.e+]+ training FLOPs a process, under", out)
    # One line, before the first step, with the plan and the batch it applied.
    plan = [line for line in out.splitlines() if line.startswith("plan: ")]
    assert plan == ["plan: data parallel 1 replicate x 1 shard, tensor parallel 1, pipeline parallel 1, expert "
                    "parallel 1; micro-batch 8 x seq_len 64 x data-parallel degree 1 x accumulation 2 = 1,024 "
                    "tokens per step"]
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
    with pytest.raises(RunFolderError, match=r"run folder .*tiny already exists.*run\.overwrite=true"):
        train(tiny_cfg(tmp_path, tiny_data_dir))
    assert precious.read_bytes() == b"weeks of training"
    # 5 steps, validation every 4: the final validation runs after fit, and must not wipe the train loss.
    summary = train(tiny_cfg(tmp_path, tiny_data_dir, "run.overwrite=true", "trainer.max_steps=5",
                             "trainer.val_every_n_steps=4", "trainer.log_every_n_steps=1"))
    assert summary["final_train_loss"] is not None and summary["final_val_loss"] is not None
    # Asked to overwrite, the run starts from an empty folder: nothing of the old run is left to mix in.
    assert not stale.exists()
    assert precious.read_bytes() != b"weeks of training"


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
