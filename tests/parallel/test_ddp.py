"""Data parallelism: 2 processes (gloo, CPU) against one process with the same global batch.

The parity of the losses, validation and tokens counted on 2 DDP ranks against one process is asserted in
tests/strategy/test_strategies_parity.py (test_strategy_matches_one_process[ddp]), on the runs it makes anyway.

Run as `python -m lit_pretrain.cli train` in a subprocess: Lightning's `ddp` launcher re-runs the command for
rank 1, which inside pytest would re-launch pytest itself (docs/cpu.md, pitfall 2).
"""

import pytest

from lit_pretrain.runs.folder import read_metrics
from tests.conftest import run_module, train_args

pytestmark = pytest.mark.slow


def run_cli(tmp_path, data_dir, name, *overrides):
    run_module(*train_args(data_dir, tmp_path, name), "trainer.progress_bar=false", "trainer.max_steps=8",
               "trainer.val_every_n_steps=8", "trainer.log_every_n_steps=1", "schedule.warmup_steps=2",
               "strategy.timeout_seconds=120", *overrides, timeout=300)
    return read_metrics(tmp_path / name / "metrics.csv")


def test_validation_is_one_set_of_windows_for_any_world_size_and_the_console_holds_our_lines(tmp_path,
                                                                                          tiny_data_dir):
    """The same weights (one checkpoint) validated by 1 process and by 2 DDP processes, with the same
    micro_batch_size: the same val/loss. trainer.val_windows=13 counts windows in all, so 2 ranks take 7 and 6
    (their last batches filled up with windows that predict nothing); trainer.val_batches counted batches per
    device, and 2 processes validated twice the windows of 1 (the loss moved by 0.014 after resharding
    2 -> 1). Both runs keep trainer.progress_bar=true with their output captured (not a terminal): the console
    holds our lines and none of the noise found before."""
    import json
    import re

    def cli(name, *overrides):
        out = run_module(*train_args(tiny_data_dir, tmp_path, name), "trainer.micro_batch_size=4",
                         "trainer.tokens_per_step=512", "trainer.max_steps=2", "trainer.val_windows=13",
                         "schedule.warmup_steps=1", "strategy.timeout_seconds=120", *overrides, timeout=300)
        return out.stdout + out.stderr, json.loads((tmp_path / name / "summary.json").read_text())

    # Validated in fit at step 2, then resumed under another name on 2 processes: no step to train, validated
    # after fit (val_every_n_steps 3 does not divide max_steps 2).
    one_out, one = cli("one", "trainer.val_every_n_steps=2", "trainer.checkpoint_every_n_steps=2")
    checkpoint = tmp_path / "one" / "checkpoints" / "step0000002.ckpt"
    two_out, two = cli("two", "trainer.val_every_n_steps=3", "strategy=ddp", "trainer.devices=2",
                       f"run.resume={checkpoint}", "run.resume_allow_changes=[trainer.val_every_n_steps]")
    assert two["world_size"] == 2 and two["steps"] == one["steps"] == 2
    # Same weights and windows in fp32; only the batches the windows are grouped in (4+4+4+1 on one process,
    # 4+3 and 4+2 on the ranks, each batch filled up with padding) and the order of the sums differ: float
    # rounding, ~1e-7 relative at a loss of ~6. Measured: equal to the last bit of the fp32 logged
    # (6.214077949523926 both); 26 windows instead of 13 (the set 2 processes validated under val_batches) moved
    # it by 5.0e-4, 50x the tolerance.
    assert two["final_val_loss"] == pytest.approx(one["final_val_loss"], abs=1e-5)
    assert two["val_bits_per_byte"] == pytest.approx(one["val_bits_per_byte"], rel=1e-5)
    # The console (callbacks/console.py). Before: Lightning's litlogger tip, torch's LeafSpec deprecation twice
    # per rank, "use sync_dist=True" for val/loss, val/perplexity and val/bits_per_byte, the bar's redraws.
    for out in (one_out, two_out):
        for noise in ("litlogger", "LeafSpec", "sync_dist", "it/s]", "\r", "v_num", "limit_val_batches"):
            assert noise not in out, (noise, out[-3000:])
        assert "run folder:" in out and "validation loss" in out, out[-3000:]
    # A line per validation in fit, where a terminal gets the bar; the stability report of the steps trained.
    assert re.search(r"^step 2/2: train/loss \d\.\d{4}, val/loss \d\.\d{4}$", one_out, re.M)
    assert "stability report" in one_out
    assert two_out.count("reusing ") == 1  # rank 0 alone reports the prepared data
