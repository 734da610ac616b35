"""Sharded checkpoints (resume/sharded/save.py) written under one layout and read into another: the issue's matrix.

One spawn per world size runs its cases in turn (process start-up is the cost): on 2 processes ZeRO-3 x2 -> TP 2,
TP 2 -> ZeRO-3 x2 and PP 2 -> ZeRO-2 x2; on 4, ZeRO-3 x TP 2 written (then read here, in one process) and a
checkpoint written here in one process read into HSDP 2x2. Each: weights and AdamW state after the load against the
source's (gathered to single-process names), and one more step against the target layout trained without a
checkpoint (on 4 processes against one process trained throughout, to keep the spawn short: the HSDP layout's own
distance from one process is bounded alike by tests/parallel/test_mesh_parallel.py).
"""

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader

from lit_pretrain.errors import DataError
from lit_pretrain.planning.plan import ParallelPlan as Plan
from lit_pretrain.resume.sharded import save as sharded
from tests.conftest import free_port
from tests.helpers.mesh_workers import CFG
from tests.helpers.sharded_workers import K1, adamw, compare, data, full, init_model, save, train_steps, worker


def spawn(world, cases):
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(worker, args=(world, free_port(), cases, results), nprocs=world, join=True,
                           start_method="forkserver")
        return dict(results)


def check(r):
    # Loading moves bytes only (DCP copies each saved chunk's overlap into the target's chunk): bitwise.
    assert r["loaded"]["keys"] and r["loaded"]["bitwise"], r
    # The uninterrupted target run did its first K1 steps in another layout: float summation order only.
    # tests/parallel/test_mesh_parallel.py bounds the weights after 3 AdamW steps (lr 1e-2) at 5e-5 (0.5% of one update)
    # and the losses at a few fp32 ulps (2e-6 at ~4); a missing or zeroed moment moves the next update by ~lr = 1e-2.
    assert r["continued"]["keys"] and r["continued"]["max"] < 5e-5, r
    assert r["loss"] < 2e-6, r


@pytest.mark.slow
def test_two_process_reshard_matrix(tmp_path):
    zero3, tp2 = Plan(data_parallel_shard=2, zero_stage=3), Plan(tensor_parallel=2)
    cases = {"zero3_to_tp2": (zero3, tp2), "tp2_to_zero3": (tp2, zero3),
             "pp2_to_zero2": (Plan(pipeline_parallel=2, micro_batches=2), Plan(data_parallel_shard=2, zero_stage=2)),
             # a context-parallel checkpoint (ZeRO-3 over the 2 context ranks) into a layout without
             # context parallelism and back; loaded bitwise both ways. ZeRO-1 x CP 2 both ways too: each rank
             # writes the whole state of the tensors its ZeroRedundancyOptimizer updates, and reads only those
             "cp2_zero3_to_zero3": (Plan(context_parallel=2, zero_stage=3), zero3),
             "zero3_to_cp2_zero1": (zero3, Plan(context_parallel=2, zero_stage=1)),
             "cp2_zero1_to_zero3": (Plan(context_parallel=2, zero_stage=1), zero3)}
    results = spawn(2, [("reshard", (src, dst, tmp_path / name)) for name, (src, dst) in cases.items()])
    for name in cases:
        check(results[name])


