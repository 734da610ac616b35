"""`lit-pretrain compare` and `lit-pretrain runs` on run folders written by hand (no training)."""

import csv
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lit_pretrain import cli
from lit_pretrain.errors import ConfigError, DataError
from lit_pretrain.runs.compare import compare, panels
from lit_pretrain.runs.table import find_runs, read_run, row, status, table
from tests.conftest import ROOT

COLUMNS = ["epoch", "step", "train/loss", "train/tokens_seen", "train/lr", "train/grad_norm", "val/loss",
           "throughput/tokens_per_s"]


def write_run(folder: Path, rows, summary=None, config=None, latest=None) -> Path:
    """A run folder as training leaves it: metrics.csv rows in Lightning's layout (empty cells), config, summary."""
    folder.mkdir(parents=True)
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (folder / "config.yaml").write_text(config or "run:\n  name: x\ntrainer:\n  tokens_per_step: null\n")
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))
    if latest is not None:
        (folder / "checkpoints").mkdir()
        (folder / "checkpoints" / latest).write_bytes(b"weights")
        (folder / "checkpoints" / "latest").write_text(latest + "\n")
    return folder


# Run a: finished, 512 tokens per step. Every row's step is the optimizer steps completed (tokens_seen = step × 512),
# the module's rows and the monitors' alike.
RUN_A = [
    {"step": 5, "train/loss": 6.0, "train/tokens_seen": 2560, "train/lr": 1e-3, "train/grad_norm": 0.9},
    {"step": 5, "throughput/tokens_per_s": 1000.0},
    {"step": 10, "train/loss": 5.5, "train/tokens_seen": 5120, "train/lr": 5e-4, "train/grad_norm": 0.7},
    {"step": 10, "val/loss": 5.6},
    {"step": 10, "throughput/tokens_per_s": 1200.0},
]
SUMMARY_A = {"steps": 10, "tokens_seen": 5120, "tokens_per_step": 512, "flops_per_token": 1000,
             "final_train_loss": 5.5, "final_val_loss": 5.6, "tokens_per_second": 1100.0, "val_bits_per_byte": 1.25}
# Run b: still training (no summary), 1024 tokens per step known only from its train rows; no gradient norm, no
# throughput, no validation yet.
RUN_B = [
    {"step": 2, "train/loss": 6.2, "train/tokens_seen": 2048, "train/lr": 2e-3},
    {"step": 4, "train/loss": 5.9, "train/tokens_seen": 4096, "train/lr": 1e-3},
]


@pytest.fixture
def two_runs(tmp_path):
    a = write_run(tmp_path / "runs" / "a", RUN_A, SUMMARY_A, latest="step0000010.ckpt")
    b = write_run(tmp_path / "runs" / "b", RUN_B)
    return a, b


def lines_of(panel):
    return {(line.run, line.label): (line.x, line.y, line.color, line.dashed) for line in panel.lines}


def test_panels_hold_each_runs_input_series(two_runs):
    a, b = (read_run(p) for p in two_runs)
    got = panels([a, b])
    loss = lines_of(got["loss_tokens"])
    assert loss == {
        ("a", "a train"): ([2560, 5120], [6.0, 5.5], "C0", False),
        ("a", "a val"): ([5120], [5.6], "C0", True),
        ("b", "b train"): ([2048, 4096], [6.2, 5.9], "C1", False),
    }
    # FLOPs = tokens × summary flops_per_token; run b has no summary yet, so a note instead of a line.
    assert lines_of(got["loss_flops"]) == {("a", "a train"): ([2560e3, 5120e3], [6.0, 5.5], "C0", False),
                                           ("a", "a val"): ([5120e3], [5.6], "C0", True)}
    assert got["loss_flops"].notes == ["b: no flops_per_token (summary.json is written when training ends)"]
    assert lines_of(got["lr"]) == {("a", "a"): ([2560, 5120], [1e-3, 5e-4], "C0", False),
                                   ("b", "b"): ([2048, 4096], [2e-3, 1e-3], "C1", False)}
    assert lines_of(got["grad_norm"]) == {("a", "a"): ([2560, 5120], [0.9, 0.7], "C0", False)}
    assert got["grad_norm"].notes == ["b: no train/grad_norm or grad_norm/mean in metrics.csv"]
    assert lines_of(got["throughput"]) == {("a", "a"): ([2560, 5120], [1000.0, 1200.0], "C0", False)}
    assert got["throughput"].notes == ["b: no throughput/tokens_per_s in metrics.csv"]
    assert got["loss_tokens"].notes == ["b: no val/loss in metrics.csv"]


