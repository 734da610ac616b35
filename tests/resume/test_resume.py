"""Kill anywhere and continue bit for bit: SIGKILL and SIGTERM injected into real `lit-pretrain train` runs
(subprocesses: SIGKILL must not take pytest with it), resumed with run.resume, compared with runs never interrupted.

Runs: 6 optimizer steps of 2 micro-batches (trainer.tokens_per_step=1024 = 2 × 8 × 64), a checkpoint every 2 steps.
Faults: SIGKILL in the middle of an accumulation (second micro-batch of a step) and at a step boundary that no
checkpoint follows (start of step 6); SIGTERM during step 4 (the checkpoint comes at the next boundary).
Equality is bitwise (torch.equal, exact floats in metrics.csv): same process count, same data, same RNG, same
kernels, so any difference is a resume bug, not rounding. Across process counts the windows of each step are
compared exactly and the losses within a justified float tolerance.

Every run trains on a two-source mixture (data.sources: the tiny corpus at weight 1 and a second source at weight 3,
switched to 3:1 from step 3 by data.mixture_schedule), so the kills land before and after the switch and the
mixture's per-source positions are resumed across 1, 2 and tensor-parallel processes; the single-corpus order is
the same TrainLoader machinery, covered in-process by tests/data/test_data.py and tests/resume/test_resume_state.py.
"""

import importlib.util
import json
import shlex
import signal
from pathlib import Path

import pytest
import torch

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.optim.named_state import single_process_names, to_positions
from lit_pretrain.resume import store
from lit_pretrain.resume.preemption import resume_command
from lit_pretrain.resume.sharded.tools import consolidate
from lit_pretrain.resume.verified import load_verified, save_atomic
from lit_pretrain.resume.weights import HPARAMS_KEY, from_plain, load_gpt, load_optimizer_state, read_checkpoint
from lit_pretrain.runs import table as run_table
from lit_pretrain.runs.compare import compare, panels
from lit_pretrain.runs.folder import read_metrics, series
from lit_pretrain.schema import OptimConfig
from tests.conftest import ROOT, launcher_env, run_module, train_args
from tests.helpers.global_sizes import assert_global_sizes

pytestmark = pytest.mark.slow

STEPS = 6  # optimizer steps
COMMON = [f"trainer.max_steps={STEPS}", "trainer.val_every_n_steps=3", "trainer.log_every_n_steps=1",
          "schedule.warmup_steps=2", "trainer.tokens_per_step=1024", "trainer.checkpoint_every_n_steps=2",
          "trainer.progress_bar=false", "strategy.timeout_seconds=60", "trainer.val_windows=16"]
DDP = ["strategy=ddp", "trainer.devices=2", "trainer.micro_batch_size=4"]


def mixture(tiny_data_dir: Path) -> list:
    """Two sources sharing the tiny corpus's tokenizer; the second (100 documents) is prepared by the first run."""
    second = tiny_data_dir.parent / f"{tiny_data_dir.name}-b"
    return [f"data.sources=[{{name: tiny, prepared_dir: '{tiny_data_dir}'}}, {{name: second, prepared_dir: "
            f"'{second}', max_documents: 100, split_seed: 7, val_fraction: 0.05, weight: 3}}]",
            "data.mixture_schedule=[{step: 3, weights: {tiny: 3, second: 1}}]", "data.deduplication.processes=1"]


def extra(*specs) -> str:
    items = ", ".join(f"{{class_path: 'tests.helpers.resume_helpers:{cls}', init_args: {json.dumps(args)}}}"
                      for cls, args in specs)
    return f"callbacks.extra=[{items}]"


