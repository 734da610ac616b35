"""A context-extension stage (docs/resume.md): a run at model.seq_len 64 is continued at 128 with RoPE scaling
from its checkpoint (run.resume=<checkpoint>, run.resume_allow_changes=[model.seq_len, model.rope_scaling, ...]).
The weights at the start of stage 2 are the checkpoint's, its first batch starts at exactly the next unseen token of
the data order, no token is skipped or repeated across the boundary nor across a SIGKILL inside stage 2.
Plus the refusals at config load and the remap's arithmetic (in-process, cheap)."""

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_pretrain import config
from lit_pretrain.data.datamodule import epoch_seed
from lit_pretrain.data.shards import load_manifest
from lit_pretrain.data.train_loader import remap_to_window
from lit_pretrain.errors import ConfigError
from lit_pretrain.resume import store
from lit_pretrain.resume.checkpointing import as_micro_batches_done
from lit_pretrain.resume.weights import read_checkpoint
from lit_pretrain.runs.folder import read_metrics, series
from tests.conftest import EXPERIMENTS, run_module, tiny_data_overrides, train_args

BLOCK = 384  # data.shuffle_block_tokens: 6 windows of 64 tokens, 3 of 128
COMMON = ["trainer.tokens_per_step=512", "trainer.log_every_n_steps=1", "trainer.progress_bar=false",
          "trainer.val_every_n_steps=100", "trainer.val_windows=4", "schedule.warmup_steps=1", "trainer.compile=false",
          f"data.shuffle_block_tokens={BLOCK}"]
# Stage 2: twice the context, Llama 3.1's rule with factor 2 over stage 1's 64 tokens; 4 windows of 128 a step (the
# same 512 tokens a step as stage 1's 8 of 64); the schedule runs on to step 5.
STAGE2 = ["model.seq_len=128", "trainer.micro_batch_size=4", "trainer.max_steps=5",
          "trainer.checkpoint_every_n_steps=1",
          "model.rope_scaling={type: llama3, factor: 2.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
          "original_seq_len: 64}",
          "run.resume_allow_changes=[model.seq_len, model.rope_scaling, trainer.max_steps]"]


def extra(out: Path, fault=None) -> str:
    items = [f"{{class_path: 'tests.helpers.resume_helpers:RecordTokens', init_args: {{out: '{out}'}}}}"]
    if fault is not None:
        items.append(f"{{class_path: 'tests.helpers.resume_helpers:Fault', init_args: {json.dumps(fault)}}}")
    return f"callbacks.extra=[{', '.join(items)}]"


def tokens(out: Path) -> list:
    """Every micro-batch's rows of input ids in training order, as one list of windows."""
    rows = [json.loads(line) for line in Path(f"{out}.rank0.jsonl").read_text().splitlines()]
    return [window for row in rows for window in row["tokens"]]


