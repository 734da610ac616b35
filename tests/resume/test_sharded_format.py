"""The sharded checkpoint format, read in one process: manifest verification, the restricted .metadata unpickler,
full tensors without a process group, consolidation to one file or safetensors, inspect and its CLI.

Folders are built here as the contract says (dcp.save in this process, trainer_state.pt, rank00000.pt, then the
manifest), from a tiny GPT and its AdamW state after one step. The chunked case writes every tensor of two rows or
more as two row chunks, in separate files, as two ranks of an FSDP run would (a save planner of the test's own,
one process); loading and consolidating reassemble them.
"""

import dataclasses
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from lit_pretrain import cli
from lit_pretrain.errors import DataError
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.optim.optimizers import build_adamw, param_groups
from lit_pretrain.resume.sharded import format as sf
from lit_pretrain.resume.sharded.inspect import inspect
from lit_pretrain.resume.sharded.tools import _release, consolidate
from lit_pretrain.resume.verified import META_KEY, load_verified, verify
from lit_pretrain.resume.weights import load_gpt, load_optimizer_state
from lit_pretrain.schema import OptimConfig

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process
STEP = 3
CFG = GPTConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, seq_len=16)
OPTIM = OptimConfig()


@pytest.fixture(scope="module")
def source():
    """A tiny GPT and AdamW after one step; the parameter names per group, in AdamW's order."""
    torch.manual_seed(0)
    model = GPT(CFG)
    optimizer = build_adamw(model, OPTIM, kernel="foreach")
    model(torch.randint(0, 64, (2, 16))).float().pow(2).mean().backward()
    optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in param_groups(model, OPTIM.weight_decay)]
    return model, optimizer, groups


class TwoRankPlanner(DefaultSavePlanner):
    """Writes each tensor of 2+ rows as two row chunks (what two FSDP ranks hold), other tensors whole."""

    def create_local_plan(self) -> SavePlan:
        self.chunks, items = {}, []
        for fqn, tensor in self.state_dict.items():
            parts = tensor.chunk(2) if tensor.dim() and tensor.shape[0] >= 2 else (tensor,)
            start = 0
            for part in parts:
                offsets = torch.Size([start] + [0] * (tensor.dim() - 1))
                start += part.shape[0] if tensor.dim() else 0
                self.chunks[(fqn, offsets)] = part.clone()
                items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, part.shape),
                                                                   TensorProperties.create_from_tensor(part),
                                                                   tensor.shape)))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item):
        return self.chunks[(write_item.index.fqn, write_item.index.offset)]


def build(root: Path, source, chunked=False, step=STEP) -> Path:
    model, optimizer, groups = source
    folder = root / f"step{step:07d}"
    by_id = {id(p): n for n, p in model.named_parameters()}
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for p, s in optimizer.state.items():
        state.update({f"optim.{by_id[id(p)]}.{k}": v.clone() for k, v in s.items()})
    saved = optimizer.state_dict()
    writer = dcp.FileSystemWriter(folder, single_file_per_rank=not chunked, sync_files=False)
    dcp.save(state, storage_writer=writer, planner=TwoRankPlanner() if chunked else None, no_dist=True)
    meta = {"step": step, "world_size": 2 if chunked else 1, "tokenizer_sha256": "ab" * 32}
    trainer = {"epoch": 0, "global_step": step, "loops": {}, "callbacks": {},
               "hyper_parameters": {"model_cfg": dataclasses.asdict(CFG), "optim": dataclasses.asdict(OPTIM)},
               META_KEY: meta, "optimizer_states": [{"param_groups": saved["param_groups"], "state": {}}],
               "param_names": groups}
    torch.save(trainer, folder / sf.TRAINER_STATE)
    torch.save({"rng": torch.get_rng_state()}, folder / "rank00000.pt")
    layout = {"data_parallel_shard": 2 if chunked else 1, "zero_stage": 3 if chunked else 0, "tensor_parallel": 1}
    sf.write_manifest(folder, os.listdir(folder), meta, layout, step, meta["world_size"])
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory, source):
    root = tmp_path_factory.mktemp("sharded")
    return {"whole": build(root / "whole", source), "chunked": build(root / "chunked", source, chunked=True)}


@pytest.fixture
def folder(folders, tmp_path):
    return Path(shutil.copytree(folders["chunked"], tmp_path / "step0000003"))


