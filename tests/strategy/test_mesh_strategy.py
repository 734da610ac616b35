"""strategy=tensor and strategy=pipeline train the tiny experiment from config (`lit-pretrain train` in a
subprocess, Lightning's launcher starting the second process) and match one process: per-step losses and gradient
norms with gradient accumulation and active clipping, and the one-file checkpoint read into a single-process GPT
and AdamW. The per-layout parity of every gradient is in tests/parallel/test_mesh_parallel.py; this is the wiring.
"""

import pytest
import torch

from lit_pretrain.module import PretrainModule
from lit_pretrain.resume.weights import checkpoint_path, load_gpt, load_optimizer_state
from lit_pretrain.runs.folder import read_metrics, series
from tests.conftest import run_module, train_args
from tests.helpers.global_sizes import assert_global_sizes

pytestmark = pytest.mark.slow

STEPS = 4
# micro_batch_size 8 × seq_len 64 × 1 data-parallel replica = 512 tokens: 2 micro-batches accumulated per step.
COMMON = [f"trainer.max_steps={STEPS}", f"trainer.val_every_n_steps={STEPS}", "trainer.log_every_n_steps=1",
          "schedule.warmup_steps=2", "optim.grad_clip_norm=0.1", "trainer.tokens_per_step=1024",
          "trainer.progress_bar=false", "strategy.timeout_seconds=60"]
RUNS = {
    "single": [],
    "tensor": ["strategy=tensor", "trainer.devices=2"],
    "pipeline": ["strategy=pipeline", "trainer.devices=2", "strategy.pipeline.schedule=gpipe",
                 "strategy.activation_checkpointing=full"],
}


@pytest.fixture(scope="session")  # built once per worker, whatever the order: tests/helpers/longest_first.py
def runs(tmp_path_factory, tiny_data_dir):
    root = tmp_path_factory.mktemp("mesh_runs")
    for name, overrides in RUNS.items():
        run_module(*train_args(tiny_data_dir, root, name), *COMMON, *overrides)
    return root


def test_tensor_and_pipeline_train_from_config_like_one_process(runs):
    single = read_metrics(runs / "single" / "metrics.csv")
    ref_model, ref_opt = load_gpt(runs / "single"), load_optimizer_state(runs / "single")
    probe = torch.randint(0, ref_model.cfg.vocab_size, (2, ref_model.cfg.seq_len),
                          generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref_logits = ref_model(probe)
    for name in ("tensor", "pipeline"):
        metrics = read_metrics(runs / name / "metrics.csv")
        # Float summation order only (tests/parallel/test_mesh_parallel.py measures each layout): losses ~6 in fp32 have
        # ulps of 4.8e-7; a lost accumulation micro-batch or an unscaled pipeline gradient moves them by >1e-3.
        for key in ("train/loss", "train/grad_norm"):
            a, b = series(single, key), series(metrics, key)
            assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, STEPS + 1)), (name, key)
            for (step, x), (_, y) in zip(a, b):
                assert x == pytest.approx(y, abs=1e-5), f"{name} {key} at step {step}"
        assert [v for _, v in series(metrics, "train/clipped")] == [1.0] * STEPS  # clipping active throughout
        assert_global_sizes(runs / name)  # summary.json and MFU: the whole model's sizes, not a rank's part
        # The checkpoint (a sharded folder, the default on 2 processes) loads into a plain GPT and a plain AdamW.
        model, opt = load_gpt(runs / name), load_optimizer_state(runs / name)
        for (key, p), q in zip(ref_model.state_dict().items(), model.state_dict().values()):
            # Measured ~1e-6 after 4 AdamW steps; 1e-5 is 1% of one step's update (lr 1e-3).
            assert torch.allclose(p, q, rtol=0, atol=1e-5), f"{name}: {key} differs by {(p - q).abs().max():.2e}"
        with torch.no_grad():
            assert (model(probe) - ref_logits).abs().max() < 1e-4, name
        # Lightning's own load of the same file: the module from its saved hyperparameters, the same weights.
        module = PretrainModule.load_from_checkpoint(checkpoint_path(runs / name))  # a sharded folder on 2 processes
        assert module.strategy_cfg.name == name and module.model_cfg == model.cfg
        for key, p in model.state_dict().items():
            assert torch.equal(module.model.state_dict()[key], p), f"{name}: {key}"
        ref_params = [p for g in ref_opt.param_groups for p in g["params"]]
        got_params = [p for g in opt.param_groups for p in g["params"]]
        assert len(opt.state) == len(ref_opt.state) == len(ref_params)
        for p_ref, p_got in zip(ref_params, got_params):
            assert opt.state[p_got]["step"].item() == STEPS
            assert torch.allclose(opt.state[p_got]["exp_avg"], ref_opt.state[p_ref]["exp_avg"], rtol=0, atol=1e-8)
    idle = series(read_metrics(runs / "pipeline" / "metrics.csv"), "pipeline/idle_fraction")
    bubble = series(read_metrics(runs / "pipeline" / "metrics.csv"), "pipeline/bubble_formula")
    assert len(idle) == STEPS and all(0.0 < v < 1.0 for _, v in idle)
    assert [v for _, v in bubble] == [pytest.approx(1 / 5)] * STEPS  # p=2, m=4: (p-1)/(m+p-1)


