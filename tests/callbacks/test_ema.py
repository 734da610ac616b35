"""The weights' EMA (callbacks/ema.py): its schedule, the average against one computed by hand from the weights of
every step, val/ema_loss against the EMA weights evaluated apart, export of the EMA, and (slow) the same average
under ZeRO-3, DDP and tensor parallelism, resumed across layouts from one-file and sharded checkpoints."""

import json
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lit_pretrain import config
from lit_pretrain.callbacks.ema import START, UPDATE, WeightEma, action_at, update_weight
from lit_pretrain.errors import ConfigError, DataError
from lit_pretrain.resume.sharded.save import EMA_KEY, as_single_checkpoint
from lit_pretrain.resume.weights import _gpt
from tests.conftest import EXPERIMENTS, run_module
from tests.helpers import ema_workers as workers


@pytest.mark.parametrize("step, start, every, started, expected", [
    (0, 0, 1, False, START),  # start_step 0: the initial weights
    (3, 5, 1, False, None),  # before start_step: nothing
    (5, 5, 1, False, START),
    (6, 5, 1, True, UPDATE),
    (6, 5, 2, True, None),  # every 2 steps from start_step: 7, 9, ...
    (7, 5, 2, True, UPDATE),
    (9, 5, 2, False, START),  # resumed from a checkpoint without the average: it starts there
])
def test_action_at(step, start, every, started, expected):
    assert action_at(step, start, every, started) == expected


@pytest.mark.parametrize("decay, every, weight", [(0.5, 1, 0.5), (0.9, 2, 0.19), (0.999, 1, 0.001)])
def test_update_weight_keeps_the_per_step_decay(decay, every, weight):
    # n steps of decay d leave d^n of the old average: 1 - d^n goes to the weights (0.9^2 = 0.81).
    assert update_weight(decay, every) == pytest.approx(weight, rel=1e-12)


def test_constructor_and_config_refuse_bad_values():
    with pytest.raises(ConfigError, match="callbacks.ema.decay=1.0"):
        WeightEma(decay=1.0)
    with pytest.raises(ConfigError, match=r"callbacks.ema.start_step=100 is not below trainer.max_steps=100"):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", ["callbacks.ema.enabled=true", "callbacks.ema.start_step=100"])


class Weights(Callback):
    """Every parameter after each optimizer step, in float64."""

    def __init__(self):
        self.steps = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[trainer.global_step] = {n: p.detach().double().clone()
                                           for n, p in pl_module.model.named_parameters()}


def test_average_validation_and_export_on_one_process(tmp_path):
    seen = Weights()
    trainer, module, ema = workers.fit(workers.load("single", 1), tmp_path / "one.ckpt", 1, callbacks=[seen],
                                       val_batches=2)
    # By hand, in float64: the copy of step START's weights, then ema <- d ema + (1 - d) w at every later step.
    d = workers.DECAY
    by_hand = dict(seen.steps[workers.START])
    for step in range(workers.START + 1, workers.STEPS + 1):
        by_hand = {n: d * e + (1 - d) * seen.steps[step][n] for n, e in by_hand.items()}
    assert ema.started_at == workers.START and ema.names == list(by_hand)
    for name, value in zip(ema.names, ema.ema):
        # fp32 lerp against float64: a few ulps of values below 1 (1e-7 relative); an average one step off would
        # differ by (1 - d) x one update, about 1e-4 here.
        assert value.dtype == torch.float32 and torch.allclose(value.double(), by_hand[name], rtol=0, atol=1e-6), name
    assert max((by_hand[n] - seen.steps[workers.STEPS][n]).abs().max() for n in by_hand) > 1e-5  # not the weights

    # val/ema_loss: the same validation batches under a model that holds the EMA, evaluated apart (the module's own
    # validation_totals, whose sum val/loss is).
    checkpoint = torch.load(tmp_path / "one.ckpt", map_location="cpu", weights_only=True)
    assert set(checkpoint[EMA_KEY]) == set(ema.names)
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            p.copy_(checkpoint[EMA_KEY][name])
        module.eval()
        w = workers.windows(module.model_cfg.seq_len)
        totals = sum(module.validation_totals((w[i:i + 4, :-1], w[i:i + 4, 1:])) for i in (0, 4))
    ema_loss = float(totals[0] / totals[1])
    # Float64 sums of the same float32 losses in the same order: equal but for the log's float32 storage.
    assert float(trainer.callback_metrics["val/ema_loss"]) == pytest.approx(ema_loss, rel=1e-6)
    assert abs(float(trainer.callback_metrics["val/loss"]) - ema_loss) > 1e-4  # the raw weights', not the EMA's

    # export --weights ema: the checkpoint's GPT with the EMA in place of every parameter; raw: the weights.
    exported = _gpt(checkpoint, tmp_path / "one.ckpt", "ema")
    raw = _gpt(checkpoint, tmp_path / "one.ckpt", "raw")
    for (name, p), (_, q) in zip(exported.named_parameters(), raw.named_parameters()):
        assert torch.equal(p, checkpoint[EMA_KEY][name]) and torch.equal(q, checkpoint["state_dict"]["model." + name])
    del checkpoint[EMA_KEY]
    with pytest.raises(DataError, match="holds no EMA of the weights"):
        _gpt(checkpoint, tmp_path / "one.ckpt", "ema")


