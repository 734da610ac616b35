"""Stability callbacks in tiny training runs: injected loss spikes (a poisoned batch, a one-step learning-rate jump),
non-finite losses and gradients, a clean run, and the default experiment's callbacks end to end."""

import json

import lightning as L
import pytest
import torch

from lit_pretrain import config
from lit_pretrain.callbacks.loss_spike import LossSpike
from lit_pretrain.callbacks.nan_guard import NanGuard
from lit_pretrain.data.datamodule import TokenShardDataModule
from lit_pretrain.module import PretrainModule
from lit_pretrain.resume.weights import load_gpt
from lit_pretrain.runs import table as run_table
from lit_pretrain.runs.folder import read_metrics, series
from lit_pretrain.train import resolve_vocab, train
from tests.conftest import EXPERIMENTS, tiny_data_overrides
from tests.helpers.stability_helpers import LrJump, NonFinite, PoisonBatch, Recorder

pytestmark = pytest.mark.slow


def fit(tmp_path, data_dir, callbacks, max_steps, accumulate=1):
    """A tiny model on the tiny corpus, as `lit-pretrain train` builds it, without loggers or checkpoints."""
    c = config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", [
        *tiny_data_overrides(data_dir), f"trainer.max_steps={max_steps}", "schedule.warmup_steps=5",
        "optim.lr_peak=3e-3"]))
    dm = TokenShardDataModule(c.data, seq_len=c.model.seq_len, micro_batch_size=8, seed=c.run.seed, val_windows=8)
    dm.prepare_data()
    c = resolve_vocab(c, dm.manifest["tokenizer"]["vocab_size"])
    module = PretrainModule(c.model, c.optim, c.schedule, max_steps=max_steps, tokens_per_step=512 * accumulate,
                            seed=c.run.seed)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accumulate,
                        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, default_root_dir=str(tmp_path),
                        use_distributed_sampler=False)
    trainer.fit(module, datamodule=dm)
    return trainer, dm


def spike(**kw):
    args = dict(window=10, watch_steps=10, rewind_every_n_steps=4, rewind_steps=4, skip_batches=3, recovery_steps=6)
    return LossSpike(**{**args, **kw})


def same_optimizer_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        for name in a[k]:
            va, vb = a[k][name], b[k][name]
            assert torch.equal(va, vb) if torch.is_tensor(va) else va == vb, (k, name)


def test_skip_step_drops_exactly_the_poisoned_update_and_labels_it_recovered(tmp_path, tiny_data_dir):
    rec = Recorder(snapshot_steps=[20, 21])
    cb = spike(action="skip_step")
    fit(tmp_path, tiny_data_dir, [cb, PoisonBatch([20]), rec], max_steps=28)
    (event,) = cb.events
    # The poisoned batch is the one trained after 20 steps: step 21, as metrics.csv numbers its loss.
    assert event["step"] == 21 and event["action"] == "skip_step" and event["outcome"] == "recovered"
    assert event["sample_indices"] == sorted(rec.indices[20])  # the windows of the poisoned batch, for inspection
    # The update of step 20 was not applied: step 21 starts from exactly the state step 20 started from.
    for k, v in rec.params[20].items():
        assert torch.equal(v, rec.params[21][k]), k
    same_optimizer_state(rec.opt_state[20], rec.opt_state[21])
    assert json.loads((tmp_path / "spikes.json").read_text())[0]["step"] == 21


@pytest.mark.parametrize("accumulate", [1, 2])
def test_rewind_restores_the_rewind_point_and_skips_exactly_the_configured_batches(tmp_path, tiny_data_dir,
                                                                                    accumulate):
    rec = Recorder(snapshot_steps=[16, 21])
    cb = spike(action="rewind")
    trainer, dm = fit(tmp_path, tiny_data_dir, [cb, PoisonBatch([20]), rec], max_steps=26, accumulate=accumulate)
    (event,) = cb.events
    # Rewind points every 4 steps; the newest at least rewind_steps=4 before the poisoned step (21; its update dropped,
    # so 20 updates done) is the state after step 16: the updates of steps 17..20 are thrown away.
    assert event["step"] == 21 and event["rewound_to"] == 16 and event["steps_rewound"] == 4
    for k, v in rec.params[16].items():
        assert torch.equal(v, rec.params[21][k]), k  # weights equal the rewind point's
    same_optimizer_state(rec.opt_state[16], rec.opt_state[21])
    # Data: steps 0..20 trained on the first 21 global batches; the next 3 (skip_batches) were dropped; step 21 on
    # trains on the global order from there. One global batch is accumulate × 8 windows.
    per_step = 8 * accumulate
    order = dm.train_sampler.global_order(0).tolist()
    assert event["skipped_data"] == [{"epoch": 0, "micro_batches": 3 * accumulate,
                                      "global_positions": [21 * per_step, 24 * per_step]}]
    for step in range(26):
        start = step if step <= 20 else step + 3
        assert rec.indices[step] == order[start * per_step:(start + 1) * per_step], step
    assert event["outcome"] == "recovered"


