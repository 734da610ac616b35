"""Atomic checkpoints, retention, the resume resolver, and integrity errors: a truncated or flipped checkpoint, a
flipped shard byte and a foreign tokenizer each give a DataError naming the file."""

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from lit_pretrain.atomic import atomic_open, file_sha256
from lit_pretrain.data.shards import load_manifest, verify_shards
from lit_pretrain.errors import ConfigError, DataError
from lit_pretrain.resume import compat, store
from lit_pretrain.resume.checkpoint_io import AtomicCheckpointIO
from lit_pretrain.resume.verified import load_verified, save_atomic, sidecar_path


def write_steps(folder, steps):
    for step in steps:
        path = folder / store.step_file(step)
        save_atomic({"w": torch.full((64,), float(step)), "lit_pretrain": {"step": step}}, path)
        store.publish(folder, path)


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_truncated_or_flipped_checkpoint_is_named_and_skipped(tmp_path):
    write_steps(tmp_path, [2, 4, 6])
    run_dir = tmp_path.parent
    newest = tmp_path / store.step_file(6)
    assert load_verified(newest)["w"][0].item() == 6.0  # weights_only load after the checksum
    # Truncated: the size check names the file; resume=auto falls back to the newest valid one.
    newest.write_bytes(newest.read_bytes()[:-100])
    with pytest.raises(DataError, match=f"{newest}.*truncated"):
        load_verified(newest)
    # Flipped byte in step 4 (same size): the sha256 names it.
    flip_byte(tmp_path / store.step_file(4), 200)
    with pytest.raises(DataError, match=f"{tmp_path / store.step_file(4)}.*corrupted"):
        load_verified(tmp_path / store.step_file(4))
    assert store.newest_valid(tmp_path) == tmp_path / store.step_file(2)
    with pytest.raises(DataError, match="corrupted"):  # an explicit PATH is not silently replaced
        store.resolve(str(tmp_path / store.step_file(4)), run_dir)
    with pytest.raises(ConfigError, match="run.resume"):
        store.resolve(str(tmp_path / "nope.ckpt"), run_dir)


def test_crash_mid_write_leaves_previous_checkpoint_loadable(tmp_path):
    write_steps(tmp_path, [2])
    last = tmp_path / store.LAST

    class Crash(Exception):
        pass

    with pytest.raises(Crash):  # a crash (here an exception) half-way through writing the new last.ckpt
        with atomic_open(last) as f:
            f.write(b"half a checkpoint")
            raise Crash
    assert load_verified(last)["w"][0].item() == 2.0
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind
    # A step file written but never given a sidecar (crash between the two) is not trusted.
    torch.save({"w": torch.zeros(1)}, tmp_path / store.step_file(4))
    assert store.newest_valid(tmp_path) == tmp_path / store.step_file(2)
    # Nor a sidecar whose checkpoint's rename was lost (a crash before the folder's one fsync).
    save_atomic({"w": torch.zeros(1)}, tmp_path / store.step_file(6))
    (tmp_path / store.step_file(6)).unlink()
    assert store.newest_valid(tmp_path) == tmp_path / store.step_file(2)


def test_a_save_fsyncs_each_file_once_and_the_folder_once(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    side = save_atomic({"w": torch.arange(1000.0)}, tmp_path / "x.ckpt")
    # Checkpoint and sidecar (temporary names, before their renames), then the folder once, after both renames.
    assert [Path(p).name for p in synced] == [f".x.ckpt.{os.getpid()}.tmp",
                                              f".x.ckpt.json.{os.getpid()}.tmp", tmp_path.name]
    assert side["sha256"] == file_sha256(tmp_path / "x.ckpt")  # hashed on the way = hashed from the disk


def test_retention_keeps_newest_valid_ones(tmp_path):
    write_steps(tmp_path, [1, 2, 3, 4])
    assert [p.name for p in store.retain(tmp_path, 2)] == [store.step_file(2), store.step_file(1)]
    # The newest file is corrupted: it does not count toward the 2 kept, so step 3 (the only valid one) stays.
    write_steps(tmp_path, [5])
    (tmp_path / store.step_file(5)).write_bytes(b"x")
    (tmp_path / store.step_file(4)).write_bytes(b"y")
    store.retain(tmp_path, 1)
    assert (tmp_path / store.step_file(3)).is_file() and store.newest_valid(tmp_path).name == store.step_file(3)
    assert not sidecar_path(tmp_path / store.step_file(2)).exists()


def test_checkpoint_io_plugin_round_trip(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"state_dict": {"a": torch.arange(3)}}, tmp_path / "x.ckpt")
    assert torch.equal(io.load_checkpoint(tmp_path / "x.ckpt")["state_dict"]["a"], torch.arange(3))
    io.remove_checkpoint(tmp_path / "x.ckpt")
    assert not any(tmp_path.iterdir())


