"""Randomly broken configs through the CLI entry: each gives exit code 2 and one line naming the key, never a
traceback, and never writes into an existing run folder.

Cases are generated from the schema itself (every field: an unknown neighbour key, a value of the wrong type, a value
out of its range or choices), plus impossible layouts, missing files, and resumes that change the experiment. They
run in-process through `cli.main` (a traceback would escape it and fail the test); three also run as real processes.
"""

import dataclasses
import random
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from lit_pretrain import cli, config
from lit_pretrain.data.shards import load_manifest
from lit_pretrain.resume import store
from lit_pretrain.resume.compat import run_meta
from lit_pretrain.resume.verified import save_atomic
from lit_pretrain.schema import Config
from tests.conftest import EXPERIMENTS, tiny_data_overrides

RUN_FILE = str(EXPERIMENTS / "runs" / "tiny.yaml")
CASES = 240


def leaf_fields(schema=Config, prefix=""):
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from leaf_fields(type(default), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, default


def broken_values(key, f, default):
    """(override, key the error must name) pairs that are wrong for this field."""
    out = [(f"{key}_x=1", f"{key}_x")]
    base = typing.get_args(f.type)[0] if typing.get_origin(f.type) is typing.Union else f.type
    if base in (int, float):
        out.append((f"{key}=abc", key))
    elif base is bool:
        out.append((f"{key}=maybe", key))
    elif typing.get_origin(base) is list:
        out.append((f"{key}=5", key))
    meta = f.metadata
    if "choices" in meta:
        out.append((f"{key}=bogus_choice", key))
    for op, delta in (("ge", -1), ("gt", 0), ("le", 1), ("lt", 0)):
        if op in meta:
            bound = meta[op]
            value = bound + delta if isinstance(bound, int) else (bound - 1.0 if op in ("ge", "gt") else bound + 1.0)
            out.append((f"{key}={value}", key))
    return out


def generated_cases(seed=0):
    pool = [case for key, f, default in leaf_fields() for case in broken_values(key, f, default)]
    rng = random.Random(seed)
    return rng.sample(pool, min(CASES, len(pool)))


@pytest.fixture(scope="session")  # built once per worker, whatever the order: tests/helpers/longest_first.py
def existing_run(tmp_path_factory, tiny_data_dir):
    """A run folder with a step-2 checkpoint of the tiny experiment (metadata as training writes it)."""
    root = tmp_path_factory.mktemp("fuzz_runs")
    overrides = [*tiny_data_overrides(tiny_data_dir), f"run.root_dir={root}", "run.name=kept"]
    cfg = config.load(RUN_FILE, overrides)
    manifest = load_manifest(tiny_data_dir)
    cfg.model.vocab_size = manifest["tokenizer"]["vocab_size"]
    folder = root / "kept" / "checkpoints"
    folder.mkdir(parents=True)
    c = config.to_object(cfg)
    meta = run_meta(dataclasses.asdict(cfg), manifest,
                    c.trainer.micro_batch_size * c.model.seq_len)
    path = folder / store.step_file(2)
    save_atomic({"lit_pretrain": {"step": 2, "metrics_rows": 3, **meta}}, path)
    store.publish(folder, path)
    (root / "kept" / "metrics.csv").write_text("step,train/loss\n0,6.2\n1,6.1\n2,6.0\n")
    return overrides


def snapshot(folder: Path):
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*"))


def run_case(capsys, overrides):
    code = cli.main(["train", RUN_FILE, *overrides])
    return code, capsys.readouterr().err


def test_broken_configs_give_one_line_naming_the_key(capsys, existing_run, tmp_path):
    folder = Path(existing_run[-2].split("=", 1)[1]) / "kept"
    before = snapshot(folder)
    missing = tmp_path / "missing"
    foreign = tmp_path / "foreign.ckpt"  # verifies, but was not written by a training run
    save_atomic({"state_dict": {}}, foreign)
    special = [
        # Impossible layouts.
        (["trainer.devices=2"], "trainer.devices"),
        (["strategy=ddp", "trainer.devices=2", "trainer.tokens_per_step=1000"], "trainer.tokens_per_step"),
        (["strategy=zero", "strategy.zero_stage=3", "trainer.devices=2", "trainer.precision=16-mixed"],
         "trainer.precision"),
        (["schedule.warmup_steps=1000", "trainer.max_steps=10"], "schedule.warmup_steps"),
        # Missing files.
        # (in new run folders: the existing one would be refused first)
        (["data.corpus=text", f"data.paths=[{missing}/a.txt]", f"data.prepared_dir={tmp_path}/p1", "run.name=new1"],
         "data.paths"),
        (["data.corpus=text", "data.paths=[]", f"data.prepared_dir={tmp_path}/p2", "run.name=new2"], "data.paths"),
        ([f"run.resume={missing}.ckpt"], "run.resume"),
        # An existing run folder without resume or overwrite.
        ([], "run.overwrite"),
        # Resumes that change the experiment, or name no key.
        (["run.resume=auto", "model.d_model=128"], "model.d_model"),
        (["run.resume=auto", "model.n_layers=3"], "model.n_layers"),
        (["run.resume=auto", "optim.lr_peak=0.01"], "optim.lr_peak"),
        (["run.resume=auto", "run.seed=7"], "run.seed"),
        (["run.resume=auto", "trainer.max_steps=200"], "trainer.max_steps"),
        (["run.resume=auto", "trainer.tokens_per_step=1024"], "trainer.tokens_per_step"),
        (["run.resume=auto", "run.resume_allow_changes=[optim.lr_pek]"], "run.resume_allow_changes"),
        (["run.resume=auto", "run.overwrite=true"], "run.overwrite"),
        ([f"run.resume={foreign}"], "foreign.ckpt carries no run metadata"),
    ]
    failures = []
    cases = [([o], k) for o, k in generated_cases()] + special
    for overrides, key in cases:
        code, err = run_case(capsys, [*existing_run, *overrides])
        line = err.strip()
        if code != 2 or "\n" in line or key not in line or "Traceback" in err:
            failures.append((overrides, code, err[-500:]))
    assert not failures, f"{len(failures)} of {len(cases)} cases: {failures[:5]}"
    assert len(cases) >= 250
    assert snapshot(folder) == before  # nothing written into the existing run folder


@pytest.mark.slow
def test_cli_process_exits_2_without_traceback(existing_run):
    for overrides in (["trainer.max_stepz=3"], ["trainer.micro_batch_size=0"], ["run.resume=auto", "model.d_model=8"]):
        out = subprocess.run([sys.executable, "-m", "lit_pretrain.cli", "train", RUN_FILE, *existing_run, *overrides],
                             capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr
