"""Paths: a run name is never a path; the project deletes or replaces only inside folders it made; a failed start
leaves nothing that blocks its retry."""

import json
import warnings
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from lit_pretrain import cli, config
from lit_pretrain.errors import ConfigError, DataError, RunFolderError
from lit_pretrain.runs.folder import create_run_dir
from lit_pretrain.train import train
from tests.conftest import EXPERIMENTS, tiny_data_overrides

RUN_FILE = str(EXPERIMENTS / "runs" / "tiny.yaml")
BAD_NAMES = [".", "..", "/abs", "../../x", "a/b", "a b", "a\nb", "x" * 200]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_a_run_name_that_is_not_one_safe_folder_name_is_refused_when_the_config_loads(name, tmp_path, capsys):
    # Through a YAML file, so the newline reaches the loader as it is (a command-line override would fold it).
    run_file = tmp_path / "run.yaml"
    run_file.write_text(json.dumps({"run": {"name": name}}))
    with pytest.raises(ConfigError, match=r"run\.name") as err:
        config.load(run_file)
    assert "\n" not in str(err.value)
    assert cli.main(["show", str(run_file)]) == 2
    out = capsys.readouterr()
    assert "run.name" in out.err and out.err.strip().count("\n") == 0 and out.out == ""


def test_safe_names_still_load():
    for name in ("tiny", "c1.5e16_L2_d64", "run-7", "..x", "x" * 128):
        assert config.load(RUN_FILE, [f"run.name={name}"]).run.name == name


def precious_tree(tmp_path):
    """home/runs/other (a finished run of the project) and home/sentinel (anything else): nothing may delete them.
    One level down, so that even `../../` from runs/ stays inside tmp_path when the base commit deletes it."""
    home = tmp_path / "home"
    root = home / "runs"
    other = create_run_dir(str(root), "other", overwrite=False)
    (other / "checkpoints" / "step0000010.ckpt").write_bytes(b"weeks of training")
    sentinel = home / "sentinel"
    sentinel.mkdir()
    (sentinel / "keep.txt").write_text("not the project's")
    return root, other, sentinel


@pytest.mark.parametrize("name", [".", "..", "SENTINEL", "../sentinel", "../../"])
def test_overwrite_never_deletes_outside_the_run_folder(name, tmp_path):
    root, other, sentinel = precious_tree(tmp_path)
    name = str(sentinel) if name == "SENTINEL" else name
    with pytest.raises(RunFolderError):
        create_run_dir(str(root), name, overwrite=True)
    assert (other / "checkpoints" / "step0000010.ckpt").read_bytes() == b"weeks of training"
    assert (sentinel / "keep.txt").is_file() and root.is_dir()


def test_overwrite_deletes_only_a_run_folder_the_project_made(tmp_path):
    root, _, sentinel = precious_tree(tmp_path)
    foreign = root / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("not a run")
    with pytest.raises(RunFolderError, match=r"not made by lit-pretrain"):
        create_run_dir(str(root), "mine", overwrite=True)
    assert (foreign / "thesis.tex").is_file()
    # A folder of a version before the marker: its config.yaml names the run, so overwrite may delete it.
    legacy = root / "legacy"
    (legacy / "checkpoints").mkdir(parents=True)
    (legacy / "checkpoints" / "last.ckpt").write_bytes(b"old")
    (legacy / "config.yaml").write_text("run:\n  name: legacy\n")
    create_run_dir(str(root), "legacy", overwrite=True)
    assert not (legacy / "checkpoints" / "last.ckpt").exists() and (legacy / ".lit-pretrain-run").is_file()
    # Ours (marker) and holding a checkpoint: refused without overwrite, started again with it.
    with pytest.raises(RunFolderError, match=r"already exists.*run\.overwrite=true"):
        create_run_dir(str(root), "other", overwrite=False)
    create_run_dir(str(root), "other", overwrite=True)
    assert not any((root / "other" / "checkpoints").iterdir())


def test_a_symlinked_run_folder_is_refused(tmp_path):
    root, _, sentinel = precious_tree(tmp_path)
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    (root / "linked").symlink_to(empty)
    (root / "linked-full").symlink_to(sentinel)
    with pytest.raises(RunFolderError, match=r"symbolic link"):
        create_run_dir(str(root), "linked", overwrite=False)
    assert not any(empty.iterdir())  # nothing written through the link
    with pytest.raises(RunFolderError, match=r"symbolic link"):
        create_run_dir(str(root), "linked-full", overwrite=True)
    assert (sentinel / "keep.txt").is_file()