def refused(folder, match):
    with pytest.raises(DataError, match=match) as err:
        sf.VerifiedFileSystemReader(folder)
    assert "\n" not in str(err.value) and err.value.reason
    return err.value


def test_manifest_lists_every_file_and_waits_for_them(folders, tmp_path):
    for folder in folders.values():
        manifest = json.loads((folder / sf.MANIFEST).read_text())
        assert manifest["format"] == sf.FORMAT and manifest["step"] == STEP
        assert set(manifest["files"]) == set(os.listdir(folder)) - {sf.MANIFEST}
        assert all(manifest["files"][n] == sf.file_record(folder / n) for n in manifest["files"])
    # Written only over complete files: a rank's file still growing, or one left out, stops it.
    folder = Path(shutil.copytree(folders["whole"], tmp_path / "step0000003"))
    (folder / sf.MANIFEST).unlink()
    records = {n: sf.file_record(folder / n) for n in os.listdir(folder)}
    with open(folder / "rank00000.pt", "ab") as f:
        f.write(b"more")
    with pytest.raises(DataError, match="rank00000.pt: missing or not .* bytes when its manifest was written"):
        sf.write_manifest(folder, records, {"step": STEP}, {}, STEP, 1)
    with pytest.raises(DataError, match=r"the manifest would leave out \['rank00000.pt'\]"):
        sf.write_manifest(folder, {k: v for k, v in records.items() if k != "rank00000.pt"}, {}, {}, STEP, 1)
    assert not (folder / sf.MANIFEST).exists()
    assert len(list(folders["chunked"].glob("*.distcp"))) > 10  # one file per chunk: the files of two ranks
    assert sf.is_sharded(folders["whole"]) and not sf.is_sharded(folders["whole"].parent.parent)


def test_a_rank_hashes_its_files_as_it_writes_them(source, tmp_path, monkeypatch):
    """The save path of resume/sharded/save.py in one process: the manifest's records are taken while writing (nothing
    is read back to be hashed) and equal the files' sha256 read from the disk."""
    from lit_pretrain import atomic
    from lit_pretrain.resume.sharded import save as sharded

    model, optimizer, _ = source
    chunks = {**sharded.model_chunks(model, None), **sharded.optimizer_chunks(model, optimizer, None)}
    folder = tmp_path / "step0000001"
    sharded._prepare_folder(folder, 0, None)

    def read_back(path, *args):
        raise AssertionError(f"{path} was read back to be hashed")

    monkeypatch.setattr(atomic, "file_sha256", read_back)
    written = sharded._save_torch({"global_step": 1}, folder, 0)
    sharded._save_files(folder, chunks, None, {"step": 1, "meta": {}, "layout": {}, "world_size": 1}, None, written)
    monkeypatch.undo()
    manifest = sf.verify_sharded(folder)  # every size and sha256 checked against the files on disk
    assert set(manifest["files"]) == set(os.listdir(folder)) - {sf.MANIFEST}


def test_full_tensors_in_one_process_equal_the_source(folders, source):
    model, optimizer, _ = source
    by_id = {id(p): n for n, p in model.named_parameters()}
    for folder in folders.values():
        weights = sf.load_sharded_full(folder)
        assert weights.keys() == model.state_dict().keys()
        assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
        moments = sf.load_sharded_full(folder, "optim.", reader=sf.VerifiedFileSystemReader(folder))
        for p, s in optimizer.state.items():
            assert all(torch.equal(moments[f"{by_id[id(p)]}.{k}"], v) for k, v in s.items())


def test_missing_truncated_and_unlisted_files_are_refused(folder):
    shard = sorted(folder.glob("*.distcp"))[3]
    data = shard.read_bytes()
    shard.write_bytes(data[:-7])
    refused(folder, f"checkpoint {re.escape(str(shard))} is truncated or overwritten")
    shard.unlink()
    refused(folder, f"checkpoint {re.escape(str(shard))} is missing")
    shard.write_bytes(data)
    (folder / "__1_99.distcp").write_bytes(b"x")
    refused(folder, "__1_99.distcp is not listed in manifest.json")
    (folder / "__1_99.distcp").unlink()
    (folder / sf.MANIFEST).unlink()
    assert refused(folder, "has no manifest.json: it is incomplete").reason.startswith("no manifest.json")


