"""Stability callbacks, the parts that need no training run: robust statistics, the spike rule, schedule phases,
the data loader's drops, the GPU peak table, config errors, and every callback's state round trip."""

import math
import random

import pytest
import torch

from lit_pretrain import config
from lit_pretrain.callbacks import stability_callbacks
from lit_pretrain.callbacks.gradient_norm import GradientNormMonitor, layer_of, lr_phase, trend_summary
from lit_pretrain.callbacks.loss_spike import LossSpike
from lit_pretrain.callbacks.nan_guard import NanGuard
from lit_pretrain.callbacks.spike_stats import SpikeDetector, is_spike, median, robust_std, spike_score
from lit_pretrain.callbacks.throughput import ThroughputMonitor, gpu_peak_flops
from lit_pretrain.data.datamodule import GlobalOrderSampler
from lit_pretrain.data.train_loader import TrainLoader
from lit_pretrain.errors import ConfigError
from lit_pretrain.optim.schedule import lr_at
from tests.conftest import EXPERIMENTS


@pytest.mark.parametrize("values, med, std", [
    # MAD = median |x - median|; × 1.4826 = 1 / Φ⁻¹(3/4), the normal-consistency constant (Rousseeuw & Croux 1993).
    ([1, 2, 3, 4, 100], 3, 1.4826 * 1),          # deviations 2,1,0,1,97 → MAD 1: the outlier does not count
    ([2, 4, 4, 4, 5, 5, 7, 9], 4.5, 1.4826 * 0.5),  # deviations sorted .5 ×5, 2.5, 2.5, 4.5 → MAD 0.5
    ([5, 5, 5, 5, 5], 5, 0.0),
])
def test_median_and_robust_std_table(values, med, std):
    assert median(values) == med
    assert robust_std(values) == pytest.approx(std)


def test_spike_rule():
    assert spike_score(7.0, 4.0, 0.5) == pytest.approx(6.0)
    assert spike_score(float("nan"), 4.0, 0.5) == math.inf
    assert spike_score(4.1, 4.0, 0.0) > 1e9  # identical window values: any rise is infinitely many spreads
    assert not is_spike(7.0, 4.0, 0.5, sigmas=6.0, ratio=None)  # exactly 6 spreads is not more than 6
    assert is_spike(7.01, 4.0, 0.5, sigmas=6.0, ratio=None)
    assert not is_spike(7.01, 4.0, 0.5, sigmas=6.0, ratio=2.0)  # both set: both must hold (7.01 < 2 × 4)
    assert is_spike(8.1, 4.0, 0.5, sigmas=6.0, ratio=2.0)
    assert is_spike(float("inf"), 4.0, 0.5, sigmas=None, ratio=2.0)


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd", "constant"])
def test_lr_phase_matches_the_schedule(kind):
    """warmup while lr_at ramps; decay exactly where lr_at starts to fall below lr_peak; stable in between."""
    kw = dict(kind=kind, warmup_steps=10, max_steps=100)
    for step in range(100):
        lr = lr_at(step, lr_peak=1.0, lr_min=0.1, decay_fraction=0.2, **kw)
        expected = "warmup" if step < 10 else ("decay" if lr < 1.0 else "stable")
        assert lr_phase(step, kind, 10, 100, 0.2) == expected, step


def test_layer_names_and_trend():
    assert layer_of("model.blocks.3.attn.wq.weight") == "blocks.3"
    assert layer_of("model.tok_embeddings.weight") == "tok_embeddings"
    # norm = exp(-0.002 · step) → log-slope -2 per 1,000 steps, exactly, on the second half.
    trend = [[s, math.exp(-0.002 * s)] for s in range(0, 1000, 10)]
    assert trend_summary(trend)["log_slope_per_1k_steps"] == pytest.approx(-2.0, rel=1e-9)


def noisy_losses(n, seed=0, level=4.0):
    rng = random.Random(seed)
    return [level + rng.gauss(0, 0.05) for _ in range(n)]


def run_detector(detector, losses):
    decisions = []
    for loss in losses:
        verdict = detector.check(loss)
        decisions.append((verdict.hit, round(verdict.score, 9)))
        detector.commit(loss, None, accept=not verdict.hit)
    return decisions