def test_root_dir_itself_and_anything_outside_are_never_deleted(tmp_path):
    from lit_pretrain.paths import is_inside, safe_rmtree, safe_unlink

    root, _, sentinel = precious_tree(tmp_path)
    for folder in (root, root / ".", root / "other" / "..", sentinel, tmp_path / "home"):
        with pytest.raises(RunFolderError):
            safe_rmtree(folder, root, lambda _: True, "folder")
    assert root.is_dir() and (sentinel / "keep.txt").is_file()
    assert not is_inside(root, root) and is_inside(root, root / "other")
    import re

    assert not safe_unlink(sentinel / "keep.txt", root, re.compile(r".*"))
    assert (sentinel / "keep.txt").is_file()


def test_a_folder_left_by_a_failed_start_is_reused_without_overwrite(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    run_dir = create_run_dir(str(root), "again", overwrite=False)
    (run_dir / "config.yaml").write_text("run:\n  name: again\n")
    (run_dir / "metrics.csv").write_text("step,train/loss\n")  # a header, no row
    assert create_run_dir(str(root), "again", overwrite=False) == run_dir
    assert not (run_dir / "config.yaml").exists()
    # What a failed start of a version before the marker left: only an empty checkpoints/ folder.
    (root / "old" / "checkpoints").mkdir(parents=True)
    create_run_dir(str(root), "old", overwrite=False)
    # A metrics row or a checkpoint is a run's result: not reused, not removed after a failure.
    (run_dir / "metrics.csv").write_text("step,train/loss\n0,6.2\n")
    with pytest.raises(RunFolderError, match=r"already exists"):
        create_run_dir(str(root), "again", overwrite=False)
    from lit_pretrain.runs.folder import remove_failed_start

    assert not remove_failed_start(str(root), run_dir) and run_dir.is_dir()
    # Only the primary process creates or removes run folders (the others use the one rank 0 made).
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not create_run_dir(str(root), "other-rank", overwrite=False).exists()
    (run_dir / "metrics.csv").unlink()
    assert not remove_failed_start(str(root), run_dir) and run_dir.is_dir()
    monkeypatch.delenv("LOCAL_RANK")
    assert remove_failed_start(str(root), run_dir) and not run_dir.exists()


def test_checkpoint_removal_stays_inside_the_run_folder(tmp_path):
    from lit_pretrain.resume.checkpoint_io import AtomicCheckpointIO, save_atomic, sidecar_path

    run_dir, outside = tmp_path / "runs" / "r", tmp_path / "outside.ckpt"
    run_dir.mkdir(parents=True)
    inside = run_dir / "epoch=0-step=2.ckpt"
    for path in (inside, outside):
        save_atomic({"state_dict": {}}, path)
    notes = run_dir / "notes.txt"
    notes.write_text("keep")
    io = AtomicCheckpointIO(root=run_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        io.remove_checkpoint(outside)
        io.remove_checkpoint(notes)
    assert outside.is_file() and notes.is_file() and len(caught) == 2
    io.remove_checkpoint(inside)
    assert not inside.exists() and not sidecar_path(inside).exists()


def test_a_shard_is_never_overwritten(tmp_path):
    import numpy as np

    from lit_pretrain.data.shards import ShardWriter

    (tmp_path / "train_00000.bin").write_bytes(b"precious")
    writer = ShardWriter(tmp_path, "train", 100, np.uint16, 512)
    with pytest.raises(FileExistsError):
        writer.write([np.arange(10, dtype=np.uint16)])
    assert (tmp_path / "train_00000.bin").read_bytes() == b"precious"


# Failed starts (defect 4): each is refused before the run folder is made, and the retry with the cause fixed runs.

class FailOnFitStart(Callback):
    """A user callback whose bug shows only once fit starts (after the run folder is made)."""

    def on_fit_start(self, trainer, pl_module):
        raise RuntimeError("a bug in my callback")


def tiny(tmp_path, data_dir, name, *extra):
    return config.load(RUN_FILE, [*tiny_data_overrides(data_dir), f"run.root_dir={tmp_path / 'runs'}",
                                  f"run.name={name}", "trainer.progress_bar=false", "trainer.max_steps=2",
                                  "schedule.warmup_steps=1", "trainer.val_every_n_steps=2", "trainer.val_windows=8",
                                  *extra])


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


REFUSED_STARTS = {
    "callback module missing": (ConfigError, ["callbacks.extra=[{class_path: 'no_such_module_xyz:Cb'}]"]),
    "callback init_args": (ConfigError, ["callbacks.extra=[{class_path: "
                                         "'experiments.callbacks.update_ratio:UpdateRatio', "
                                         "init_args: {every_n_stepz: 3}}]"]),
    "batch larger than the data": (DataError, ["trainer.micro_batch_size=100000", "trainer.tokens_per_step=null"]),
    # Past every check, inside fit: the folder this start made is removed again (it holds no checkpoint, no metric).
    "callback fails in fit": (RuntimeError, [f"callbacks.extra=[{{class_path: '{__name__}:FailOnFitStart'}}]"]),
}


@pytest.mark.parametrize("case", list(REFUSED_STARTS))
def test_a_refused_start_leaves_no_run_folder(case, tmp_path, tiny_data_dir):
    error, extra = REFUSED_STARTS[case]
    with pytest.raises(error):
        train(tiny(tmp_path, tiny_data_dir, "retry", *extra))
    assert not (tmp_path / "runs" / "retry").exists()


@pytest.mark.slow
def test_the_retry_after_a_flipped_shard_byte_runs(tmp_path, tiny_data_dir):
    import shutil

    from lit_pretrain.data.shards import load_manifest

    data = Path(shutil.copytree(tiny_data_dir, tmp_path / "data"))  # never corrupt the shared fixture
    run_dir = tmp_path / "runs" / "retry"
    shard = data / load_manifest(data)["splits"]["train"]["shards"][0]["file"]
    flip_byte(shard, 100)
    with pytest.raises(DataError, match=r"corrupted"):
        train(tiny(tmp_path, data, "retry"))
    assert not run_dir.exists()
    flip_byte(shard, 100)  # the cause fixed: the same command runs
    summary = train(tiny(tmp_path, data, "retry"))
    assert summary["steps"] == 2 and (run_dir / ".lit-pretrain-run").is_file()


@pytest.mark.slow
def test_a_refused_resume_under_a_new_name_leaves_no_folder(tmp_path, tiny_data_dir):
    train(tiny(tmp_path, tiny_data_dir, "source", "trainer.checkpoint_every_n_steps=1"))
    step1 = tmp_path / "runs" / "source" / "checkpoints" / "step0000001.ckpt"
    fork = tmp_path / "runs" / "fork"
    with pytest.raises(ConfigError, match=r"optim\.lr_peak"):
        train(tiny(tmp_path, tiny_data_dir, "fork", f"run.resume={step1}", "optim.lr_peak=0.01"))
    assert not fork.exists()
    summary = train(tiny(tmp_path, tiny_data_dir, "fork", f"run.resume={step1}"))
    assert summary["steps"] == 2 and (fork / "checkpoints" / "step0000002.ckpt").is_file()
    assert (fork / ".lit-pretrain-run").is_file()


# Starts at the same moment: both passed the "already exists" check and wrote into one folder.

# One start's claim in its own process: ready, then wait for `go`, claim, report, and hold the folder until `end`.
CLAIMER = """
import sys, time
from pathlib import Path
from lit_pretrain.errors import RunFolderError
from lit_pretrain.runs.folder import claim_run_dir
root, name, i, mode = sys.argv[1:]
flags = Path(root).parent
(flags / f"ready{i}").touch()
while not (flags / "go").exists():
    time.sleep(0.001)
try:
    claim = claim_run_dir(root, name, overwrite=mode == "overwrite", resume=mode == "resume")  # held till end
    result = "won"
except RunFolderError as err:
    result = f"refused: {err}"
(flags / f"result{i}").write_text(result)
while not (flags / "end").exists():
    time.sleep(0.01)
"""


def claim_at_once(tmp_path, name: str, modes: list) -> list:
    """Each start of `modes` claims root/name in its own process, released together by one flag file; the results."""
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT, launcher_env

    root = tmp_path / "runs"
    procs = [subprocess.Popen([sys.executable, "-c", CLAIMER, str(root), name, str(i), mode], cwd=ROOT,
                              env=launcher_env()) for i, mode in enumerate(modes)]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{i}").exists() for i in range(len(modes))):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a claimer did not start"
            time.sleep(0.01)
        (tmp_path / "go").touch()
        while not all((tmp_path / f"result{i}").exists() for i in range(len(modes))):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "a claimer did not report"
            time.sleep(0.01)
        return [(tmp_path / f"result{i}").read_text() for i in range(len(modes))]
    finally:
        (tmp_path / "end").touch()
        for p in procs:
            p.wait(timeout=60)


@pytest.mark.parametrize("modes", [["new"] * 4, ["overwrite"] * 3])
def test_of_starts_at_the_same_moment_exactly_one_gets_the_run_folder(modes, tmp_path):
    if "overwrite" in modes:  # a finished run started again (run.overwrite=true) by several at once
        done = create_run_dir(str(tmp_path / "runs"), "same", overwrite=False)
        (done / "checkpoints" / "step0000010.ckpt").write_bytes(b"done")
    results = claim_at_once(tmp_path, "same", modes)
    assert sorted(r.split(":")[0] for r in results) == ["refused"] * (len(modes) - 1) + ["won"], results
    assert all("is in use by another start of run.name=same" in r for r in results if r != "won")
    run_dir = tmp_path / "runs" / "same"
    assert json.loads((run_dir / ".lit-pretrain-run").read_text())["name"] == "same"
    assert not any((run_dir / "checkpoints").iterdir())  # made once, by the winner (the old run deleted once)


def test_a_run_folder_in_use_is_refused_to_resume_overwrite_and_the_cli(tmp_path, capsys):
    """A start (here a claim in this process) holds its folder until it ends: a resume, an overwrite and a CLI start
    of the same name are refused (the CLI in one line, exit 2, before any data is prepared); once released, the
    folder is free again."""
    from lit_pretrain.runs.folder import claim_run_dir, in_use

    root = tmp_path / "runs"
    claim = claim_run_dir(str(root), "busy", overwrite=False)
    (claim.run_dir / "checkpoints" / "step0000001.ckpt").write_bytes(b"training")
    assert in_use(claim.run_dir)
    for kwargs in ({"overwrite": True}, {"overwrite": False, "resume": True}):
        with pytest.raises(RunFolderError, match=r"in use by another start of run\.name=busy"):
            claim_run_dir(str(root), "busy", **kwargs)
    assert cli.main(["train", RUN_FILE, *tiny_data_overrides(tmp_path / "never-prepared"), f"run.root_dir={root}",
                     "run.name=busy", "run.resume=auto"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is in use by another start of run.name=busy" in err
    assert not (tmp_path / "never-prepared").exists()
    claim.release()
    assert not in_use(claim.run_dir)
    claim_run_dir(str(root), "busy", overwrite=False, resume=True).release()


def test_a_fresh_start_into_a_resumable_run_leads_with_resume_auto_and_auto_restarts_one_without(tmp_path):
    """The refusal of a fresh start into a run folder with a checkpoint leads with run.resume=auto
    and its step; run.resume=auto in one killed before its first checkpoint starts it again, the earlier files kept
    in attempts/1/ (nothing deleted), and again in attempts/2/ after a second such kill."""
    import torch

    from lit_pretrain.resume import session
    from lit_pretrain.resume.verified import save_atomic
    from lit_pretrain.schema import RunConfig

    root = tmp_path / "runs"
    run_dir = create_run_dir(str(root), "r", overwrite=False)
    save_atomic({"w": torch.zeros(2)}, run_dir / "checkpoints" / "step0000004.ckpt")
    with pytest.raises(RunFolderError) as err:
        session.open_run(RunConfig(name="r", root_dir=str(root)))
    assert str(err.value) == (f"run.resume=auto continues run folder {run_dir} from its checkpoint at step 4; it "
                              "already exists: choose another run.name, or set run.overwrite=true to delete it and "
                              "start again")
    killed = create_run_dir(str(root), "k", overwrite=False)
    (killed / "metrics.csv").write_text("step,train/loss\n1,6.2\n")  # a metrics row, no checkpoint
    (killed / "config.yaml").write_text("run:\n  name: k\n")
    with pytest.raises(RunFolderError) as err:
        session.open_run(RunConfig(name="k", root_dir=str(root)))
    # Led by what run.resume=auto does there (the loop below does it), like the refusal beside a checkpoint.
    assert str(err.value) == (f"run.resume=auto starts run folder {killed} again (it holds no checkpoint: its run was "
                              "killed or failed before the first one), keeping its files in k/attempts/<n>/; it "
                              "already exists: choose another run.name, or set run.overwrite=true to delete it and "
                              "start again")
    for n in (1, 2):
        run = RunConfig(name="k", root_dir=str(root), resume="auto")
        plan = session.open_run(run)
        assert plan.restart and plan.checkpoint is None and (killed / "metrics.csv").is_file()  # checked, not moved
        session.make_run_dir(plan, run)
        session.release(plan)
        assert plan.claim.aside == killed / "attempts" / str(n) and not plan.created
        assert sorted(p.name for p in killed.iterdir()) == [".lit-pretrain-run", "attempts", "checkpoints"]
        kept = killed / "attempts" / "1"
        assert (kept / "metrics.csv").read_text() == "step,train/loss\n1,6.2\n" and (kept / "config.yaml").is_file()
        (killed / "metrics.csv").write_text("step,train/loss\n1,6.2\n")  # the restart killed again the same way
    # A fresh start is refused there now (attempts/ holds work), never reused and emptied.
    (killed / "metrics.csv").unlink()
    with pytest.raises(RunFolderError, match=r"already exists"):
        session.open_run(RunConfig(name="k", root_dir=str(root)))