def test_a_flipped_byte_in_any_file_is_refused(folders, tmp_path):
    folder = Path(shutil.copytree(folders["whole"], tmp_path / "step0000003"))  # one file of each kind
    for path in sorted(p for p in folder.iterdir() if p.name != sf.MANIFEST):
        size = path.stat().st_size
        for offset in {0, size // 2, size - 1}:
            with open(path, "r+b") as f:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0x01]))
            refused(folder, f"checkpoint {re.escape(str(path))} is corrupted: its sha256 differs")
            with open(path, "r+b") as f:
                f.seek(offset)
                f.write(byte)
    sf.VerifiedFileSystemReader(folder)  # whole again


def test_a_manifest_of_another_run_step_or_format_is_refused(folder, folders):
    manifest = json.loads((folder / sf.MANIFEST).read_text())
    shutil.copy(folders["whole"] / sf.MANIFEST, folder / sf.MANIFEST)  # another save of the same step
    refused(folder, "step0000003/.+ (is missing|is truncated or overwritten|is not listed in manifest.json)")
    (folder / sf.MANIFEST).write_text(json.dumps({**manifest, "step": 7}))
    refused(folder, "manifest.json says step 7 .* in folder step0000003: it belongs to another checkpoint")
    (folder / sf.MANIFEST).write_text(json.dumps({**manifest, "format": "lit-pretrain-sharded/9"}))
    refused(folder, "has format 'lit-pretrain-sharded/9'")
    (folder / sf.MANIFEST).write_text(json.dumps({**manifest, "files": {**manifest["files"], "../x.pt": {
        "bytes": 1, "sha256": ""}}}))
    refused(folder, r"names '../x.pt', not a file of")


class RunsCode:
    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def test_a_metadata_pickle_that_runs_code_is_refused_unrun(folder, tmp_path):
    sentinel = tmp_path / "ran"
    size = (folder / sf.METADATA).stat().st_size
    payload = pickle.dumps({"x": RunsCode(sentinel)})
    (folder / sf.METADATA).write_bytes(payload + b"\0" * (size - len(payload)))  # pickle ignores what follows
    refused(folder, r"\.metadata is corrupted")  # its checksum first
    manifest = json.loads((folder / sf.MANIFEST).read_text())
    manifest["files"][sf.METADATA] = sf.file_record(folder / sf.METADATA)  # and with a checksum that matches
    (folder / sf.MANIFEST).write_text(json.dumps(manifest))
    reader = sf.VerifiedFileSystemReader(folder)
    with pytest.raises(DataError, match=r"\.metadata is refused: its pickle names posix\.system"):
        reader.read_metadata()
    for call in (lambda: sf.load_sharded_full(folder), lambda: consolidate(folder, tmp_path / "out.ckpt")):
        with pytest.raises(DataError, match="posix.system"):
            call()
    assert not sentinel.exists()
    pickle.loads(payload)  # what plain pickle.load (DCP's own reader) would do: the test can tell
    assert sentinel.exists()


def test_a_non_tensor_item_that_runs_code_is_refused_unrun(tmp_path):
    # DCP pickles a non-tensor value whole and its default planner unpickles it with weights_only=False.
    sentinel, folder = tmp_path / "ran", tmp_path / "step0000001"
    dcp.save({"model.w": torch.ones(2), "model.extra": RunsCode(sentinel)},
             storage_writer=dcp.FileSystemWriter(folder, sync_files=False), no_dist=True)
    sf.write_manifest(folder, os.listdir(folder), {"step": 1}, {}, 1, 1)
    with pytest.raises(DataError, match="model.extra is not weights-only data"):
        sf.load_sharded_full(folder)
    assert not sentinel.exists()


def test_metadata_naming_a_file_outside_the_manifest_is_refused(folder):
    metadata = pickle.loads((folder / sf.METADATA).read_bytes())
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../elsewhere.distcp"
    (folder / sf.METADATA).write_bytes(pickle.dumps(metadata))
    manifest = json.loads((folder / sf.MANIFEST).read_text())
    manifest["files"][sf.METADATA] = sf.file_record(folder / sf.METADATA)
    (folder / sf.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="names a file outside the manifest"):
        sf.load_sharded_full(folder)


