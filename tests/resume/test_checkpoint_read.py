"""Every checkpoint reader verifies, and a checkpoint reads back on its own.

One tiny in-process run (2 optimizer steps, a checkpoint after each) gives real Lightning checkpoints with their
sidecars. A byte flipped anywhere in one is refused by load_gpt, load_optimizer_state and
PretrainModule.load_from_checkpoint, naming the file; a checkpoint copied out of its run folder with its sidecar
reads back alone; one without its sidecar is refused naming the missing file; and run.resume=auto says which
corrupted checkpoint it skipped, keeps it aside, and resumes from the one before.
"""

import re
import shutil

import pytest
import torch

from lit_pretrain import config
from lit_pretrain.errors import DataError
from lit_pretrain.module import PretrainModule
from lit_pretrain.resume import store
from lit_pretrain.resume.verified import load_verified, save_atomic, sidecar_path
from lit_pretrain.resume.weights import load_gpt, load_optimizer_state
from lit_pretrain.schema import StrategyConfig, TrainerConfig
from lit_pretrain.strategy.build import build_strategy
from lit_pretrain.train import train
from tests.conftest import EXPERIMENTS, tiny_data_overrides

OVERRIDES = ["trainer.progress_bar=false", "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=1",
             "trainer.val_every_n_steps=2", "trainer.val_windows=8", "schedule.warmup_steps=1"]


def tiny(root, data_dir, *extra):
    return config.load(EXPERIMENTS / "runs" / "tiny.yaml", [*tiny_data_overrides(data_dir), f"run.root_dir={root}",
                                                            *OVERRIDES, *extra])


@pytest.fixture(scope="session")  # built once per worker, whatever the order: tests/helpers/longest_first.py
def trained(tmp_path_factory, tiny_data_dir):
    """A finished run folder; tests work on copies (shutil.copytree copies last.ckpt apart from its step file)."""
    root = tmp_path_factory.mktemp("ckpt_read")
    train(tiny(root, tiny_data_dir))
    return root / "tiny"


@pytest.fixture
def run_dir(trained, tmp_path):
    return shutil.copytree(trained, tmp_path / "runs" / "tiny")


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def assert_same_weights(a, b):
    a, b = a.state_dict(), b.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow  # the module's tiny training run
def test_a_byte_flipped_anywhere_is_refused_by_every_reader(run_dir):
    path = run_dir / "checkpoints" / "last.ckpt"
    reference = load_gpt(run_dir)
    size = path.stat().st_size
    # 11 offsets from the first byte to the last: the zip header, pickled structure, weights and optimizer state.
    # Before load_gpt checked the sidecar, 10 of these 11 flips loaded with no error, 3 with changed weights.
    offsets = [round(i * (size - 1) / 10) for i in range(11)]
    readers = {"load_gpt": lambda: load_gpt(run_dir), "load_optimizer_state": lambda: load_optimizer_state(run_dir),
               "load_from_checkpoint": lambda: PretrainModule.load_from_checkpoint(path)}
    for offset in offsets:
        flip_byte(path, offset)
        for name, read in readers.items():
            with pytest.raises(DataError, match=f"checkpoint {re.escape(str(path))} is corrupted"):
                read()
                pytest.fail(f"{name} read a checkpoint with byte {offset} flipped")
        flip_byte(path, offset)  # flipped back: the file is whole again
    assert_same_weights(load_gpt(run_dir), reference)