@pytest.fixture
def data_copy(tiny_data_dir, tmp_path):
    return shutil.copytree(tiny_data_dir, tmp_path / "data")


def test_flipped_shard_byte_and_foreign_tokenizer(data_copy):
    manifest = load_manifest(data_copy)
    start = time.perf_counter()
    verify_shards(data_copy, manifest)
    print(f"shard check on start: {(time.perf_counter() - start) * 1e3:.1f} ms")
    shard = data_copy / manifest["splits"]["train"]["shards"][0]["file"]
    flip_byte(shard, 1000)
    with pytest.raises(DataError, match=f"shard {shard} is corrupted"):
        verify_shards(data_copy, manifest)
    flip_byte(shard, 1000)
    tokenizer = data_copy / manifest["tokenizer"]["file"]
    tokenizer.write_text(tokenizer.read_text().replace('"<|endoftext|>"', '"<|eot|>"', 1))
    with pytest.raises(DataError, match=f"{tokenizer}: the tokenizer does not match"):
        verify_shards(data_copy, manifest)


def test_resume_compatibility_rules():
    manifest = {"tokenizer": {"sha256": "t"}, "splits": {"train": {"shards": [{"file": "a", "tokens": 1,
                                                                              "sha256": "s"}]}}}
    cfg = {"model": {"d_model": 64}, "optim": {"lr_peak": 1e-3}, "trainer": {"devices": 1, "compile": False}}
    saved = compat.run_meta(cfg, manifest, 512)
    moved = {**cfg, "optim": {"lr_peak": 2e-3}, "trainer": {"devices": 2, "compile": "auto"}}
    # devices and compile are free; lr_peak only when allowed; the model shape never.
    assert compat.check_resume(saved, compat.run_meta(moved, manifest, 512), ["optim.lr_peak"], "c", "t") == \
        ["optim.lr_peak"]
    with pytest.raises(ConfigError, match=r"optim.lr_peak .*resume_allow_changes=\[optim.lr_peak\]"):
        compat.check_resume(saved, compat.run_meta(moved, manifest, 512), [], "c", "t")
    with pytest.raises(ConfigError, match="model.d_model .*cannot change"):
        compat.check_resume(saved, compat.run_meta({**cfg, "model": {"d_model": 32}}, manifest, 512),
                            ["model.d_model"], "c", "t")
    # A context-extension stage: model.seq_len and model.rope_scaling (a section: listed whole or key by key) hold no
    # weight and change when listed; never unlisted.
    stage = {**cfg, "model": {"d_model": 64, "seq_len": 128, "rope_scaling": {"type": "llama3", "factor": 2.0}}}
    unscaled = compat.run_meta({**cfg, "model": {"d_model": 64, "seq_len": 64, "rope_scaling": None}}, manifest, 512)
    assert compat.check_resume(unscaled, compat.run_meta(stage, manifest, 512),
                               ["model.seq_len", "model.rope_scaling"], "c", "t") == \
        ["model.rope_scaling.factor", "model.rope_scaling.type", "model.seq_len"]
    with pytest.raises(ConfigError, match="model.seq_len .*cannot change"):
        compat.check_resume(unscaled, compat.run_meta(stage, manifest, 512), ["model.rope_scaling"], "c", "t")
    # A checkpoint written before trainer.val_batches became trainer.val_windows resumes; a changed val_windows
    # of a checkpoint that has it is an experiment change like any other.
    before_rename = compat.run_meta({**cfg, "trainer": {**cfg["trainer"], "val_batches": 20}}, manifest, 512)
    windows = compat.run_meta({**cfg, "trainer": {**cfg["trainer"], "val_windows": 160}}, manifest, 512)
    assert compat.check_resume(before_rename, windows, [], "c", "t") == []
    with pytest.raises(ConfigError, match=r"trainer.val_windows is 80 here but 160"):
        compat.check_resume(windows, compat.run_meta({**cfg, "trainer": {**cfg["trainer"], "val_windows": 80}},
                                                     manifest, 512), [], "c", "t")
    # model.moe.aux_loss_scope's default changed from micro_batch to sequence: a checkpoint written under the old
    # default resumes under the new one unlisted (the console says so); any other change of it only when listed.
    moe = {**cfg, "model": {"d_model": 64, "moe": {"aux_loss_scope": "micro_batch"}}}
    def scope(value):
        return compat.run_meta({**cfg, "model": {"d_model": 64, "moe": {"aux_loss_scope": value}}}, manifest, 512)
    old_default = compat.run_meta(moe, manifest, 512)
    assert compat.check_resume(old_default, scope("sequence"), [], "c", "t") == ["model.moe.aux_loss_scope"]
    with pytest.raises(ConfigError, match=r"model.moe.aux_loss_scope .*resume_allow_changes=\[model.moe.aux_loss"):
        compat.check_resume(old_default, scope("global"), [], "c", "t")
    assert compat.check_resume(scope("global"), scope("sequence"), ["model.moe.aux_loss_scope"], "c", "t") == \
        ["model.moe.aux_loss_scope"]
    other = {"tokenizer": {"sha256": "u"}, "splits": manifest["splits"]}
    with pytest.raises(DataError, match="tokenizer tok.json differs"):
        compat.check_resume(saved, compat.run_meta(cfg, other, 512), [], "c", "tok.json")


