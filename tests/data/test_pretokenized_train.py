"""A Megatron-format corpus trains (the issue's bar), and a mixture of a prepared source and a Megatron one resumes
bit for bit after SIGKILL: real `lit-pretrain train` runs in subprocesses (tests/resume/test_resume.py's helpers)."""

import signal

import numpy as np
import pytest

from lit_pretrain.data.export import export_data
from lit_pretrain.evaluation.generate import run_tokenizer
from lit_pretrain.runs.folder import read_metrics, series
from tests.conftest import run_module, train_args
from tests.resume.test_resume import COMMON, assert_same_run, extra, latest

pytestmark = pytest.mark.slow

SHORT = ["trainer.max_steps=4", "trainer.val_every_n_steps=2", "trainer.log_every_n_steps=1",
         "schedule.warmup_steps=1", "trainer.progress_bar=false", "trainer.val_windows=8",
         "trainer.micro_batch_size=4", "data.document_masking=true"]


@pytest.fixture(scope="session")  # built once per worker, whatever the order: tests/helpers/longest_first.py
def exported(tmp_path_factory, tiny_data_dir):
    out = tmp_path_factory.mktemp("exported") / "megatron"
    export_data(tiny_data_dir, out, "megatron")
    return out


def megatron(out) -> list:
    return ["data.corpus=megatron", f"data.paths=['{out / 'train'}']", f"data.val_paths=['{out / 'val'}']",
            f"data.tokenizer_path={out / 'tokenizer.json'}"]


def test_megatron_corpus_trains_the_prepared_folders_losses_bitwise(tmp_path, tiny_data_dir, exported):
    """The exporter's .bin/.idx of the tiny corpus (one shard per split, so the same windows and sampler order)
    trains, with document masking from the EOD ids the .idx delimits, to exactly the losses of the folder it was
    written from: same tokens, same order, same kernels."""
    run_module(*train_args(tiny_data_dir, tmp_path, "prepared"), *SHORT)
    out = run_module(*train_args(tiny_data_dir, tmp_path, "megatron"), *SHORT, *megatron(exported))
    assert "megatron corpus: 2 files" in out.stdout
    rows = {name: read_metrics(tmp_path / name / "metrics.csv") for name in ("prepared", "megatron")}
    for key in ("train/loss", "val/loss"):
        a, b = (series(rows[name], key) for name in ("prepared", "megatron"))
        assert a and a == b, key  # exact floats
    first, last = series(rows["megatron"], "train/loss")[0][1], series(rows["megatron"], "train/loss")[-1][1]
    assert last < first  # it learns: 4 steps at lr warmed up from step 1 take the tiny model's loss down
    assert run_tokenizer(tmp_path / "megatron")[1] == run_tokenizer(tmp_path / "prepared")[1]  # generate's EOD id


def test_mixture_with_a_megatron_source_resumes_bitwise_after_sigkill(tmp_path, tiny_data_dir, exported):
    """tests/resume/test_resume.py's schedule (6 steps of 2 micro-batches, a checkpoint every 2) on a mixture of the
    prepared tiny corpus (weight 1) and a Megatron source (weight 3): SIGKILL mid-accumulation of step 4, resumed
    from step 2, bitwise the uninterrupted run (losses, every metrics row, final weights)."""
    mix = [f"data.sources=[{{name: ours, prepared_dir: '{tiny_data_dir}'}}, {{name: mega, corpus: megatron, "
           f"paths: ['{exported / 'train'}'], val_paths: ['{exported / 'val'}'], weight: 3}}]"]
    run_module(*train_args(tiny_data_dir, tmp_path, "ref"), *COMMON, *mix)
    fault = extra(("Fault", {"step": 3, "micro_batch": 1}))
    run_module(*train_args(tiny_data_dir, tmp_path, "run"), *COMMON, *mix, fault, rc=-signal.SIGKILL,
               start_new_session=True)
    assert latest(tmp_path / "run") == "step0000002.ckpt"
    out = run_module(*train_args(tiny_data_dir, tmp_path, "run"), *COMMON, *mix, "run.resume=auto")
    assert "(step 2)" in out.stdout
    assert_same_run(tmp_path / "ref", tmp_path / "run")
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert any(r.get("data/mega/tokens_seen", 0) > 0 for r in rows)  # the Megatron source was trained on


def test_an_id_past_the_vocabulary_stops_train_before_the_run_folder(tmp_path, tiny_data_dir, exported):
    ids = np.fromfile(exported / "train.bin", dtype=np.uint16)
    ids[1000] = 700  # the tiny tokenizer has 512 ids
    ids.tofile(tmp_path / "bad.bin")
    out = run_module(*train_args(tiny_data_dir, tmp_path, "bad"), "data.corpus=nanogpt",
                     f"data.paths=['{tmp_path / 'bad.bin'}']", f"data.tokenizer_path={exported / 'tokenizer.json'}",
                     rc=2)
    assert f"{tmp_path / 'bad.bin'}: id 700 at token offset 1000 (byte 2000) is outside the vocabulary" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "bad").exists()
