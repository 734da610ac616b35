"""A run that changes layout midway is the same experiment: chains of real `lit-pretrain train` runs in one run
folder, each link a layout of its own, stopped by Ctrl-C and continued with `run.resume=auto` on the next layout,
equal the uninterrupted one-process run.

Every layout is a source and a target at least once (chain A: one process → DDP 2 → ZeRO-3 2 → PP 2 → TP 2 + SP →
ZeRO-1 2; chain B: ZeRO-2 2 → HSDP 2 x 2 → CP 2 → one process; the default MoE model, chain C: one process → EP 2
→ EP 2 x ZeRO-3 → one process), and the accumulation of a step changes down (2 → 1,
4 → 2) and up (1 → 4, 2 → 4) across links. The links end on odd and even steps, Ctrl-C lands mid-accumulation and
at step boundaries, checkpoints alternate between one file and a sharded folder, and the corpus (10 documents) is
short enough that an epoch (7 steps of 16 windows) ends inside a link and a link resumes inside the second epoch.

Compared with the reference: the step labels and keys of every metrics.csv row, train/loss per step and the
validation losses (within a float tolerance: the layouts sum in other orders), the learning rate and tokens_seen
(exactly: they are functions of the step), the steps at which validation ran, the checkpoint of the last step,
summary.json and the `runs` table.
"""

import json
from pathlib import Path

import pytest

from lit_pretrain.runs import table as run_table
from lit_pretrain.runs.folder import read_metrics
from tests.conftest import EXPERIMENTS, run_module

pytestmark = pytest.mark.slow

STEPS = 12
# 16 windows of 64 tokens a step; validation every 3 steps; a checkpoint every 4 (besides each link's Ctrl-C).
COMMON = [f"trainer.max_steps={STEPS}", "trainer.tokens_per_step=1024", "trainer.val_every_n_steps=3",
          "trainer.log_every_n_steps=1", "trainer.checkpoint_every_n_steps=4", "schedule.warmup_steps=3",
          "trainer.val_windows=16", "trainer.progress_bar=false", "strategy.timeout_seconds=60"]
# name: (overrides, accumulation of a step on that layout)
LAYOUTS = {
    "one": (["trainer.micro_batch_size=8"], 2),
    "ddp": (["strategy=ddp", "trainer.devices=2", "trainer.micro_batch_size=8"], 1),
    "zero1": (["strategy=zero", "strategy.zero_stage=1", "trainer.devices=2", "trainer.micro_batch_size=4"], 2),
    "zero2": (["strategy=zero", "strategy.zero_stage=2", "trainer.devices=2", "trainer.micro_batch_size=8"], 1),
    "zero3": (["strategy=zero", "trainer.devices=2", "trainer.micro_batch_size=2"], 4),
    "hsdp": (["strategy=zero", "strategy.zero_stage=2", "strategy.data_parallel_replicate=2", "trainer.devices=4",
              "trainer.micro_batch_size=2"], 2),
    "tp": (["strategy=tensor", "strategy.sequence_parallel=true", "trainer.devices=2", "trainer.micro_batch_size=4"],
           4),
    "pp": (["strategy=pipeline", "trainer.devices=2", "trainer.micro_batch_size=8"], 2),
    "cp": (["strategy=ddp", "strategy.context_parallel=2", "trainer.devices=2", "trainer.micro_batch_size=4"], 4),
    "ep2": (["strategy=ddp", "strategy.expert_parallel=2", "trainer.devices=2", "trainer.micro_batch_size=8"], 1),
    "ep2_zero3": (["strategy=zero", "strategy.expert_parallel=2", "trainer.devices=2", "trainer.micro_batch_size=2"],
                  4),
}
# The default model.moe (8 experts, top 2, its load-balancing loss per window): chain c's model.
MOE = ["model.moe={}"]
# (layout, checkpoint format of its link, the link's Ctrl-C: (global_step, micro-batch) → checkpoint at step + 1)
CHAINS = {
    "a": [("one", "single", (2, 1)), ("ddp", "sharded", (4, 0)), ("zero3", "single", (7, 2)),
          ("pp", "sharded", (8, 1)), ("tp", "single", (9, 3)), ("zero1", "sharded", None)],
    "b": [("zero2", "single", (2, 0)), ("hsdp", "sharded", (5, 1)), ("cp", "single", (7, 3)), ("one", "single", None)],
    "c": [("one", "sharded", (2, 1)), ("ep2", "single", (5, 0)), ("ep2_zero3", "single", (8, 1)),
          ("one", "single", None)],
}
MODEL = {"c": MOE}  # the chains' model beside tiny.yaml's dense one


@pytest.fixture(scope="session")
def short_corpus(tmp_path_factory) -> list:
    """10 documents of the default corpus: 118 train windows of 64 tokens, so an epoch is 7 steps of 16 (the
    remainder skipped), and 418 validation windows."""
    folder = tmp_path_factory.mktemp("prepared") / "stdlib-10"
    overrides = [f"data.prepared_dir={folder}", "data.max_documents=10", "data.vocab_size=512",
                 "data.val_fraction=0.3"]
    run_module("lit_pretrain.cli", "prepare", str(EXPERIMENTS / "runs" / "tiny.yaml"), *overrides)
    return overrides