def mesh_resume(out, devices, name, t, p, steps, ckpt=None, *overrides):
    """tests/helpers/mesh_resume.py in a subprocess; the checkpoint it wrote to `out`."""
    run_module("tests.helpers.mesh_resume", str(out), str(devices), name, str(t), str(p), str(steps),
               *([str(ckpt)] if ckpt else []), *overrides)
    return torch.load(out, map_location="cpu", weights_only=True)


def test_checkpoint_resumes_in_another_layout(tmp_path):
    """3 steps in one process against 2 steps under TP 2 resumed for the third under PP 2: the TP checkpoint (weights
    and AdamW state) is sliced into the pipeline layout on load."""
    single = mesh_resume(tmp_path / "single.ckpt", 1, "single", 1, 1, 3)
    mesh_resume(tmp_path / "tp.ckpt", 2, "tensor", 2, 1, 2)
    resumed = mesh_resume(tmp_path / "pp.ckpt", 2, "pipeline", 1, 2, 3, tmp_path / "tp.ckpt")
    assert resumed["global_step"] == single["global_step"] == 3
    a, b = single["state_dict"], resumed["state_dict"]
    assert list(a) == list(b)
    for key in a:
        # Float summation order only (see test_mesh_parallel.py); a missing or zeroed AdamW state at the resume
        # would change the third update by about lr (1e-3), far above 1e-5.
        assert torch.allclose(a[key], b[key], rtol=0, atol=1e-5), f"{key} differs by {(a[key] - b[key]).abs().max()}"
    sa, sb = single["optimizer_states"][0], resumed["optimizer_states"][0]
    assert sa["param_groups"][0]["lr"] == pytest.approx(sb["param_groups"][0]["lr"])  # the schedule resumed too
    for i, s in sa["state"].items():
        assert sb["state"][i]["step"].item() == s["step"].item() == 3
        assert torch.allclose(sb["state"][i]["exp_avg"], s["exp_avg"], rtol=0, atol=1e-8)


def test_muon_checkpoint_resumes_under_tensor_parallelism(tmp_path):
    """Muon's momentum under TP 2 through a one-file checkpoint and back: bitwise the uninterrupted run. (Apart from
    the test above, which it shares nothing with, so that xdist runs the two side by side.)"""
    # optim.name=muon (Muon for the hidden matrices, AdamW for the rest) under TP 2, where each matrix is gathered
    # for its Newton-Schulz step and the momentum is sliced like its matrix: 3 steps uninterrupted, saving after
    # step 2 (the one-file checkpoint: momentum gathered to single-process names), against a fresh module and
    # optimizer resumed from that file (sliced again) for the third: weights and both states bitwise.
    single = mesh_resume(tmp_path / "muon.ckpt", 2, "tensor", 2, 1, 3, "-", "optim.name=muon",
                         "optim.lr_peak=0.01", "save_at=2")
    resumed = torch.load(tmp_path / "muon.ckpt.resumed", map_location="cpu", weights_only=True)
    assert resumed["global_step"] == single["global_step"] == 3
    for key, value in single["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][key]), key
    sa, sb = single["optimizer_states"][0], resumed["optimizer_states"][0]
    assert any(g.get("use_muon") for g in sa["param_groups"]) and sa["param_groups"] == sb["param_groups"]
    assert {k for s in sa["state"].values() for k in s} == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    for i, s in sa["state"].items():
        assert s.keys() == sb["state"][i].keys() and all(torch.equal(v, sb["state"][i][k]) for k, v in s.items())
