"""trainer.batch_schedule trained by real `lit-pretrain train` runs: the batch doubles at step 2 (8 windows of 64
tokens a step, then 16); each step trains on the windows the step map gives it; the run resumed from its step-3
checkpoint on 2 processes (micro-batches of 4 and 8 windows a rank instead of 4 and 8 on one) equals the
uninterrupted run. The map and the loader are tested in-process (tests/planning/test_batch_schedule.py,
tests/data/test_scheduled_order.py)."""

import json
import math
from pathlib import Path

import pytest
import yaml

from lit_pretrain.data.datamodule import GlobalOrderSampler, ShardWindows
from lit_pretrain.optim.schedule import lr_at
from lit_pretrain.runs.folder import read_metrics, series
from tests.conftest import run_module, train_args
from tests.resume.test_resume import extra, global_indices

pytestmark = pytest.mark.slow

COMMON = ["trainer.tokens_per_step=null", "trainer.max_steps=5", "trainer.log_every_n_steps=1",
          "trainer.batch_schedule=[{at_step: 0, tokens_per_step: 512}, {at_step: 2, tokens_per_step: 1024}]",
          "trainer.checkpoint_every_n_steps=3", "trainer.val_every_n_steps=5", "trainer.val_windows=16",
          "schedule.warmup_steps=1", "trainer.progress_bar=false", "strategy.timeout_seconds=60"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data_dir):
    root = tmp_path_factory.mktemp("batch_schedule")

    def train(name, *overrides):
        record = extra(("RecordIndices", {"out": str(root / f"{name}.indices")}))
        run_module(*train_args(tiny_data_dir, root, name), *COMMON, *overrides, record)
        return root / name

    full = train("full")  # one process: accumulation 2 of micro-batches of 8 windows (4 before step 2)
    ddp = train("ddp", f"run.resume={full / 'checkpoints' / 'step0000003.ckpt'}", "strategy=ddp", "trainer.devices=2",
                "trainer.micro_batch_size=4")
    return tiny_data_dir, full, ddp


def metric(run: Path, key: str) -> dict:
    return dict(series(read_metrics(run / "metrics.csv"), key))


def test_a_growing_batch_trains_its_windows_and_resumes_on_another_layout(runs):
    data, full, ddp = runs
    manifest = json.loads((data / "manifest.json").read_text())
    train = ShardWindows(data, manifest["splits"]["train"]["shards"], manifest["dtype"], 64)
    seed = yaml.safe_load((full / "config.yaml").read_text())["run"]["seed"]
    order = GlobalOrderSampler(len(train), 1, 0, 1, seed).global_order(0).tolist()
    # By hand: 8, 8, then 16 windows a step, consumed in the order's sequence: before(s) = 0, 8, 16, 32, 48, 64.
    bounds = [0, 8, 16, 32, 48, 64]
    expected = {s: sorted(order[bounds[s]:bounds[s + 1]]) for s in range(5)}
    indices = global_indices(full.parent / "full.indices")
    assert indices == expected
    assert global_indices(ddp.parent / "ddp.indices") == {s: expected[s] for s in (3, 4)}
    # tokens_seen by the steps' own batches; the rate times sqrt(2) from step 2 on (batch_schedule_lr=sqrt).
    assert metric(full, "train/tokens_seen") == {1: 512.0, 2: 1024.0, 3: 2048.0, 4: 3072.0, 5: 4096.0}
    for key in ("train/lr", "train/tokens_seen"):
        assert metric(ddp, key) == {k: metric(full, key)[k] for k in (4, 5)}, key
    cfg = yaml.safe_load((full / "config.yaml").read_text())
    sched = {k: cfg["schedule"][k] for k in ("kind", "lr_min", "warmup_steps", "decay_fraction", "decay_shape")}
    base = [lr_at(k, lr_peak=cfg["optim"]["lr_peak"], max_steps=5, **sched) for k in range(5)]
    factor = [1.0, 1.0, math.sqrt(2), math.sqrt(2), math.sqrt(2)]  # the update of step k logs at row k + 1
    assert list(metric(full, "train/lr").values()) == pytest.approx([b * f for b, f in zip(base, factor)], rel=1e-6)
    # The 2 processes differ only in summation order (two 8-window gradient means averaged against one 16-window
    # mean per micro-batch): tests/resume/test_resume.py's 1e-5 (10x the 9.5e-7 measured by
    # tests/strategy/test_strategies_parity.py).
    a, b = metric(full, "train/loss"), metric(ddp, "train/loss")
    assert [b[k] for k in (4, 5)] == pytest.approx([a[k] for k in (4, 5)], abs=1e-5)
    summaries = [json.loads((run / "summary.json").read_text()) for run in (full, ddp)]
    assert [s["tokens_seen"] for s in summaries] == [4096, 4096]