def train_run(tmp_path, data_dir, name, *overrides, extra_callbacks=()):
    """`lit-pretrain train` of the tiny experiment in this process, as fit() above sets it up (lr 3e-3, warmup 5),
    with every step's loss logged; returns the summary and the run folder."""
    cfg = config.load(EXPERIMENTS / "runs" / "tiny.yaml", [
        *tiny_data_overrides(data_dir), f"run.root_dir={tmp_path}", f"run.name={name}", "trainer.progress_bar=false",
        "schedule.warmup_steps=5", "optim.lr_peak=3e-3", "trainer.log_every_n_steps=1", *overrides])
    return train(cfg, extra_callbacks=extra_callbacks), tmp_path / name


def test_learning_rate_jump_diverges_and_leaves_its_last_healthy_checkpoint_as_latest(tmp_path, tiny_data_dir, capsys):
    """One update at 1000× the learning rate: the loss of the next step jumps (measured here: 5.2 → 47) and stays
    up, so the event is a divergence, and on_divergence=stop ends the run `diverged`. Its weights from the bad update
    on are never `latest`: the checkpoints after the last healthy state are set aside, none is written at the stop."""
    summary, run = train_run(tmp_path, tiny_data_dir, "jump", "trainer.max_steps=40", "trainer.val_every_n_steps=40",
                             "trainer.checkpoint_every_n_steps=5", "callbacks.loss_spike.action=log",
                             "callbacks.loss_spike.window=10", "callbacks.loss_spike.watch_steps=10",
                             "callbacks.loss_spike.recovery_steps=6", "callbacks.loss_spike.on_divergence=stop",
                             extra_callbacks=[LrJump([20], factor=1000.0)])
    (event,) = json.loads((run / "spikes.json").read_text())
    assert event["step"] == 22  # the update of step 21 (after 20 done) is the bad one; the loss of step 22 shows it
    # The label follows its definition, checked here from the logged losses: recovered iff a later step within
    # recovery_steps has a loss <= baseline × (1 + tolerance) (one process: its baseline is the event's).
    loss = dict(series(read_metrics(run / "metrics.csv"), "train/loss"))
    later = [loss[s] for s in range(23, 23 + 6)]
    expected = "recovered" if any(v <= event["baseline"] * 1.05 for v in later) else "divergence"
    assert event["outcome"] == expected == "divergence" and event["resolved_step"] == 28
    # The state after step 20 is the newest whose own loss (step 21's) was normal: step 20's checkpoint is `latest`
    # (and last.ckpt, which load_gpt reads); step 25's, written after the bad update, is set aside; none at step 28.
    assert (summary["status"], summary["steps"], summary["resume_step"]) == ("diverged", 28, 20)
    assert "divergence of the event at step 22" in summary["stop_reason"]
    assert summary["stop_reason"].endswith("the last healthy checkpoint is checkpoints/step0000020.ckpt (step 20), "
                                           "which `latest` names and run.resume=auto continues from")
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step0000020.ckpt"
    assert (ckpts / "last.ckpt").samefile(ckpts / "step0000020.ckpt")
    assert sorted(p.name for p in ckpts.glob("step*")) == [
        *(f"step{s:07d}.ckpt{sidecar}" for s in (5, 10, 15, 20) for sidecar in ("", ".json")),
        "step0000025.ckpt.diverged", "step0000025.ckpt.diverged.json"]
    assert run_table.status(run_table.read_run(run)) == "diverged, resumes from step 20"
    assert f"diverged: {summary['stop_reason']}" in capsys.readouterr().out