@pytest.mark.slow  # the module's tiny training run
def test_a_checkpoint_reads_back_outside_its_run_folder(run_dir, tmp_path):
    """last.ckpt and its sidecar copied into a folder with no config.yaml: the configs come from the checkpoint."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("last.ckpt", "last.ckpt.json"):
        shutil.copy(run_dir / "checkpoints" / name, elsewhere / name)
    path = elsewhere / "last.ckpt"
    assert_same_weights(load_gpt(path), load_gpt(run_dir))
    moments = load_optimizer_state(path).state_dict()["state"]
    reference = load_optimizer_state(run_dir).state_dict()["state"]
    assert moments.keys() == reference.keys() and len(moments) > 0
    for i in moments:
        assert torch.equal(moments[i]["exp_avg"], reference[i]["exp_avg"])
    module = PretrainModule.load_from_checkpoint(path)
    run_cfg = config.to_object(config.load(run_dir / "config.yaml"))
    assert module.model_cfg == run_cfg.model and module.optim_cfg == run_cfg.optim
    assert module.schedule_cfg == run_cfg.schedule and module.max_steps == 2
    assert_same_weights(module.model, load_gpt(run_dir))
    # The hyperparameters are plain data: a weights-only load reads them.
    saved = torch.load(path, map_location="cpu", weights_only=True)["hyper_parameters"]
    assert saved["model_cfg"]["vocab_size"] == 512 and saved["strategy"]["name"] == "single"


@pytest.mark.slow  # the module's tiny training run
def test_a_checkpoint_without_its_sidecar_is_refused(run_dir, tmp_path):
    alone = tmp_path / "alone" / "last.ckpt"
    alone.parent.mkdir()
    shutil.copy(run_dir / "checkpoints" / "last.ckpt", alone)
    for read in (load_gpt, load_optimizer_state, load_verified):
        with pytest.raises(DataError, match=f"checkpoint {re.escape(str(alone))} has no checksum file "
                                            r"last\.ckpt\.json beside it: copy the last\.ckpt\.json"):
            read(alone)
    # Inside a run folder too: the run's config.yaml does not stand in for the checksum.
    sidecar_path(run_dir / "checkpoints" / "step0000001.ckpt").unlink()
    with pytest.raises(DataError, match=r"step0000001\.ckpt has no checksum file"):
        load_gpt(run_dir, "step0000001.ckpt")


@pytest.mark.slow  # the module's tiny training run, and one resumed run
def test_resume_auto_sets_a_corrupted_newest_checkpoint_aside(run_dir, tiny_data_dir, capsys):
    folder = run_dir / "checkpoints"
    newest = folder / "step0000002.ckpt"
    before = load_verified(newest)["state_dict"]
    flip_byte(newest, newest.stat().st_size // 2)
    corrupted = newest.read_bytes()
    (folder / "step0000002.ckpt.corrupt").write_bytes(b"set aside by an earlier resume")  # never overwritten
    capsys.readouterr()
    train(tiny(run_dir.parent, tiny_data_dir, "run.resume=auto"))
    out = capsys.readouterr().out
    assert ("run.resume=auto: skipped checkpoints/step0000002.ckpt (sha256 differs from its sidecar); kept aside "
            "as step0000002.ckpt.1.corrupt") in out
    assert "resuming from" in out and "(step 1)" in out
    assert (folder / "step0000002.ckpt.corrupt").read_bytes() == b"set aside by an earlier resume"
    assert (folder / "step0000002.ckpt.1.corrupt").read_bytes() == corrupted
    assert sidecar_path(folder / "step0000002.ckpt.1.corrupt").is_file()
    # Step 2 trained again from step 1: the same weights as the first time (same process, data, RNG, kernels).
    after = load_verified(newest)["state_dict"]
    assert (folder / store.LATEST).read_text().strip() == newest.name
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_zero_stage_2_and_3_resume_checks_the_checkpoint_first(tmp_path):
    """ZeRO stages 2 and 3 (resume/gathered.py) check a one-file checkpoint against its sidecar themselves, on every
    rank, before loading it, whatever their checkpoint_io (here Lightning's own, which checks nothing)."""
    path = tmp_path / "step0000002.ckpt"
    save_atomic({"state_dict": {"model.w": torch.zeros(64)}}, path)
    flip_byte(path, path.stat().st_size // 2)
    for stage in (2, 3):
        strategy = build_strategy(StrategyConfig(name="zero", zero_stage=stage), TrainerConfig(devices=2))
        with pytest.raises(DataError, match=f"checkpoint {re.escape(str(path))} is corrupted"):
            strategy.load_checkpoint(path)


@pytest.mark.slow  # the module's tiny training run
def test_inspect_follows_a_run_folder_like_load_gpt(run_dir, capsys):
    """`checkpoint inspect runs/<name>` reads the checkpoint load_gpt(runs/<name>) reads (it refused the folder
    before): both resolve it through checkpoints.checkpoint_path."""
    from lit_pretrain import cli
    from lit_pretrain.resume.sharded.inspect import inspect
    from lit_pretrain.resume.weights import checkpoint_path

    report = inspect(run_dir)
    assert report["path"] == str(checkpoint_path(run_dir)) == str(run_dir / "checkpoints" / "last.ckpt")
    assert report["step"] == 2 and not report["failures"]
    assert report["tensors"]["model"] == len(load_gpt(run_dir).state_dict())
    assert cli.main(["checkpoint", "inspect", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {run_dir / 'checkpoints' / 'last.ckpt'} (single file)" in out and "step: 2" in out
    # A folder that is neither a run folder nor a sharded checkpoint: one line naming what to give.
    assert cli.main(["checkpoint", "inspect", str(run_dir.parent)]) == 2
    assert "nor a run folder (no checkpoints/)" in capsys.readouterr().err


@pytest.mark.slow  # the module's tiny training run
def test_resume_from_a_file_with_overwrite_names_no_deletion_that_would_not_happen(trained, tmp_path, tiny_data_dir):
    from lit_pretrain.errors import RunFolderError
    from lit_pretrain.resume.session import open_run

    step1 = trained / "checkpoints" / "step0000001.ckpt"
    new = config.to_object(tiny(tmp_path, tiny_data_dir, "run.name=fork", f"run.resume={step1}",
                                "run.overwrite=true")).run
    with pytest.raises(RunFolderError, match=r"nothing to delete: run folder .*fork does not exist yet") as err:
        open_run(new)
    assert "delete" not in str(err.value).replace("nothing to delete", "")
    assert not (tmp_path / "fork").exists()
    # A run folder that holds results: overwrite would delete it, and the message says so.
    existing = config.to_object(tiny(trained.parent, tiny_data_dir, f"run.resume={step1}",
                                     "run.overwrite=true")).run
    with pytest.raises(RunFolderError, match=r"contradict each other \(overwrite would delete .*tiny"):
        open_run(existing)