# Session scope (one per xdist worker): `make test` orders the long tests first (tests/helpers/longest_first.py), which
# splits this file's tests apart; a module fixture would then train its references again.
@pytest.fixture(scope="session")
def train(tmp_path_factory, tiny_data_dir):
    root = tmp_path_factory.mktemp("resume_runs")

    def run(name, *overrides, faults=(), record=False, rc=0, slow_write=None):
        specs = [("Fault", f) for f in faults]
        if slow_write is not None:
            specs.append(("SlowWrite", {"step": slow_write}))
        if record:
            specs.append(("RecordIndices", {"out": str(root / f"{name}.indices")}))
        # A new session: the injected SIGKILL takes down the run's process group (every rank), not pytest.
        out = run_module(*train_args(tiny_data_dir, root, name), *COMMON, *mixture(tiny_data_dir), *overrides,
                         *([extra(*specs)] if specs else []), rc=rc, start_new_session=True)
        return root / name, out

    return run


def losses(run_dir: Path):
    return series(read_metrics(run_dir / "metrics.csv"), "train/loss")


def weights(run_dir: Path):
    """The newest checkpoint's weights: last.ckpt of a one-file run, the folder `latest` names of a sharded one."""
    return read_checkpoint(run_dir)["state_dict"]


def assert_same_run(ref: Path, run: Path, first_step: int = 0):
    """Per-step losses (each step logged once, at the steps completed: first_step + 1 .. STEPS after a resume from
    the checkpoint of first_step) and final weights bitwise equal."""
    a, b = dict(losses(ref)), losses(run)
    assert [s for s, _ in b] == list(range(first_step + 1, STEPS + 1)), b  # each step once, none missing
    assert b == [(k, a[k]) for k in range(first_step + 1, STEPS + 1)]  # exact floats: the CSV holds repr-exact values
    # Every other row too (validation, gradient norm, throughput, lr): the same keys at the same step tags in the
    # same order, none lost or repeated across the kills; throughput values are timings and differ.
    rows = [[(r["step"], sorted(r)) for r in read_metrics(d / "metrics.csv")] for d in (ref, run)]
    assert rows[0] == rows[1]
    wa, wb = weights(ref), weights(run)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def global_indices(prefix: Path, rank: str = "*"):
    """{step: sorted window indices of every micro-batch of that step, over all ranks (or the one given)}."""
    out = {}
    for path in prefix.parent.glob(f"{prefix.name}.rank{rank}.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out.setdefault(row["step"], []).extend(row["indices"])
    return {k: sorted(v) for k, v in out.items()}


def latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def assert_same_windows(ref: Path, run: Path, steps):
    ref_idx = global_indices(ref.parent / f"{ref.name}.indices")
    assert global_indices(run.parent / f"{run.name}.indices") == {k: ref_idx[k] for k in steps}


def assert_close_losses(ref: Path, run: Path, steps):
    """The losses of the steps trained after `steps` were completed (metrics rows steps + 1, as global_indices'
    keys are the steps completed before a step's windows)."""
    # The same windows per step on 1 or 2 processes; the runs differ only in float summation order (two 4-sample
    # gradient means averaged vs one 8-sample mean): tests/strategy/test_strategies_parity.py measured losses within
    # 9.5e-7 of each other that way; 1e-5 keeps its 10x margin, while another seed moves a loss by 1.3e-3 or more.
    a, b = dict(losses(ref)), dict(losses(run))
    steps = [k + 1 for k in steps]
    assert sorted(b) == steps
    assert [b[k] for k in steps] == pytest.approx([a[k] for k in steps], abs=1e-5)


@pytest.fixture(scope="session")
def single_ref(train):
    return train("single-ref", record=True)[0]


@pytest.fixture(scope="session")
def ddp_ref(train, single_ref):
    """The uninterrupted 2-process DDP run resumed from the single-process step-2 checkpoint: the DDP test's
    reference and, through its sharded step-4 folder, the ZeRO-3 test's starting point."""
    return train("ddp-ref", *DDP, f"run.resume={single_ref / 'checkpoints' / store.step_file(2)}", record=True)[0]


def test_single_process_sigkill_twice_sigterm_and_ctrl_c(train, single_ref, tiny_data_dir):
    """SIGKILL before the first checkpoint, SIGKILL mid-accumulation, SIGTERM, SIGKILL at a step no checkpoint
    follows, Ctrl-C: bitwise the uninterrupted run."""
    # SIGKILL before the first checkpoint, with step 1's metrics row on disk: run.resume=auto starts the run again
    # (then SIGKILL mid-accumulation), the killed attempt's files kept in attempts/1/.
    run, _ = train("single", faults=[{"step": 1, "micro_batch": 1, "flush": True}], rc=-signal.SIGKILL)
    killed = read_metrics(run / "metrics.csv")
    assert killed and not (run / "checkpoints" / "latest").exists()
    _, out = train("single", "run.resume=auto", faults=[{"step": 3, "micro_batch": 1}], rc=-signal.SIGKILL)
    assert f"the earlier attempt's files are kept in {run / 'attempts' / '1'}" in out.stdout
    assert read_metrics(run / "attempts" / "1" / "metrics.csv") == killed
    assert (run / "attempts" / "1" / "config.yaml").is_file()
    assert latest(run) == "step0000002.ckpt"
    assert summary(run)["status"] == "running"  # killed: nothing wrote its end (`runs` asks the folder's lock)
    assert run_table.status(run_table.read_run(run)) == "killed, resumes from step 2"
    # SIGTERM during step 4, periodic checkpoints off: a checkpoint at the next boundary, after step 4; exit code 0.
    _, out = train("single", "run.resume=auto", "trainer.checkpoint_every_n_steps=0",
                   faults=[{"step": 3, "signal": "TERM"}])
    assert "resuming from" in out.stdout and "(step 2)" in out.stdout
    assert "preemption: checkpoint at step 4 written" in out.stdout and latest(run) == "step0000004.ckpt"
    # It stopped at that checkpoint (no step 5 trained after it), and every place says step 4 of 6, preempted.
    assert "4 steps, " in out.stdout
    s = summary(run)
    assert (s["status"], s["steps"], s["max_steps"], s["resume_step"], s["stop_signal"], s["tokens_seen"]) == \
        ("preempted", 4, STEPS, 4, "SIGTERM", 4 * 1024)
    assert max(step for step, _ in losses(run)) == 4
    assert run_table.row(run_table.read_run(run))["status"] == "preempted, resumes from step 4"
    notes = compare([str(single_ref), str(run)], str(run.parent / "compare.png"))
    assert notes[0] == "single: preempted, resumes from step 4; 4 of 6 steps"
    # SIGKILL at the start of step 6 (no checkpoint after step 5): the resume redoes step 5 from the step-4 one.
    train("single", "run.resume=auto", "trainer.checkpoint_every_n_steps=4", faults=[{"step": 5}],
          rc=-signal.SIGKILL)
    assert latest(run) == "step0000004.ckpt"
    # Ctrl-C (SIGINT to the process group, as a terminal sends it) mid-accumulation of step 5: a checkpoint at the
    # next boundary, exit 130, and one line whose command, run again, continues the run.
    fault = {"step": 4, "micro_batch": 1, "signal": "INT"}
    _, out = train("single", "run.resume=auto", "trainer.checkpoint_every_n_steps=0", faults=[fault], rc=130)
    assert latest(run) == "step0000005.ckpt" and "preemption:" not in out.stdout
    assert "Ctrl-C: a checkpoint at the next optimizer step" in out.stderr
    command = [*train_args(tiny_data_dir, run.parent, "single")[1:], *COMMON, *mixture(tiny_data_dir),
               "trainer.checkpoint_every_n_steps=0", extra(("Fault", fault)), "run.resume=auto"]
    # the program as it ran: this interpreter (run_module's), typed from the folder the run started in
    program = resume_command(["cli.py"], cwd=str(ROOT), search_path=launcher_env().get("PATH")).removesuffix(
        " run.resume=auto")
    assert out.stdout.splitlines()[-1] == ("interrupted: checkpoint at step 5 written; resume with: "
                                           f"{program} {shlex.join(command)}")
    _, out = train("single", "run.resume=auto", record=True)
    assert "(step 5)" in out.stdout
    assert_same_run(single_ref, run)
    assert_same_windows(single_ref, run, (5,))  # the data after the last resume
    assert_one_step_count(run, out.stdout)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def assert_one_step_count(run: Path, stdout: str):
    """After STEPS optimizer steps with validation every 3 (and six attempts: SIGKILL twice, SIGTERM, SIGKILL, Ctrl-C),
    every place counts optimizer steps completed: metrics.csv's train rows 1..6 (assert_same_run) and validation
    rows 3 and 6 (what loss_curve.png plots: runs.series), TensorBoard's events, the checkpoint names, summary.json,
    `runs`, the console and `compare` (which plots tokens = step × tokens_per_step)."""
    rows = read_metrics(run / "metrics.csv")
    assert [s for s, _ in series(rows, "val/loss")] == [3, 6]
    assert [s for s, _ in series(rows, "train/tokens_seen")] == list(range(1, STEPS + 1))
    assert all(r["train/tokens_seen"] == r["step"] * 1024 for r in rows if "train/tokens_seen" in r)
    assert sorted({int(r["step"]) for r in rows}) == list(range(1, STEPS + 1))  # every monitor's rows too
    # every 2 steps, plus the Ctrl-C's at step 5
    assert sorted(p.name for p in (run / "checkpoints").glob("step*.ckpt")) == \
        ["step0000002.ckpt", "step0000004.ckpt", "step0000005.ckpt", "step0000006.ckpt"]
    s = summary(run)
    assert (s["status"], s["steps"], s["max_steps"], s["resume_step"]) == ("finished", STEPS, STEPS, None)
    assert run_table.row(run_table.read_run(run))["steps"] == STEPS
    assert run_table.status(run_table.read_run(run)) == "finished"
    assert f"{STEPS} steps, " in stdout
    panel = panels([run_table.read_run(run)])["loss_tokens"]
    assert {line.label: line.x for line in panel.lines} == {"single train": [k * 1024.0 for k in range(1, 7)],
                                                           "single val": [3 * 1024.0, 6 * 1024.0]}
    if importlib.util.find_spec("tensorboard") is None:
        return  # the logging extra (lit-pretrain[logging]) is not installed: no TensorBoard events to read
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))  # every attempt's events: some steps twice, none shifted
    events.Reload()
    assert {e.step for e in events.Scalars("train/loss")} == set(range(1, STEPS + 1))
    assert {e.step for e in events.Scalars("val/loss")} == {3, 6}