def test_consolidated_file_equals_the_source_and_loads(folders, source, tmp_path):
    model, optimizer, _ = source
    for kind, folder in folders.items():
        out = tmp_path / f"{kind}.ckpt"
        consolidate(folder, out)
        verify(out)
        state = load_verified(out)
        assert state["global_step"] == STEP and "param_names" not in state
        _, _, groups = source  # the optimizer state by parameter name, as every one-file checkpoint (named_state.py)
        named = state["optimizer_states"][0]
        assert [g["params"] for g in named["param_groups"]] == groups
        assert list(named["state"]) == [n for names in groups for n in names]
        assert all(torch.equal(named["state"][n]["exp_avg"], optimizer.state[p]["exp_avg"])
                   for n, p in model.named_parameters())
        weights = state["state_dict"]
        assert set(weights) == {f"model.{k}" for k in model.state_dict()}
        assert weights["model.lm_head.weight"].data_ptr() == weights["model.tok_embeddings.weight"].data_ptr()
        gpt = load_gpt(out)
        assert all(torch.equal(gpt.state_dict()[k], v) for k, v in model.state_dict().items())
        loaded = load_optimizer_state(out, model=gpt)
        expected = optimizer.state_dict()
        for index, per in expected["state"].items():
            assert all(torch.equal(loaded.state_dict()["state"][index][k], v) for k, v in per.items()), index
        assert loaded.state_dict()["param_groups"] == expected["param_groups"]
    with pytest.raises(DataError, match="already exists"):
        consolidate(folders["whole"], out)


def test_consolidated_safetensors_holds_the_weights(folders, source, tmp_path):
    from safetensors.torch import load_file

    from lit_pretrain.interop.hf import read_init

    out = consolidate(folders["chunked"], tmp_path / "w.safetensors")
    weights = load_file(out)
    expected = {k: v for k, v in source[0].state_dict().items() if k != "lm_head.weight"}  # tied: one copy
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], v) for k, v in expected.items())
    fields, _, tokenizer = read_init(out)
    assert fields == dataclasses.asdict(CFG) and tokenizer == "ab" * 32


def test_consolidate_keeps_every_dtype_and_shape(tmp_path):
    # torch.save writes most dtypes as typed storages (_rebuild_tensor_v2) and newer ones (uint16) untyped (v3).
    state = {"model.bf16": torch.randn(3, 5).to(torch.bfloat16), "model.half": torch.randn(7).half(),
             "model.long": torch.arange(6).view(2, 3), "model.flag": torch.tensor([True, False]),
             "model.u16": torch.arange(4).to(torch.uint16), "model.scalar": torch.tensor(2.5),
             "model.empty": torch.zeros(0, 4)}
    folder = tmp_path / "step0000001"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, sync_files=False), no_dist=True)
    torch.save({"global_step": 1, "state_dict": {"extra": torch.ones(1)}}, folder / sf.TRAINER_STATE)
    sf.write_manifest(folder, os.listdir(folder), {"step": 1}, {}, 1, 1)
    loaded = load_verified(consolidate(folder, tmp_path / "one.ckpt"))["state_dict"]
    assert loaded.keys() == {*state, "extra"}
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key


def _peak_rss_growth(call) -> int:
    _release()  # what the build freed goes back first, so the start is the process's real size
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux), so the peak is this call's
    before = int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))
    call()
    peak = int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))
    return (peak - before) * 1024


def test_consolidate_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """8 matrices of 4 MB and their AdamW moments (96 MB in all): consolidating holds about one at a time."""
    state = {f"model.w{i}": torch.randn(1024, 1024) for i in range(8)}
    state.update({f"optim.w{i}.{k}": torch.randn(1024, 1024) for i in range(8) for k in ("exp_avg", "exp_avg_sq")})
    total, largest = sum(v.numel() * v.element_size() for v in state.values()), 1024 * 1024 * 4
    folder = tmp_path / "step0000001"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, sync_files=False), no_dist=True)
    del state
    torch.save({"global_step": 1, "optimizer_states": [{"param_groups": [{"params": list(range(8))}], "state": {}}],
                "param_names": [[f"w{i}" for i in range(8)]]}, folder / sf.TRAINER_STATE)
    sf.write_manifest(folder, os.listdir(folder), {"step": 1}, {}, 1, 1)
    growth = _peak_rss_growth(lambda: consolidate(folder, tmp_path / "one.ckpt"))
    print(f"consolidate: peak RSS {growth / 2**20:.1f} MiB above the start, for {total / 2**20:.0f} MiB of tensors")
    # Measured 8 MiB (cold: 12): the tensor being read, its bytes on their way to the file, and fixed costs.
    assert growth < 4 * largest < total / 5


