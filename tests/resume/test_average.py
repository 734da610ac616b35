"""`lit-pretrain checkpoint average` (resume/average.py): which checkpoints, the merge's weights, the mean against one
computed by hand; and (slow) a tiny run with callbacks.ema and sharded checkpoints: val/ema_loss in metrics.csv and
summary.json, the average of its last checkpoints, which exports and loads like any checkpoint, never overwritten,
and `export --weights ema`."""

import json

import pytest
import torch

from lit_pretrain import cli, config
from lit_pretrain.errors import DataError
from lit_pretrain.resume.average import average_weights, normalized, select
from lit_pretrain.resume.sharded.save import EMA_KEY
from lit_pretrain.resume.weights import load_gpt, read_checkpoint
from lit_pretrain.runs.folder import read_metrics
from lit_pretrain.train import train
from tests.conftest import EXPERIMENTS, tiny_data_overrides


@pytest.fixture
def steps_folder(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for step in (2, 4, 6):
        (folder / f"step{step:07d}.ckpt").write_bytes(b"")
    (folder / "step0000006").mkdir()  # the same step as a sharded folder too: counted once, as its file
    (folder / "last.ckpt").write_bytes(b"")
    return folder


@pytest.mark.parametrize("last, steps, expected", [(2, None, [4, 6]), (3, None, [2, 4, 6]), (None, [6, 2], [2, 6])])
def test_select(steps_folder, last, steps, expected):
    assert [p.name for p in select(steps_folder, last, steps)] == [f"step{s:07d}.ckpt" for s in expected]


@pytest.mark.parametrize("last, steps, message", [
    (4, None, r"holds 3 step checkpoints \(\[2, 4, 6\]\); give 1 <= K <= 3"),
    (None, [3], r"no checkpoint of step \[3\]"),
    (None, [2, 2], "each step once"),
    (None, None, "give --last K or --steps"),
])
def test_select_refuses(steps_folder, last, steps, message):
    with pytest.raises(DataError, match=message):
        select(steps_folder, last, steps)


def test_normalized():
    assert normalized(None, 4) == [0.25] * 4
    assert normalized([1, 3], 2) == [0.25, 0.75]
    for bad in ([1], [1, -1], [0, 0], [float("nan"), 1]):
        with pytest.raises(DataError, match="give 2 finite weights >= 0"):
            normalized(bad, 2)


def test_average_weights_is_the_mean_rounded_once():
    # 0.1, 0.2, 0.4 are not exact in binary: a float32 running mean would round at every step.
    states = [{"w": torch.full((3,), v, dtype=torch.float32), "n": torch.tensor([7])} for v in (0.1, 0.2, 0.4)]
    out = average_weights(states, normalized(None, 3))
    expected = (torch.tensor(0.1, dtype=torch.float32).double() + torch.tensor(0.2, dtype=torch.float32).double()
                + torch.tensor(0.4, dtype=torch.float32).double()) / 3
    assert out["w"].dtype == torch.float32 and torch.equal(out["w"], torch.full((3,), float(expected)).float())
    assert torch.equal(out["n"], torch.tensor([7]))
    weighted = average_weights(states[:2], normalized([1, 3], 2))
    assert torch.allclose(weighted["w"].double(), torch.full((3,), 0.25 * 0.1 + 0.75 * 0.2, dtype=torch.float64),
                          rtol=0, atol=1e-8)
    states[1]["n"] = torch.tensor([8])
    with pytest.raises(DataError, match="n .* differs between the checkpoints"):
        average_weights(states, normalized(None, 3))


@pytest.mark.slow
def test_run_with_ema_averages_exports_and_never_overwrites(tmp_path, tiny_data_dir, capsys):
    c = config.load(EXPERIMENTS / "runs" / "tiny.yaml", [
        *tiny_data_overrides(tiny_data_dir), f"run.root_dir={tmp_path}", "trainer.progress_bar=false",
        "trainer.max_steps=4", "trainer.checkpoint_every_n_steps=1", "trainer.val_every_n_steps=2",
        "trainer.val_windows=8", "schedule.warmup_steps=1", "checkpoint.format=sharded", "callbacks.ema.enabled=true",
        "callbacks.ema.decay=0.5", "callbacks.ema.start_step=1"])
    train(c)
    run = tmp_path / "tiny"
    rows = [r for r in read_metrics(run / "metrics.csv") if r.get("val/ema_loss") not in (None, "")]
    assert [int(r["step"]) for r in rows] == [2, 4]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_val_ema_loss"] == pytest.approx(float(rows[-1]["val/ema_loss"]), rel=1e-6)
    assert summary["final_val_ema_loss"] != pytest.approx(summary["final_val_loss"], rel=1e-6)

    # The EMA went into the shards of each folder (each rank's share; one process here) and reads back whole.
    newest = read_checkpoint(run, "step0000004")
    ema = load_gpt(run, "step0000004", weights="ema")
    for name, p in ema.named_parameters():
        assert torch.equal(p, newest[EMA_KEY][name]), name

    consolidated = tmp_path / "step4.ckpt"  # `checkpoint consolidate` keeps it
    assert cli.main(["checkpoint", "consolidate", str(run / "checkpoints" / "step0000004"), str(consolidated)]) == 0
    from_file = read_checkpoint(consolidated)[EMA_KEY]
    assert list(from_file) == list(newest[EMA_KEY]) and all(torch.equal(v, newest[EMA_KEY][k])
                                                             for k, v in from_file.items())

    assert cli.main(["checkpoint", "average", str(run), "--last", "3"]) == 0
    out = run / "checkpoints" / "average-step0000002-0000004-k3.ckpt"
    averaged, parts = load_gpt(out), [load_gpt(run, f"step{s:07d}").state_dict() for s in (2, 3, 4)]
    for key, value in averaged.state_dict().items():
        by_hand = (parts[0][key].double() + parts[1][key].double() + parts[2][key].double()) / 3
        # One rounding of the float64 mean to float32 (the sum order in float64 does not reach float32's last bit).
        torch.testing.assert_close(value, by_hand.float(), rtol=1.2e-7, atol=0)
    assert read_checkpoint(out)["lit_pretrain"]["averaged"] == {"steps": [2, 3, 4], "weights": [1 / 3] * 3}
    assert "optimizer_states" not in read_checkpoint(out)

    assert cli.main(["checkpoint", "average", str(run), "--steps", "2,4", "--weights", "1,3", "--out",
                     str(out)]) == 2
    assert f"{out} exists: an existing checkpoint is never overwritten" in capsys.readouterr().err

    # Both export as transformers folders: the average, and the EMA of the newest checkpoint.
    assert cli.main(["export", str(out), "--to", "hf", str(tmp_path / "hf_average")]) == 0
    assert cli.main(["export", str(run), "--to", "hf", "--weights", "ema", str(tmp_path / "hf_ema")]) == 0
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "hf_ema" / "model.safetensors")
    assert torch.equal(exported["model.norm.weight"], newest[EMA_KEY]["norm.weight"])