def block_stream(data_dir: Path, seed: int, n_tokens: int) -> np.ndarray:
    """The first n_tokens of epoch 0's order as the data promises it, read here from the shards themselves: blocks
    of BLOCK consecutive tokens of each train shard ((n - 1) // BLOCK of a shard of n), permuted by the epoch's seed,
    each read whole."""
    manifest = load_manifest(data_dir)
    blocks = []
    for shard in manifest["splits"]["train"]["shards"]:
        ids = np.fromfile(data_dir / shard["file"], dtype=manifest["dtype"])
        blocks += [ids[j * BLOCK:(j + 1) * BLOCK] for j in range((len(ids) - 1) // BLOCK)]
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(epoch_seed(seed, 0))).tolist()
    return np.concatenate([blocks[i] for i in order])[:n_tokens].astype(np.int64)


@pytest.mark.slow
def test_stage_continues_weights_and_the_next_unseen_token_across_a_sigkill(tmp_path, tiny_data_dir):
    def train(name, *overrides, fault=None, rc=0):
        return run_module(*train_args(tiny_data_dir, tmp_path, name), *COMMON, *overrides,
                          extra(tmp_path / name, fault), rc=rc, start_new_session=True)

    # Stage 1: 2 steps of 8 windows of 64 tokens: 1,024 tokens, two blocks and 4 of the third's 6 windows; in
    # micro-batches of 4 windows (256 tokens), stage 2's of 4 windows of 128 (512 tokens).
    train("stage1", "trainer.max_steps=2", "trainer.checkpoint_every_n_steps=2", "trainer.micro_batch_size=4")
    checkpoint = tmp_path / "stage1" / "checkpoints" / store.step_file(2)
    # Stage 2, a new run folder continuing stage 1's checkpoint, killed at the start of step 5 (after step 4's
    # checkpoint), then resumed from its own checkpoint with run.resume=auto.
    train("stage2", *STAGE2, f"run.resume={checkpoint}", fault={"step": 4, "micro_batch": 0}, rc=-signal.SIGKILL)
    train("stage2", *STAGE2, "run.resume=auto")

    # The weights stage 2 starts from are stage 1's last ones, bit for bit.
    saved = read_checkpoint(tmp_path / "stage1" / "checkpoints" / store.step_file(2))["state_dict"]
    start = torch.load(tmp_path / "stage2.start.pt", weights_only=True)
    assert start.keys() and all(torch.equal(saved[f"model.{k}"], v) for k, v in start.items())

    # The data: stage 1's 16 windows of 64 then stage 2's 12 of 128 are, end to end, the first 2,560 tokens of the
    # block order: stage 2's first window starts at token 1,024 (mid-block: the third block's 257th token), the
    # next one stage 1 did not train on; none skipped, none repeated. Stage 2's killed attempt read steps 3, 4 and
    # the start of 5 (4 windows a step); its resumption step 5's same 4 windows, and nothing else.
    one, two = tokens(tmp_path / "stage1"), tokens(tmp_path / "stage2")
    assert [len(w) for w in one] == [64] * 16 and [len(w) for w in two] == [128] * 16
    stream = block_stream(tiny_data_dir, 1337, 16 * 64 + 12 * 128)
    assert np.array_equal(np.concatenate(one), stream[:1024])
    assert two[0] == stream[1024:1152].tolist()  # the first batch of stage 2: exactly the next unseen token
    assert np.array_equal(np.concatenate(two[:12]), stream[1024:])
    assert two[12:] == two[8:12]
    # Lightning counts stage 2's epoch in its own micro-batches: 2 done (stage 1's 4 of half the tokens), so the
    # epoch ends when the data does, not 2 micro-batches early.
    rows = [json.loads(line) for line in Path(f"{tmp_path / 'stage2'}.rank0.jsonl").read_text().splitlines()]
    assert [r["ready"] for r in rows] == [3, 4, 5, 5]
    # One step count across the stages and the kill: steps 3, 4, 5 each logged once in stage 2's run folder.
    assert [s for s, _ in series(read_metrics(tmp_path / "stage2" / "metrics.csv"), "train/loss")] == [3, 4, 5]
    # The schedule continues (optim/stages.py): stage 1's cosine (warmup 1, 2 steps) ended at its lr_min 1e-4, and
    # stage 2 holds it, its resumption after the kill too (a cosine recomputed over 5 steps re-warmed to 5.5e-4 at
    # step 3). 1e-6 relative: self.log stores the rate as float32.
    lr = dict(series(read_metrics(tmp_path / "stage2" / "metrics.csv"), "train/lr"))
    assert [lr[s] for s in (3, 4, 5)] == pytest.approx([1e-4] * 3, rel=1e-6)
    assert json.loads((tmp_path / "stage2" / "summary.json").read_text())["schedule"]["how"] == "continued"


def test_remap_by_token_offset():
    # 16 windows of 64 = 1,024 tokens = 8 windows of 128; a dropped stretch is remapped the same way.
    state = {"epoch": 0, "trained_samples": 16, "pending_drop_samples": 4, "dropped": [], "window_tokens": 64}
    assert remap_to_window(state, 128) == {**state, "trained_samples": 8, "pending_drop_samples": 2,
                                           "window_tokens": 128}
    assert remap_to_window(state, 64) is state  # the same length: unchanged
    with pytest.raises(ConfigError, match=r"model\.seq_len=384: .*trained_samples=16 windows of 64 tokens = 1024"):
        remap_to_window(state, 384)
    # Lightning's counts of the epoch's and the run's micro-batches, in the in-flight form (ready = completed + 1),
    # moved to 2 and 6: the form is kept.
    counts = {"ready": 4, "started": 4, "processed": 4, "completed": 3}
    fit_loop = {"epoch_loop.batch_progress": {"current": dict(counts), "total": dict(counts)}}
    as_micro_batches_done(fit_loop, 2, 6)
    assert fit_loop["epoch_loop.batch_progress"] == {
        "current": {"ready": 2, "started": 2, "processed": 2, "completed": 1},
        "total": {"ready": 6, "started": 6, "processed": 6, "completed": 5}}


@pytest.mark.parametrize("overrides,match", [
    (["data.shuffle_block_tokens=100"], r"data\.shuffle_block_tokens=100 is not a multiple of model\.seq_len=64"),
    (["run.resume_allow_changes=[model.seq_len]"], r"lists model\.seq_len .* data\.shuffle_block_tokens is null"),
    (["data.shuffle_block_tokens=128", "data.sources=[{name: a, prepared_dir: x}]"],
     r"data\.shuffle_block_tokens with data\.sources is not supported"),
], ids=["block-not-multiple", "stage-without-block", "block-with-mixture"])
def test_stage_refusals_at_config_load(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", [*tiny_data_overrides(Path("unused")), *overrides])