def test_inspect_and_the_cli(folders, folder, tmp_path, capsys):
    report = inspect(folders["chunked"])
    assert report["step"] == STEP and report["world_size"] == 2 and not report["failures"]
    assert report["tensors"]["model"] == len(GPT(CFG).state_dict())
    assert cli.main(["checkpoint", "inspect", str(folders["chunked"])]) == 0
    out = capsys.readouterr().out
    assert "step: 3" in out and "data_parallel_shard=2" in out and "checksums: every file matches" in out
    shard = sorted(folder.glob("*.distcp"))[1]
    shard.write_bytes(shard.read_bytes()[:-1])
    assert cli.main(["checkpoint", "inspect", str(folder)]) == 2
    captured = capsys.readouterr()
    assert f"{shard.name}: " in captured.out and "checksums: FAIL" in captured.out
    assert captured.err.count("\n") == 1 and "error:" in captured.err
    out_file = tmp_path / "c.ckpt"
    assert cli.main(["checkpoint", "consolidate", str(folders["whole"]), str(out_file)]) == 0
    assert cli.main(["checkpoint", "inspect", str(out_file)]) == 0
    assert "single file" in capsys.readouterr().out
    assert cli.main(["checkpoint", "consolidate", str(folder), str(tmp_path / "d.ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is truncated or overwritten" in err and not (tmp_path / "d.ckpt").exists()


def _sharded_save(folder, source, step: int, fail_manifest: bool = False, monkeypatch=None):
    """resume/sharded/save.py's save path in one process, as ShardedSaver runs it; fail_manifest: the process dies
    (an error) after every file is written, before the manifest."""
    from lit_pretrain.resume.sharded import save as sharded

    model, optimizer, _ = source
    chunks = {**sharded.model_chunks(model, None), **sharded.optimizer_chunks(model, optimizer, None)}
    sharded._prepare_folder(folder, 0, None)
    written = sharded._save_torch({"global_step": step}, folder, 0)
    if fail_manifest:
        def die(*args, **kwargs):
            raise KeyboardInterrupt("killed before the manifest")

        monkeypatch.setattr(sf, "write_manifest", die)
        with pytest.raises(KeyboardInterrupt):
            sharded._save_files(folder, chunks, None, {"step": step, "meta": {}, "layout": {}, "world_size": 1},
                                None, written)
        monkeypatch.undo()
        return
    sharded._save_files(folder, chunks, None, {"step": step, "meta": {}, "layout": {}, "world_size": 1}, None,
                        written)


def test_saving_a_step_again_keeps_its_complete_checkpoint_until_the_new_one_is(source, tmp_path, monkeypatch):
    """A run resumed from an earlier step saves a step it had saved before: a save cut short leaves the complete
    folder of that step as it was (only a hidden staging folder beside it), and the next save of the step replaces
    it whole and tidies the leftovers."""
    folder = tmp_path / "step0000001"
    _sharded_save(folder, source, 1)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    _sharded_save(folder, source, 1, fail_manifest=True, monkeypatch=monkeypatch)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    sf.verify_sharded(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step0000001.saving", "step0000001"]
    _sharded_save(folder, source, 1)
    sf.verify_sharded(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step0000001"]  # no staging, no replaced folder left


def test_a_crash_between_the_two_renames_loses_no_checkpoint(source, tmp_path):
    """_install renames the old folder aside, then the new one into place: cut between the two, the next save
    renames the old complete folder back before tidying."""
    from lit_pretrain.resume.sharded import save as sharded

    folder = tmp_path / "step0000001"
    _sharded_save(folder, source, 1)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    os.rename(folder, tmp_path / ".step0000001.replaced")
    (tmp_path / ".step0000001.saving").mkdir()
    sharded._prepare_folder(tmp_path / "step0000002", 0, None)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step0000002.saving", "step0000001"]


def test_a_link_named_like_the_step_folder_is_refused_and_its_target_kept(source, tmp_path):
    from lit_pretrain.errors import RunFolderError
    from lit_pretrain.resume.sharded import save as sharded

    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("user data")
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "step0000001").symlink_to(target)
    with pytest.raises(RunFolderError, match="symbolic link"):
        sharded._prepare_folder(checkpoints / "step0000001", 0, None)
    assert (target / "keep.txt").read_text() == "user data"