def test_a_batch_schedule_is_plotted_at_the_tokens_it_logged(tmp_path):
    # trainer.batch_schedule: 512 tokens for steps 1-2, 1,024 after; summary.json's tokens_per_step is the largest.
    rows = [{"step": 2, "train/loss": 6.2, "train/tokens_seen": 1024}, {"step": 4, "train/loss": 5.9,
            "train/tokens_seen": 3072}, {"step": 4, "val/loss": 6.0}]
    run = read_run(write_run(tmp_path / "runs" / "c", rows, {"steps": 4, "tokens_seen": 3072,
                                                              "tokens_per_step": 1024}))
    assert lines_of(panels([run])["loss_tokens"]) == {("c", "c train"): ([1024, 3072], [6.2, 5.9], "C0", False),
                                                      ("c", "c val"): ([3072], [6.0], "C0", True)}


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_compare_writes_only_the_png(two_runs, tmp_path, capsys):
    before = snapshot(tmp_path)
    out = tmp_path / "compare.png"
    assert cli.main(["compare", *map(str, two_runs), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "note: throughput: b: no throughput/tokens_per_s in metrics.csv" in capsys.readouterr().out
    after = snapshot(tmp_path)
    assert set(after) - set(before) == {Path("compare.png")}  # no temporary file left, nothing else written
    assert {k: after[k] for k in before} == before  # the run folders are untouched
    # Refused before drawing (a suffix matplotlib cannot write, a folder that is no run): one line, exit 2, and
    # the earlier figure and everything else as they were.
    assert cli.main(["compare", *map(str, two_runs), "--out", str(tmp_path / "compare.csv")]) == 2
    assert capsys.readouterr().err.startswith(f"lit-pretrain compare: error: --out {tmp_path / 'compare.csv'}: "
                                              "'.csv' is not an image format matplotlib writes")
    with pytest.raises(DataError, match=r"is not a run folder"):
        compare([str(two_runs[0]), str(tmp_path / "nope")], str(out))
    with pytest.raises(ConfigError, match=r"given twice"):
        compare([str(two_runs[0]), str(two_runs[0])], str(out))
    assert snapshot(tmp_path) == after


def test_run_status_is_derived_from_summary_checkpoint_and_metrics(tmp_path):
    now, later = time.time(), time.time() + 3600  # `later`: every folder was last written an hour ago
    finished = read_run(write_run(tmp_path / "finished", RUN_A, SUMMARY_A))
    live = read_run(write_run(tmp_path / "live", RUN_B))
    resumable = read_run(write_run(tmp_path / "resumable", RUN_B, latest="step0000004.ckpt"))
    # A summary older than the metrics (the run was resumed to train longer) does not make it finished.
    stale = read_run(write_run(tmp_path / "stale", RUN_A, {**SUMMARY_A, "steps": 5}, latest="step0000005.ckpt"))
    broken = read_run(write_run(tmp_path / "broken", RUN_B, latest="step0000004.ckpt"))
    (broken.path / "checkpoints" / "step0000004.ckpt").unlink()  # `latest` names a file that is gone
    assert status(finished, later) == "finished"
    assert [status(r, now) for r in (live, resumable, stale, broken)] == ["running"] * 4
    assert [status(r, later) for r in (live, resumable, stale, broken)] == ["failed", "resumable", "resumable",
                                                                             "failed"]
    assert status(live, now + 60, active_minutes=0.5) == "failed"
    # A row the training is still writing (cut inside a number) loses only its unreadable cell.
    with open(live.path / "metrics.csv", "a") as f:
        f.write("0,5,6.1e-")
    assert read_run(live.path).rows == [*RUN_B, {"epoch": 0.0, "step": 5.0}]


def test_runs_table_rows(two_runs, tmp_path, capsys):
    a, b = (read_run(p) for p in two_runs)
    assert row(a) == {"name": "a", "steps": 10, "tokens": 5120, "train loss": 5.5, "val loss": 5.6,
                      "bits/byte": 1.25, "tokens/s": 1100.0, "status": "finished"}
    # A run without a summary: its last metrics rows, and no bits per byte.
    assert row(b, time.time() + 3600) == {"name": "b", "steps": 4, "tokens": 4096, "train loss": 5.9,
                                          "val loss": None, "bits/byte": None, "tokens/s": None, "status": "failed"}
    (tmp_path / "runs" / "not-a-run").mkdir()  # an empty folder is not listed
    lines = table(tmp_path / "runs").splitlines()
    assert lines[0].split() == ["name", "steps", "tokens", "train", "loss", "val", "loss", "bits/byte", "tokens/s",
                                "status"]
    assert lines[1].split() == ["a", "10", "5,120", "5.5000", "5.6000", "1.2500", "1,100", "finished"]
    assert lines[2].split() == ["b", "4", "4,096", "5.9000", "-", "-", "-", "running"]
    assert len(lines) == 3

    assert cli.main(["runs", str(tmp_path / "runs")]) == 0
    assert capsys.readouterr().out.splitlines() == lines
    assert cli.main(["runs", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"lit-pretrain runs: error: runs folder {tmp_path / 'missing'} does not exist: give the folder that holds "
        "run folders (run.root_dir, runs/ by default)"]


def test_run_views_import_neither_torch_nor_lightning():
    code = ("import sys, lit_pretrain.runs.table, lit_pretrain.runs.compare; "
            "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_run_status_is_summary_status_and_the_folder_lock(tmp_path, capsys):
    """summary.json's status (runs/state.py) is what `runs` and `compare` show; `running` stays running only while a
    live start holds the folder's lock, and reads `killed` once none does (SIGKILL, OOM: nothing wrote an end)."""
    from lit_pretrain.runs.folder import claim_run_dir

    root = tmp_path / "runs"
    start = {"status": "running", "steps": 0, "max_steps": 10, "resume_step": None, "pid": 1, "host": "h"}
    claim = claim_run_dir(str(root), "live", overwrite=False)  # a start holding its folder, as train() does
    write_run(root / "killed", RUN_B, start, latest="step0000004.ckpt")
    (root / "live" / "metrics.csv").write_text((root / "killed" / "metrics.csv").read_text())
    (root / "live" / "summary.json").write_text(json.dumps(start))
    write_run(root / "preempted", RUN_B, {**SUMMARY_A, "status": "preempted", "steps": 4, "max_steps": 10,
                                          "resume_step": 4, "tokens_seen": 4096}, latest="step0000004.ckpt")
    write_run(root / "failed", RUN_B, {**start, "status": "failed", "steps": 4, "error": "RuntimeError: x"})
    got = {p.name: status(read_run(p)) for p in find_runs(root)}
    assert got == {"failed": "failed", "killed": "killed, resumes from step 4", "live": "running",
                   "preempted": "preempted, resumes from step 4"}
    claim.release()
    assert status(read_run(root / "live")) == "killed"  # the lock went with its holder
    # A preempted run's numbers are its summary's (the checkpoint's step); the others' their metrics rows.
    assert row(read_run(root / "preempted"))["steps"] == 4
    notes = compare([str(root / "preempted"), str(root / "failed")], str(tmp_path / "c.png"))
    assert notes[:2] == ["preempted: preempted, resumes from step 4; 4 of 10 steps", "failed: failed; 4 of 10 steps"]