def test_detector_finds_the_spike_and_a_reloaded_detector_decides_the_same():
    losses = noisy_losses(120)
    losses[70], losses[100] = 6.0, 9.0
    whole = run_detector(SpikeDetector(window=20, watch_steps=10, sigmas=6.0, ratio=None), losses)
    assert [i for i, (hit, _) in enumerate(whole) if hit] == [70, 100]
    first = SpikeDetector(window=20, watch_steps=10, sigmas=6.0, ratio=None)
    run_detector(first, losses[:85])
    second = SpikeDetector(window=20, watch_steps=10, sigmas=6.0, ratio=None)
    second.load_state_dict(first.state_dict())
    assert run_detector(second, losses[85:]) == whole[85:]


def test_detector_only_watches_at_first():
    losses = noisy_losses(30)
    losses[8] = 50.0
    assert not any(hit for hit, _ in run_detector(SpikeDetector(20, 10, 6.0, None), losses[:10]))


def loader(rank, world, n=64, b=2):
    sampler = GlobalOrderSampler(n, b, rank, world, seed=3)
    return TrainLoader(torch.arange(n), sampler, batch_size=b)


@pytest.mark.parametrize("world", [1, 2])
def test_train_loader_drops_one_contiguous_range_of_the_global_order(world):
    loaders = [loader(r, world) for r in range(world)]
    streams = [iter(ld) for ld in loaders]
    trained = []
    for step in range(8):
        if step == 3:
            for ld in loaders:
                ld.drop(2)  # every rank drops its next 2 micro-batches
        for ld, it in zip(loaders, streams):
            batch = next(it)
            assert batch.tolist() == ld.take_trained_indices()  # recorded indices are the batch's own
            trained.extend(batch.tolist())
    order = loaders[0].sampler.global_order(0).tolist()
    per_step = 2 * world
    assert loaders[0].dropped == [{"epoch": 0, "micro_batches": 2, "global_positions": [3 * per_step, 5 * per_step]}]
    expected = order[: 3 * per_step] + order[5 * per_step : 10 * per_step]
    assert sorted(trained) == sorted(expected)


def test_gpu_peak_table():
    # Dense datasheet figures; the longest matching name wins.
    assert gpu_peak_flops("NVIDIA H100 PCIe", "bf16-mixed") == 756e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "bf16-mixed") == 312e12
    assert gpu_peak_flops("NVIDIA A10G", "16-mixed") == 125e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", "32-true") in (19.5e12, 156e12)  # fp32 or tf32, by torch setting
    assert gpu_peak_flops("Some Future GPU", "bf16-mixed") is None


def test_config_errors_name_the_key():
    run = EXPERIMENTS / "runs" / "tiny.yaml"
    with pytest.raises(ConfigError, match=r"callbacks\.loss_spike\.action"):
        config.load(run, ["callbacks.loss_spike.action=explode"])
    with pytest.raises(ConfigError, match=r"callbacks\.loss_spike\.windw.*did you mean callbacks\.loss_spike\.window"):
        config.load(run, ["callbacks.loss_spike.windw=10"])
    # Refused at load (so `show` refuses it too), and by the callback for a config built without load.
    with pytest.raises(ConfigError, match=r"callbacks\.loss_spike: set threshold_sigmas, threshold_ratio or both"):
        config.load(run, ["callbacks.loss_spike.threshold_sigmas=null"])
    c = config.load(run)
    c.callbacks.loss_spike.threshold_sigmas = None
    with pytest.raises(ConfigError, match=r"callbacks\.loss_spike: set threshold_sigmas, threshold_ratio or both"):
        stability_callbacks(c)


def test_default_experiment_turns_every_stability_callback_on():
    c = config.to_object(config.load(EXPERIMENTS / "runs" / "default.yaml"))
    kinds = [type(cb).__name__ for cb in stability_callbacks(c)]
    assert kinds == ["NanGuard", "LossSpike", "GradientNormMonitor", "ThroughputMonitor", "StabilityReport"]
    assert c.callbacks.loss_spike.action == "rewind"


def test_state_round_trips():
    spike = LossSpike(window=10, watch_steps=5)
    for loss in noisy_losses(12):
        spike.detector.commit(loss, None, accept=True)
    spike.events.append({"step": 9, "loss": 7.0, "outcome": "recovered"})
    spike.rewinds, spike.lr_scale_until = 1, 30
    again = LossSpike(window=10, watch_steps=5)
    again.load_state_dict(spike.state_dict())
    assert again.state_dict() == spike.state_dict()
    assert again.detector.check(4.9).hit == spike.detector.check(4.9).hit is True

    guard = NanGuard(max_consecutive=3)
    guard.consecutive, guard.skipped_steps = 2, [7, 8]
    reloaded = NanGuard(max_consecutive=3)
    reloaded.load_state_dict(guard.state_dict())
    assert reloaded.state_dict() == guard.state_dict()

    grads = GradientNormMonitor(clip_norm=1.0)
    grads.phases["warmup"].update(steps=4, clipped=1, norm_sum=3.0)
    grads.trend = [[3, 0.75]]
    g2 = GradientNormMonitor(clip_norm=1.0)
    g2.load_state_dict(grads.state_dict())
    assert g2.summary() == grads.summary()

    speed = ThroughputMonitor()
    speed.totals = {"tokens": 1000, "samples": 10, "seconds": 2.0}
    s2 = ThroughputMonitor()
    s2.load_state_dict(speed.state_dict())
    assert s2.totals == speed.totals