def test_ddp_sigkill_twice_and_world_size_changes(train, single_ref, ddp_ref):
    """1 → 2 processes from step 2; on 2 processes (sharded checkpoints, the default there) Ctrl-C to rank 0 alone,
    SIGKILL of every rank mid-accumulation, SIGKILL in the middle of an asynchronous checkpoint write and Ctrl-C to
    every rank, each time bitwise the uninterrupted 2-process run; 2 → 1 process from step 4 (a sharded folder into
    one process). Windows always the global sequence."""
    step2 = single_ref / "checkpoints" / store.step_file(2)
    ref = ddp_ref
    assert (ref / "checkpoints" / "step0000004" / "manifest.json").is_file()  # sharded by default on 2 processes
    assert_same_windows(single_ref, ref, range(2, STEPS))
    assert_close_losses(single_ref, ref, range(2, STEPS))
    # Ctrl-C reaching rank 0 alone (`kill -INT`) mid-accumulation of step 3: every rank stops after the step-3
    # checkpoint, exit 130.
    run, out = train("ddp", *DDP, f"run.resume={step2}", faults=[{"step": 2, "micro_batch": 1, "signal": "INT0"}],
                     rc=130)
    assert latest(run) == "step0000003"
    assert out.stdout.splitlines()[-1].startswith("interrupted: checkpoint at step 3 written; resume with: ")
    train("ddp", *DDP, "run.resume=auto", faults=[{"step": 4, "micro_batch": 1}], rc=-signal.SIGKILL)
    assert latest(run) == "step0000004"
    # A checkpoint after every step, written in the background; step 5's write sleeps (SlowWrite) and every rank is
    # killed during it: only its hidden staging folder exists, without a manifest; `latest` still names step 4.
    train("ddp", *DDP, "run.resume=auto", "checkpoint.async_save=true", "trainer.checkpoint_every_n_steps=1",
          faults=[{"step": 5, "micro_batch": 1}], slow_write=5, rc=-signal.SIGKILL)
    staging = run / "checkpoints" / ".step0000005.saving"
    assert latest(run) == "step0000004" and not (run / "checkpoints" / "step0000005").exists()
    assert staging.is_dir() and not (staging / "manifest.json").exists()
    # Ctrl-C from a terminal (SIGINT to every rank) mid-accumulation of step 5: the step-5 checkpoint, exit 130.
    _, out = train("ddp", *DDP, "run.resume=auto", faults=[{"step": 4, "micro_batch": 1, "signal": "INT"}], rc=130)
    assert latest(run) == "step0000005"
    assert out.stdout.splitlines()[-1].startswith("interrupted: checkpoint at step 5 written; resume with: ")
    assert not staging.exists()  # the next save tidied it
    train("ddp", *DDP, "run.resume=auto")
    assert_same_run(ref, run, first_step=2)
    back, _ = train("ddp-to-single", f"run.resume={ref / 'checkpoints' / store.step_dir(4)}", record=True)
    assert_same_windows(single_ref, back, (4, 5))
    assert_close_losses(single_ref, back, (4, 5))


ZERO3 = ["strategy=zero", "trainer.devices=2", "trainer.micro_batch_size=4"]
ZERO2 = [*ZERO3, "strategy.zero_stage=2"]


def test_zero3_resumes_the_ddp_sharded_folder_and_sigkill(train, single_ref, ddp_ref):
    """ZeRO-3 on 2 processes resumes the DDP run's sharded step-4 folder (resharded into FSDP shards), is killed
    mid-accumulation, and resumes bitwise its own uninterrupted run from its own one-file checkpoint (the state
    gathered by name onto rank 0, then sliced into each rank's shards). Apart from the DDP test (it needs only the
    DDP reference's step-4 folder) so that xdist runs the two side by side."""
    ref = ddp_ref
    ddp_step4 = ref / "checkpoints" / store.step_dir(4)
    zero_ref, _ = train("zero3-ref", *ZERO3, f"run.resume={ddp_step4}")
    assert_close_losses(single_ref, zero_ref, (4, 5))
    zero_run, _ = train("zero3", *ZERO3, f"run.resume={ddp_step4}", "trainer.checkpoint_every_n_steps=1",
                        "checkpoint.format=single", faults=[{"step": 5, "micro_batch": 1}], rc=-signal.SIGKILL)
    assert latest(zero_run) == store.step_file(5)
    named = [list(read_checkpoint(r)["optimizer_states"][0]["state"]) for r in (zero_run, single_ref)]
    assert named[0] == named[1]  # ZeRO-3's own file keys the state by parameter name, as one process's does
    train("zero3", *ZERO3, "run.resume=auto", "checkpoint.format=single")
    assert_same_run(zero_ref, zero_run, first_step=4)


def numbered_as_before(path: Path, out: Path) -> Path:
    """A copy of one-file checkpoint `path` with its optimizer state numbered by position in the groups, as every
    one-process, DDP and ZeRO-1 file was before the state was keyed by name."""
    checkpoint = load_verified(path)
    hparams = checkpoint[HPARAMS_KEY]
    names = single_process_names(from_plain(GPTConfig, hparams["model_cfg"]), from_plain(OptimConfig, hparams["optim"]))
    checkpoint["optimizer_states"] = [to_positions(checkpoint["optimizer_states"][0], names.groups, path)]
    save_atomic(checkpoint, out)
    return out


def test_one_file_checkpoints_resume_under_zero2_and_zero3(train, single_ref, ddp_ref, tmp_path):
    """One-file checkpoints of other layouts resume under plain ZeRO-2 and ZeRO-3 on 2 processes, each continuing
    with one process's losses: the single-process step-2 file (its AdamW state keyed by parameter name) under
    ZeRO-3; its step-4 file renumbered by position in the groups, as files were written before, under ZeRO-2;
    `checkpoint consolidate` of the DDP run's sharded step-4 folder under ZeRO-2. (Before, Lightning's loading read
    every such file as if numbered by `model.parameters()`: every rank died on a shape mismatch.)"""
    step2 = single_ref / "checkpoints" / store.step_file(2)
    saved = read_checkpoint(step2)["optimizer_states"][0]  # by name: every parameter of the GPT once
    assert list(saved["state"]) == [n for g in saved["param_groups"] for n in g["params"]]
    assert set(saved["state"]) == {n for n, _ in load_gpt(step2).named_parameters()}
    zero3, _ = train("zero3-from-single", *ZERO3, f"run.resume={step2}")
    assert_close_losses(single_ref, zero3, range(2, STEPS))
    old = numbered_as_before(single_ref / "checkpoints" / store.step_file(4), tmp_path / "step0000004.ckpt")
    zero2, _ = train("zero2-from-old-file", *ZERO2, f"run.resume={old}")
    assert_close_losses(single_ref, zero2, (4, 5))
    one_file = consolidate(ddp_ref / "checkpoints" / store.step_dir(4), tmp_path / "consolidated.ckpt")
    zero2, _ = train("zero2-from-consolidated", *ZERO2, f"run.resume={one_file}")
    assert_close_losses(single_ref, zero2, (4, 5))


def test_zero3_tensor_parallel_resume_from_single_process_and_sigkill(train, single_ref):
    """A single-process checkpoint resumed under ZeRO-3 x tensor parallelism (4 ranks: 2 FSDP shards x TP 2), SIGKILL
    of every rank mid-accumulation, resumed again: bitwise the uninterrupted run of the same layout from the same
    checkpoint, and the same windows as one process (the TP ranks of a shard read that shard's half of the batch)."""
    # Micro-batches of 4 on each of the 2 shards: 2 per optimizer step, as in one process (8 x 2), so the SIGKILL
    # below still lands mid-accumulation.
    layout = ["strategy=tensor", "strategy.zero_stage=3", "trainer.devices=4", "trainer.micro_batch_size=4"]
    step2 = single_ref / "checkpoints" / store.step_file(2)
    ref, _ = train("zero3-tp2-ref", *layout, f"run.resume={step2}", record=True)
    expected = global_indices(single_ref.parent / f"{single_ref.name}.indices")
    prefix = ref.parent / "zero3-tp2-ref.indices"
    for a, b in ((0, 1), (2, 3)):  # tensor-parallel peers read the same windows
        assert global_indices(prefix, rank=str(a)) == global_indices(prefix, rank=str(b)), (a, b)
    halves = [global_indices(prefix, rank=str(r)) for r in (0, 2)]
    for k in range(2, STEPS):  # the two data-parallel shards split each global batch of one process
        assert sorted(halves[0][k] + halves[1][k]) == expected[k] and not set(halves[0][k]) & set(halves[1][k])
    assert_close_losses(single_ref, ref, range(2, STEPS))  # sharded and row-parallel sums: another order
    assert_global_sizes(ref)  # summary.json and MFU: the whole model's sizes, not a rank's part
    run, _ = train("zero3-tp2", *layout, f"run.resume={step2}", faults=[{"step": 4, "micro_batch": 1}],
                   rc=-signal.SIGKILL)
    assert latest(run) == "step0000004"
    train("zero3-tp2", *layout, "run.resume=auto")
    assert_same_run(ref, run, first_step=2)


def test_context_parallel_zero3_resume_from_single_process_and_sigkill(train, single_ref):
    """A single-process checkpoint resumed under CP 2 x ZeRO-3 (2 processes: FSDP2 shards over the two
    context-parallel ranks, which share every micro-batch), SIGKILL of every rank mid-accumulation, resumed again:
    bitwise the uninterrupted run of the same layout from the same checkpoint; both ranks read one process's windows,
    and the losses are one process's up to float order. Then ZeRO-1 x CP 2 from its sharded step-4 folder, resumed
    from its own one-file checkpoint: bitwise."""
    # Micro-batches of 8 windows of 64: the one data-parallel rank takes 2 a step, as one process, so the SIGKILL
    # below lands mid-accumulation.
    layout = ["strategy=zero", "strategy.context_parallel=2", "trainer.devices=2", "trainer.micro_batch_size=8"]
    step2 = single_ref / "checkpoints" / store.step_file(2)
    ref, out = train("cp2-zero3-ref", *layout, f"run.resume={step2}", record=True)
    # The plan line and memory.json name the layout that ran, context parallelism included (on main: no CP degree
    # in the line, and memory.json said only the preset's name)
    assert [line for line in out.stdout.splitlines() if line.startswith("plan: ")] == [
        "plan: data parallel 1 replicate x 1 shard (ZeRO stage 3), context parallel 2, tensor parallel 1, pipeline "
        "parallel 1, expert parallel 1; micro-batch 8 x seq_len 64 x data-parallel degree 1 x accumulation 2 = 1,024 "
        "tokens per step"]
    memory = json.loads((ref / "memory.json").read_text())
    assert (memory["context_parallel"], memory["strategy_preset"]) == (2, "zero")
    assert "context parallel 2" in memory["strategy"]
    expected = global_indices(single_ref.parent / f"{single_ref.name}.indices")
    prefix = ref.parent / "cp2-zero3-ref.indices"
    for rank in ("0", "1"):  # context-parallel peers read the same windows, one process's
        assert global_indices(prefix, rank=rank) == {k: expected[k] for k in range(2, STEPS)}, rank
    # Attention's keys gathered and the loss summed over the two halves of each window: another float order. The
    # losses measured within 1e-6 of one process's; assert_close_losses' 1e-5 keeps its margin.
    assert_close_losses(single_ref, ref, range(2, STEPS))
    assert_global_sizes(ref)  # summary.json and MFU: the whole model's sizes and the global tokens
    run, _ = train("cp2-zero3", *layout, f"run.resume={step2}", faults=[{"step": 4, "micro_batch": 1}],
                   rc=-signal.SIGKILL)
    assert latest(run) == "step0000004"
    train("cp2-zero3", *layout, "run.resume=auto")
    assert_same_run(ref, run, first_step=2)
    # ZeRO-1 x CP 2 (ZeroRedundancyOptimizer over the context-parallel pair): the ZeRO-3 run's sharded step-4 folder
    # resharded into it, then one-file checkpoints (the whole optimizer state consolidated by name on rank 0) after
    # steps 5 and 6; resumed from step 5's file, step 6 is bitwise the run's.
    zero1 = [*layout, "strategy.zero_stage=1", "checkpoint.format=single", "trainer.checkpoint_every_n_steps=1"]
    zero1_ref, _ = train("cp2-zero1-ref", *zero1, f"run.resume={ref / 'checkpoints' / store.step_dir(4)}")
    assert_close_losses(single_ref, zero1_ref, (4, 5))
    step5 = zero1_ref / "checkpoints" / store.step_file(5)
    one = load_optimizer_state(step5)  # the file reads into one process: AdamW's state of every parameter, at step 5
    assert len(one.state) == sum(len(g["params"]) for g in one.param_groups)
    assert {int(s["step"]) for s in one.state.values()} == {5}
    zero1_run, _ = train("cp2-zero1", *zero1, f"run.resume={step5}")
    assert losses(zero1_run) == [(6, dict(losses(zero1_ref))[6])]
    wa, wb = weights(zero1_ref), weights(zero1_run)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (read_checkpoint(r)["optimizer_states"][0]["state"] for r in (zero1_ref, zero1_run))
    assert sa.keys() == sb.keys() and all(torch.equal(v, sb[i][k]) for i in sa for k, v in sa[i].items())