def test_an_update_that_makes_the_weights_nan_is_never_checkpointed_and_the_guard_says_so(tmp_path, tiny_data_dir,
                                                                                           capsys):
    """An infinite learning rate for one update (what optim.lr_peak=inf did before the config refused it) makes the
    weights NaN while its own loss and gradient were finite: the guard drops the NaN steps after it and stops the run
    `diverged`, saying the parameters are not finite; no checkpoint of them is written, `latest` stays finite."""
    summary, run = train_run(tmp_path, tiny_data_dir, "nan", "trainer.max_steps=12", "trainer.val_every_n_steps=12",
                             "trainer.checkpoint_every_n_steps=3", "callbacks.nan_guard.max_consecutive=2",
                             extra_callbacks=[LrJump([5], factor=float("inf"))])
    out = capsys.readouterr().out
    # The update of step 6 made the weights NaN: step 6's periodic checkpoint is refused; steps 7 and 8 are dropped.
    assert "checkpoint of step 6 not written: a parameter is NaN or infinite; `latest` stays at step 3" in out
    assert (summary["status"], summary["steps"], summary["resume_step"]) == ("diverged", 8, 3)
    reason = summary["stop_reason"]
    assert "(steps 7..8)" in reason and "the parameters are not finite: an update applied before step 7" in reason
    assert "so the parameters are finite" not in reason
    assert reason.endswith("the last healthy checkpoint is checkpoints/step0000003.ckpt (step 3), which `latest` "
                           "names and run.resume=auto continues from")
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step*.ckpt")) == ["step0000003.ckpt"]
    assert all(torch.isfinite(p).all() for p in load_gpt(run).parameters())  # what last.ckpt holds


def test_clean_run_has_no_events(tmp_path, tiny_data_dir):
    """300 steps with the default experiment's detector settings: no false alarm."""
    d = config.to_object(config.load(EXPERIMENTS / "runs" / "default.yaml")).callbacks.loss_spike
    cb = LossSpike(window=d.window, watch_steps=d.watch_steps, threshold_sigmas=d.threshold_sigmas,
                   threshold_ratio=d.threshold_ratio, action="log")
    fit(tmp_path, tiny_data_dir, [cb], max_steps=300)
    assert cb.events == [] and cb.detector.steps_seen == 300


def test_non_finite_updates_never_reach_the_parameters_and_repeated_ones_stop_the_run(tmp_path, tiny_data_dir):
    rec = Recorder(snapshot_steps=[12, 14])
    guard = NanGuard(max_consecutive=3)
    trainer, _ = fit(tmp_path, tiny_data_dir, [guard, NonFinite([12, 13], "grad"), NonFinite([20], "loss"),
                                               NonFinite(range(30, 40), "loss"), rec], max_steps=50)
    assert rec.finite  # parameters were finite at the start of every step
    for k, v in rec.params[12].items():
        assert torch.equal(v, rec.params[14][k]), k
    same_optimizer_state(rec.opt_state[12], rec.opt_state[14])
    # Faults after 12, 13 (gradient), 20 (loss), then 30, 31, 32 steps done: steps 13, 14, 21, 31, 32, 33 as
    # metrics.csv numbers them; three in a row stops the run after step 33.
    assert guard.skipped_steps == [13, 14, 21, 31, 32, 33]
    assert trainer.global_step == 33 and "steps 31..33" in guard.stop_reason


def test_default_experiment_callbacks_end_to_end(tmp_path, tiny_data_dir, capsys):
    """The default experiment's stability settings on the tiny model, with the example user callback: the report
    is printed and written, the monitors log, and the example callback runs."""
    cfg = config.load(EXPERIMENTS / "runs" / "update_ratio.yaml", [
        *tiny_data_overrides(tiny_data_dir), f"run.root_dir={tmp_path}", "trainer.progress_bar=false",
        "trainer.max_steps=20", "trainer.val_every_n_steps=20", "schedule.warmup_steps=5",
        "callbacks.loss_spike.action=rewind", "callbacks.gradient_norm.per_layer_every_n_steps=10"])
    train(cfg)
    run = tmp_path / "update_ratio"
    out = capsys.readouterr().out
    assert "stability report" in out and "throughput" in out
    report = json.loads((run / "stability.json").read_text())
    assert report["loss_spikes"]["events"] == 0 and report["updates_skipped"] == 0
    assert report["gradient_norm"]["by_phase"]["warmup"]["steps"] == 5
    assert report["throughput"]["tokens_per_s"] > 0 and 0 < report["throughput"]["mfu"] < 1
    assert json.loads((run / "spikes.json").read_text()) == []
    header = (run / "metrics.csv").read_text().splitlines()[0]
    for key in ("grad_norm/mean", "grad_norm/clip_rate", "grad_norm/layer/blocks.0", "throughput/tokens_per_s",
                "throughput/mfu", "update_ratio"):
        assert key in header, key
    # The example callback's rows are numbered like every other: steps completed, 5, 10, 15, 20 (on main 0, 5, 10,
    # 15: the step each update started from, one behind the loss logged with it).
    assert [s for s, _ in series(read_metrics(run / "metrics.csv"), "update_ratio")] == [5, 10, 15, 20]