def train(root: Path, name: str, corpus: list, *overrides, fault=None, rc=0):
    extra = []
    if fault is not None:
        spec = {"step": fault[0], "micro_batch": fault[1], "signal": "INT"}
        extra = [f"callbacks.extra=[{{class_path: 'tests.helpers.resume_helpers:Fault', init_args: "
                 f"{json.dumps(spec)}}}]"]
    return run_module("lit_pretrain.cli", "train", str(EXPERIMENTS / "runs" / "tiny.yaml"), *corpus,
                      f"run.root_dir={root}", f"run.name={name}", *COMMON, *overrides, *extra, rc=rc,
                      start_new_session=True)


@pytest.fixture(scope="session")
def references(tmp_path_factory, short_corpus):
    """The uninterrupted one-process run of a model (overrides), trained once per session."""
    root, done = tmp_path_factory.mktemp("transitions"), {}

    def get(model: tuple) -> Path:
        if model not in done:
            name = f"ref{len(done)}"
            train(root, name, short_corpus, *LAYOUTS["one"][0], *model)
            done[model] = root / name
        return done[model]

    return get


def rows(run_dir: Path) -> list:
    return read_metrics(run_dir / "metrics.csv")


def by_step(run_dir: Path, key: str) -> dict:
    out = {}
    for r in rows(run_dir):
        if key in r:
            assert r["step"] not in out, (key, r["step"])  # each step's value logged once, resumes included
            out[r["step"]] = r[key]
    return out


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_layout_chain_equals_the_uninterrupted_run(chain, references, short_corpus, tmp_path):
    links, model = CHAINS[chain], MODEL.get(chain, [])
    reference = references(tuple(model))
    run = tmp_path / chain
    # The chain changes accumulation both ways somewhere (the bug: Lightning counted the accumulation's phase
    # and the validation interval in the micro-batches of the layout that wrote the checkpoint).
    accumulation = [LAYOUTS[layout][1] for layout, _, _ in links]
    assert any(a < b for a, b in zip(accumulation, accumulation[1:]))
    assert any(a > b for a, b in zip(accumulation, accumulation[1:]))
    stops = []
    for i, (layout, fmt, fault) in enumerate(links):
        resume = ["run.resume=auto"] if i else []
        out = train(tmp_path, chain, short_corpus, *LAYOUTS[layout][0], *model, f"checkpoint.format={fmt}", *resume,
                    fault=fault, rc=130 if fault is not None else 0)
        if fault is not None:  # Ctrl-C: the checkpoint of the next step boundary, then the way back
            stop = fault[0] + 1
            assert out.stdout.splitlines()[-1].startswith(f"interrupted: checkpoint at step {stop} written"), layout
            assert (run / "checkpoints" / "latest").read_text().strip().startswith(f"step{stop:07d}")
            stops.append(stop)
    assert {s % 2 for s in stops} == {0, 1}  # odd and even resume steps

    # metrics.csv: the same rows (step labels and keys, in order) as the uninterrupted run.
    # Pipeline parallelism adds its own diagnostics (pipeline/bubble_formula, pipeline/idle_fraction) to the rows it
    # trains: a layout's own keys, not a step's.
    def shape(run_dir):
        return [(r["step"], sorted(k for k in r if not k.startswith("pipeline/"))) for r in rows(run_dir)]

    assert shape(run) == shape(reference)
    # The layouts sum the same windows in other orders (data-parallel means, sharded and row-parallel sums, pipeline
    # micro-batches): tests/strategy/test_strategies_parity.py measured losses within 9.5e-7 of one process over a run;
    # 1e-5 keeps a 10x margin across 12 steps of drift, while one step of other data moves a loss by 1e-3 or more.
    for key in ("train/loss", "val/loss"):
        a, b = by_step(reference, key), by_step(run, key)
        assert sorted(b) == sorted(a), key  # validation ran at the same steps (3, 6, 9, 12)
        assert [b[k] for k in sorted(b)] == pytest.approx([a[k] for k in sorted(a)], abs=1e-5), key
    assert sorted(by_step(run, "val/loss")) == [3, 6, 9, 12]
    for key in ("train/lr", "train/tokens_seen"):  # functions of the step alone: exact
        assert by_step(run, key) == by_step(reference, key), key
    assert (run / "checkpoints" / "latest").read_text().strip() == (
        reference / "checkpoints" / "latest").read_text().strip().removesuffix(".ckpt") + (
        ".ckpt" if links[-1][1] == "single" else "")

    ref_summary, summary = (json.loads((d / "summary.json").read_text()) for d in (reference, run))
    for key in ("status", "steps", "max_steps", "tokens_seen", "tokens_per_step", "tokens_per_param", "params",
                "resume_step", "epochs"):
        assert summary[key] == ref_summary[key], key
    for key in ("final_train_loss", "final_val_loss"):
        assert summary[key] == pytest.approx(ref_summary[key], abs=1e-5), key
    assert summary["status"] == "finished" and summary["epochs"] > 1  # the run crossed an epoch boundary
    table, ref_table = (run_table.row(run_table.read_run(d), active_minutes=0) for d in (run, reference))
    for key in ("steps", "tokens", "status"):
        assert table[key] == ref_table[key], key
    for key in ("train loss", "val loss"):
        assert table[key] == pytest.approx(ref_table[key], abs=1e-5), key