@pytest.mark.slow
def test_average_exact_under_zero3_ddp_and_tensor_parallelism(tmp_path):
    """One launch of 2 processes (tests/helpers/ema_workers.py): ZeRO-3 against one process; ZeRO-3 resumed from its
    own step-2 file bitwise; DDP resumed from that file and TP 2 from the sharded folder of the same step, against
    one process; the sharded folder's EMA bitwise the one-file checkpoint's."""
    run_module("tests.helpers.ema_workers", str(tmp_path))
    trainer, _, _ = workers.fit(workers.load("single", 1), tmp_path / "single.ckpt", 1, val_batches=2)
    # val/ema_loss under ZeRO-3 (the EMA swapped into FSDP2's shards) and TP 2 against one process: the losses of
    # weights that agree to 2.4e-7 agree to about 1e-6; swapping without resharding would give val/loss twice.
    for case, losses in json.loads((tmp_path / "val_losses.json").read_text()).items():
        for key, value in losses.items():
            assert value == pytest.approx(float(trainer.callback_metrics[key]), abs=1e-5), (case, key)
        assert abs(losses["val/ema_loss"] - losses["val/loss"]) > 1e-3, case

    def ema_of(name):
        checkpoint = torch.load(tmp_path / name, map_location="cpu", weights_only=True)
        assert checkpoint["global_step"] == (2 if "step2" in name else workers.STEPS)
        return checkpoint[EMA_KEY]

    single, zero3, at_step2 = ema_of("single.ckpt"), ema_of("zero3.ckpt"), ema_of("zero3.step2.ckpt")
    resumed = ema_of("zero3_resumed.ckpt")
    assert list(zero3) == list(single) == list(resumed)
    assert all(torch.equal(zero3[n], resumed[n]) for n in zero3)  # the same layout: bitwise
    folder = as_single_checkpoint(tmp_path / "zero3.step2")[EMA_KEY]  # each rank's share, read whole
    assert list(folder) == list(at_step2) and all(torch.equal(folder[n], at_step2[n]) for n in folder)
    # The weights differ by float summation order only (ZeRO-3's reduce-scatter, TP's partial sums): measured 2.4e-7
    # after 4 steps, the EMA likewise. An average restarted at the resume, or restored from the wrong tensor, would
    # be off by about the last two steps' updates, which the last check shows to be 100x above the tolerance.
    tolerance = 2e-6
    for name in ("zero3.ckpt", "ddp_from_zero3.ckpt", "tp_from_sharded.ckpt"):
        got = ema_of(name)
        worst = max((got[n] - single[n]).abs().max().item() for n in single)
        assert worst < tolerance, f"{name}: EMA differs from one process by {worst:.2e}"
    moved = max((single[n] - at_step2[n]).abs().max().item() for n in single)
    assert moved > 100 * tolerance and math.isfinite(moved)