@pytest.mark.slow
def test_four_process_reshard_to_and_from_one_process(tmp_path):
    xs, ys = data()
    # One process writes (no process group: DCP's single-process path); HSDP 2x2 reads it in the spawn.
    model, opt = init_model(), None
    opt = adamw(model)
    train_steps(None, model, opt, xs[:K1], ys[:K1])
    save(tmp_path / "single", None, model, opt)
    torch.save(full(None, model, opt), tmp_path / "single.full.pt")
    ref_model = init_model()
    ref_opt = adamw(ref_model)
    straight = train_steps(None, ref_model, ref_opt, xs, ys)  # one process throughout: the reference of both
    reference = full(None, ref_model, ref_opt)
    torch.save((reference, straight), tmp_path / "single.straight.pt")
    results = spawn(4, [("save", (Plan(data_parallel_shard=2, zero_stage=3, tensor_parallel=2),
                                  tmp_path / "zero3_tp2")),
                        ("load", (Plan(data_parallel_replicate=2, data_parallel_shard=2, zero_stage=3),
                                  tmp_path / "single"))])
    check(results["single"])
    # ZeRO-3 x TP 2 (4 processes) into one process, then one more step against one process throughout.
    model, opt = init_model(), None
    opt = adamw(model)
    folder = tmp_path / "zero3_tp2"
    # The vocabulary-parallel embedding and (tied) head were saved at their vocabulary offsets: each TP rank's V/2
    # rows, FSDP-sharded in two, make four chunks of V/4 rows (a replicated table would be two chunks of V/2).
    meta = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    V = CFG["vocab_size"]
    for key in ("model.tok_embeddings.weight", "model.lm_head.weight"):
        assert sorted((c.offsets[0], c.sizes[0]) for c in meta[key].chunks) == [(i * V // 4, V // 4) for i in range(4)]
    sharded.load_model(folder, model, None)
    sharded.load_optimizer(folder, model, None, opt, sharded.read_trainer_state(folder))
    loaded = full(None, model, opt)
    continued = train_steps(None, model, opt, xs[K1:], ys[K1:])
    check({"loaded": compare(torch.load(tmp_path / "zero3_tp2.full.pt", weights_only=True), loaded),
           "continued": compare(reference, full(None, model, opt)),
           "loss": abs(continued[-1] - straight[-1])})


def test_another_model_shape_is_refused_naming_the_key(tmp_path):
    """A checkpoint of another model shape: one DataError naming the folder and the tensor, nothing loaded."""
    model, opt = init_model(), None
    opt = adamw(model)
    save(tmp_path / "step0000002", None, model, opt)
    from lit_pretrain.model.config import GPTConfig
    from lit_pretrain.model.gpt import GPT
    from tests.helpers.mesh_workers import CFG

    other = GPT(GPTConfig(**{**CFG, "d_ff": 96}))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(DataError, match=r"step0000002: model\.blocks\.0\.mlp\.w_gate\.weight has shape \(64, 32\)"):
        sharded.load_model(tmp_path / "step0000002", other, None)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_folders_in_the_checkpoints_store(tmp_path):
    """resume/store.py with step folders: `latest` names the newest complete one and replaces a stale last.ckpt,
    an incomplete or corrupted newer folder is skipped with its reason and set aside (renamed, nothing deleted),
    keep-last-k deletes only older step folders (never a link's target), and load_gpt follows `latest`."""
    import os

    from lit_pretrain.resume import store
    from lit_pretrain.resume.weights import checkpoint_path

    folder = tmp_path / "run" / "checkpoints"
    model = init_model()
    opt = adamw(model)
    for step in (2, 4, 6):
        save(folder / store.step_dir(step), None, model, opt)
        store.publish(folder, folder / store.step_dir(step))
    (folder / "last.ckpt").write_bytes(b"stale")  # left by an earlier one-file session
    store.publish(folder, folder / store.step_dir(6))
    assert (folder / "latest").read_text() == "step0000006\n" and not (folder / "last.ckpt").exists()
    assert checkpoint_path(tmp_path / "run") == folder / "step0000006"
    # Step 8 lost its manifest (killed mid-write), step 10's data file has a flipped byte.
    for step in (8, 10):
        save(folder / store.step_dir(step), None, model, opt)
    (folder / "step0000008" / "manifest.json").unlink()
    data = folder / "step0000010" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    found, skipped = store.scan(folder)
    assert found == folder / "step0000006"
    assert [(p.name, why) for p, why in skipped] == [("step0000010", "sha256 differs from manifest.json"),
                                                      ("step0000008", "no manifest.json (incomplete)")]
    assert store.resolve("auto", tmp_path / "run") == folder / "step0000006"
    assert sorted(p.name for p in folder.iterdir() if "corrupt" in p.name) == ["step0000008.corrupt",
                                                                               "step0000010.corrupt"]
    # Given by path, the corrupted folder is refused in one line naming the file (the CLI exits 2 on a DataError).
    with pytest.raises(DataError, match=r"step0000010\.corrupt/__0_0\.distcp is corrupted") as refused:
        store.resolve(str(folder / "step0000010.corrupt"), tmp_path / "run")
    assert "\n" not in str(refused.value)
    # Retention: a link named like a step folder, pointing outside, is neither followed nor counted as ours.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    os.symlink(outside, folder / "step0000001")
    deleted = store.retain(folder, keep_last=2)
    assert [p.name for p in deleted] == ["step0000002"]
    assert sorted(p.name for p in folder.glob("step???????")) == ["step0000001", "step0000004", "step0000006"]
    assert (outside / "keep.txt").exists()


def test_checkpoint_format_follows_the_process_count_and_async_needs_sharded():
    from lit_pretrain import config
    from lit_pretrain.errors import ConfigError
    from lit_pretrain.planning.plan import build_plan
    from lit_pretrain.train import checkpoint_layout
    from tests.conftest import EXPERIMENTS

    def layout(*overrides):
        c = config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", list(overrides)))
        return checkpoint_layout(c, build_plan(c))

    assert layout() is None  # one process: one file
    assert layout("strategy=ddp", "trainer.devices=2")["data_parallel_replicate"] == 2  # sharded by default
    assert layout("strategy=ddp", "trainer.devices=2", "checkpoint.format=single") is None
    assert layout("checkpoint.format=sharded")["data_parallel_replicate"] == 1
    with pytest.raises(ConfigError, match=r"checkpoint\.async_save=true .* checkpoint\.format is single \(the "
                                          r"default for one process\): set checkpoint\.format=sharded"):
        layout("checkpoint.async_save=true")