def test_detector_on_gradient_norm_flags_a_norm_spike_with_a_normal_loss():
    detectors = [SpikeDetector(window=20, watch_steps=10, sigmas=6.0, ratio=None, on_grad_norm=on) for on in (1, 0)]
    rng = random.Random(1)
    for loss in noisy_losses(30):
        norm = 0.5 + rng.gauss(0, 0.02)
        for d in detectors:
            d.commit(loss, norm, accept=True)
    with_norm, loss_only = (d.check(4.0, 5.0) for d in detectors)  # loss at its median, gradient norm 10× its level
    assert with_norm.hit and with_norm.metric == "grad_norm"
    assert with_norm.loss_baseline == pytest.approx(4.0, abs=0.05)  # recovery is still judged on the loss
    assert not loss_only.hit


def test_a_rewind_point_is_written_into_the_storage_of_the_one_it_makes_unneeded():
    """Points every step reaching 1 step back: taking step 3 prunes step 1's point, and step 3's copy lands in its
    memory (no fresh allocation of the whole state); every kept point still holds the values of its own step."""
    from types import SimpleNamespace

    from lit_pretrain.callbacks.rewind import RewindPoints

    layer = torch.nn.Linear(4, 4)
    module = SimpleNamespace(state_dict=layer.state_dict)
    optimizer = torch.optim.AdamW(layer.parameters())
    points, seen = RewindPoints(every_n_steps=1, back_steps=1), {}
    for step in (1, 2, 3):
        layer(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        seen[step] = {k: v.clone() for k, v in layer.state_dict().items()}
        if step == 3:
            storage = points.points[0].module["weight"].data_ptr()  # step 1's, about to be pruned
        points.take(step, module, [optimizer])
    assert [p.step for p in points.points] == [2, 3]
    assert points.points[1].module["weight"].data_ptr() == storage
    for point in points.points:
        assert all(torch.equal(point.module[k], v) for k, v in seen[point.step].items())
        assert point.module["weight"].data_ptr() != layer.weight.data_ptr()
    assert torch.equal(points.points[1].optimizers[0]["state"][0]["exp_avg"], optimizer.state[layer.weight]["exp_avg"])


def test_throughput_counts_the_global_batch_and_the_whole_model_s_flops():
    """Under tensor parallelism 2 x data parallelism 2 (4 processes, 2 data-parallel ranks): tokens are one micro-batch
    per data-parallel rank (the tensor-parallel pair reads the same one), FLOPs per token the whole model's (from
    pl_module.model_cfg, not the rank's part of the model), and MFU divides by the peak of all 4 devices."""
    from types import SimpleNamespace

    from lit_pretrain.model.config import GPTConfig
    from lit_pretrain.model.shapes import flops_per_token

    cfg = GPTConfig(vocab_size=128, n_layers=2, d_model=64, n_heads=4, seq_len=32)
    strategy = SimpleNamespace(root_device=torch.device("cpu"), distributed_sampler_kwargs={"num_replicas": 2,
                                                                                            "rank": 0})
    trainer = SimpleNamespace(strategy=strategy, world_size=4, precision="32-true", global_step=0)
    part = SimpleNamespace(flops_per_token=lambda: 1000)  # what a rank's part of the model would count
    speed = ThroughputMonitor(peak_flops_per_s=1e9)
    speed.on_train_start(trainer, SimpleNamespace(model=part, model_cfg=cfg))
    speed.on_train_batch_start(trainer, None, (torch.zeros(4, 32, dtype=torch.long), None), 0)
    assert (speed._tokens, speed._samples) == (4 * 32 * 2, 4 * 2)
    rates = speed.rates(speed._tokens, speed._samples, 2.0)
    assert speed.flops_per_token == flops_per_token(cfg) > 1000
    assert rates["tokens_per_s"] == 128.0 and rates["flops_per_s"] == 128.0 * flops_per_token(cfg)
    assert rates["mfu"] == rates["flops_per_s"] / (1e9 * 4)