def test_a_stage_on_a_new_mixture_compares_the_shards_of_each_source_both_name():
    def shard(sha):
        return {"tokenizer": {"sha256": "t"}, "splits": {"train": {"shards": [{"file": "x", "tokens": 1,
                                                                              "sha256": sha}]}}}

    def mixture(**sources):  # combined_manifest's shape: the sources' manifests by name
        return {"tokenizer": {"sha256": "t"}, "splits": {"train": {"shards": [
            {"file": f"{n}/x", "tokens": 1, "sha256": m} for n, m in sources.items()]}},
            "sources": {n: shard(m) for n, m in sources.items()}}

    def meta(names, manifest):
        return compat.run_meta({"data": {"sources": [{"name": n} for n in names]}}, manifest, 512)

    saved = meta(["web", "code"], mixture(web="w", code="c"))
    # code kept on its shards, math new: allowed with data.sources listed, refused unlisted (the manifest hash).
    anneal = meta(["code", "math"], mixture(code="c", math="m"))
    assert compat.check_resume(saved, anneal, ["data.sources"], "ck", "t") == ["data.sources"]
    with pytest.raises(DataError, match="manifest hash"):
        compat.check_resume(saved, anneal, [], "ck", "t")
    # A source the stage names again on other shards is refused by its key.
    with pytest.raises(DataError, match=r"data.sources\[0\] \(code\): its shards differ"):
        compat.check_resume(saved, meta(["code"], mixture(code="other")), ["data.sources"], "ck", "t")


def test_malformed_sidecar_is_a_clear_error(tmp_path):
    write_steps(tmp_path, [1])
    path = tmp_path / store.step_file(1)
    sidecar_path(path).write_text('{"file": "x"}')
    with pytest.raises(DataError, match=f"checkpoint {path} has no readable checksum file"):
        load_verified(path)
