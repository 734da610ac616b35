"""`lit-pretrain fit | plan | memory` from the command line, and the sweep's planning and machinery."""

import json

import pytest

from lit_pretrain.cli import main
from lit_pretrain.errors import ConfigError
from lit_pretrain.planning import laws
from lit_pretrain.scaling import sweep
from tests.conftest import EXPERIMENTS, tiny_data_overrides

SWEEP_FILE = EXPERIMENTS / "sweep" / "cpu" / "sweep.yaml"


def test_plan_json(capsys):
    assert main(["plan", "--flops", "5.76e23", "--law", "chinchilla-approach3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    n, d = laws.CHINCHILLA_APPROACH3.compute_optimal(5.76e23)
    assert out["law"] == "chinchilla-approach3" and out["params"] == pytest.approx(n)
    assert out["tokens_per_param"] == pytest.approx(d / n)
    assert out["predicted_loss"] == pytest.approx(laws.CHINCHILLA_APPROACH3.loss(n, d))
    assert {"n_layers", "d_model", "n_heads"} <= set(out["shape"]) and out["steps"] > 0


def test_plan_table_and_errors(capsys):
    assert main(["plan", "--params", "70B", "--law", "chinchilla"]) == 0
    table = capsys.readouterr().out
    assert "tokens_per_param" in table and "n/a (the law gives no loss)" in table
    assert main(["plan", "--flops", "1e21", "--law", "nonsense"]) == 2
    assert "neither a published law" in capsys.readouterr().err


def test_memory_json_by_shape(capsys):
    argv = ["memory", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "512", "--seq-len", "64",
            "--micro-batch", "8", "--data-parallel", "2", "--zero-stage", "3", "--precision", "32-true", "--exact",
            "--device-memory", "1MB", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes", "activation_bytes_per_layer",
                "activation_bytes", "total_bytes", "fits"):
        assert key in out
    assert out["fits"] is False
    assert out["model_state_bytes"] == out["param_bytes"] + out["grad_bytes"] + out["optimizer_bytes"]


def test_memory_errors(capsys):
    assert main(["memory", "--layers", "2", "--hidden", "64"]) == 2
    assert "--layers, --hidden and --heads" in capsys.readouterr().err
    assert main(["memory", "--layers", "2", "--hidden", "64", "--heads", "3"]) == 2
    assert "--hidden" in capsys.readouterr().err


def test_shipped_sweep_plans_an_isoflop_grid():
    cfg = sweep.load_sweep(SWEEP_FILE)
    model, tokens_per_step = sweep._base_model(cfg)
    grid = sweep.plan_grid(cfg, model, tokens_per_step)
    assert len({r["budget_flops"] for r in grid}) >= 3 and len(grid) >= 9
    for run in grid:
        # steps = budget / (flops_per_token × tokens per step), rounded: within half a step of the budget
        assert abs(run["steps"] * run["flops_per_token"] * tokens_per_step - run["budget_flops"]) <= (
            0.5 * run["flops_per_token"] * tokens_per_step)
        assert run["steps"] >= cfg.min_steps
    held = sweep.plan_run(model, cfg.held_out, cfg.held_out.flops, tokens_per_step, 0.1, "heldout")
    assert held["params"] > max(r["params"] for r in grid)


def test_sweep_file_errors(tmp_path):
    bad = tmp_path / "sweep.yaml"
    bad.write_text("run_file: x\nroot_dir: y\nbudgets_flops: [1e+12]\nmodels: []\nheld_out: {n_layers: 1, "
                   "d_model: 8, n_heads: 1, flops: 1e+11}\n")
    with pytest.raises(ConfigError, match="held_out.flops"):
        sweep.load_sweep(bad)
    bad.write_text("run_file: x\nroot_dir: y\nbudget_flops: [1e+12]\n")
    with pytest.raises(ConfigError, match="unknown keys \\['budget_flops'\\]"):
        sweep.load_sweep(bad)


@pytest.mark.slow
def test_sweep_trains_fits_predicts_and_reports(tmp_path, tiny_data_dir, coarse_fit_grid):
    # The whole machinery on the tiny corpus: 5 grid runs of 6-30 steps, the fit, the written prediction, the held-out
    # run and report.json. Losses this short say nothing about scaling; the test checks the pipeline, not the error.
    run_file = tmp_path / "run.yaml"
    overrides = "\n".join(f"  {o.split('=')[0].split('.')[1]}: {o.split('=')[1]}" for o in tiny_data_overrides(
        tiny_data_dir) if o.startswith("data."))  # the trainer section below sets its own micro-batch
    run_file.write_text(f"defaults: [base, {{model: tiny}}, {{data: stdlib}}, {{strategy: single}}]\n"
                        f"data:\n{overrides}\ntrainer:\n  micro_batch_size: 4\n  val_windows: 8\n"
                        f"  val_every_n_steps: 100000\n  checkpoint_every_n_steps: 0\n  progress_bar: false\n"
                        f"  num_threads: 1\n")
    (tmp_path / "base.yaml").write_text((EXPERIMENTS / "base.yaml").read_text())
    for group in ("model", "data", "strategy"):
        (tmp_path / group).mkdir()
    (tmp_path / "model" / "tiny.yaml").write_text((EXPERIMENTS / "model" / "tiny.yaml").read_text())
    (tmp_path / "data" / "stdlib.yaml").write_text((EXPERIMENTS / "data" / "stdlib.yaml").read_text())
    (tmp_path / "strategy" / "single.yaml").write_text((EXPERIMENTS / "strategy" / "single.yaml").read_text())
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(
        f"run_file: {run_file}\nroot_dir: {tmp_path / 'runs'}\nbudgets_flops: [2.0e+9, 4.0e+9]\n"
        "models:\n  - {n_layers: 1, d_model: 16, n_heads: 2}\n  - {n_layers: 1, d_model: 32, n_heads: 2}\n"
        "  - {n_layers: 2, d_model: 32, n_heads: 2}\n"
        "min_steps: 5\nmax_tokens_per_param: 1000\nwarmup_fraction: 0.1\nbootstrap: 3\n"
        "held_out: {n_layers: 2, d_model: 48, n_heads: 2, flops: 8.0e+9}\n")
    report = sweep.run_sweep(str(sweep_file), log=lambda *_: None)
    root = tmp_path / "runs"
    prediction = json.loads((root / "prediction.json").read_text())
    assert report["predicted_loss"] == prediction["predicted_loss"]
    assert report["actual_loss"] == json.loads((root / "heldout_L2_d48" / "summary.json").read_text())[
        "final_val_loss"]
    assert report["relative_error"] == pytest.approx((report["predicted_loss"] - report["actual_loss"]) /
                                                     report["actual_loss"])
    assert (root / "law.json").is_file() and (root / "plots" / "isoflop.png").is_file()
    # a second call reuses every finished run and the first prediction instead of training or predicting again
    again = sweep.run_sweep(str(sweep_file), log=lambda *_: None)
    assert again["predicted_loss"] == report["predicted_loss"] and again["actual_loss"] == report["actual_loss"]


def test_sweep_prediction_is_the_ladders_prediction():
    """The sweep's held-out prediction (sweep._predict) and the ladder's (ladder_report.predict) are one function:
    the same loss and the same interpolated 90% percentile interval of the bootstrap laws."""
    import numpy as np

    base = laws.CHINCHILLA_APPROACH3
    samples = [dict(base.to_dict(), E=base.E + 0.01 * i) for i in range(11)]  # E = 1.69 .. 1.79
    law = {"chinchilla": {**base.to_dict(), "bootstrap_samples": samples}}
    out = sweep._predict(law, {"name": "held", "params": 1e8, "tokens": 2e9})
    assert out["predicted_loss"] == base.loss(1e8, 2e9)
    losses = [laws.ParametricLaw.from_dict(s).loss(1e8, 2e9) for s in samples]  # each loss + 0.01 i: E shifts it
    assert out["predicted_loss_interval"] == pytest.approx([np.percentile(losses, 5), np.percentile(losses, 95)])
    assert out["predicted_loss_interval"] == pytest.approx([base.loss(1e8, 2e9) + 0.005,
                                                            base.loss(1e8, 2e9) + 0.095])
