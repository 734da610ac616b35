"""data.packing=best_fit (data/packing.py): the packing itself as a table and as properties, the packed windows of a
prepared corpus (whole documents, the boundaries document masking finds, the same global batches on any number of
ranks, an exact resume), the figures `prepare` prints and the config's refusals."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_pretrain import cli, config
from lit_pretrain.data.datamodule import TokenShardDataModule
from lit_pretrain.data.packing import best_fit, concat_stats, document_spans, packing_stats
from lit_pretrain.data.shards import open_shard
from lit_pretrain.errors import ConfigError
from lit_pretrain.model.gpt import document_ids
from lit_pretrain.resume import store
from lit_pretrain.runs.folder import read_metrics, series
from tests.conftest import EXPERIMENTS, run_module, tiny_data_overrides, train_args

SEQ = 32


def test_best_fit_table():
    # Capacity 8, buffer 4, documents 3 5 2 7 4 (worked by hand): window 0 takes the 7 (the longest that fits) and
    # its last slot, a target only, the first token of the longest left (5) without cutting it; window 1 takes the
    # 5 and the 3; window 2 would hold 4 + 2 and no more documents come, so it is dropped, as concat drops a tail.
    offsets, doc, start, length = best_fit([3, 5, 2, 7, 4], capacity=8, buffer=4)
    assert offsets.tolist() == [0, 2, 4]
    assert list(zip(doc.tolist(), start.tolist(), length.tolist())) == [(3, 0, 7), (1, 0, 1), (1, 0, 5), (0, 0, 3)]
    # A document longer than a window is cut into windows that share one token, as concat's do: 10 = 4 + 3 + 3.
    offsets, doc, start, length = best_fit([10], capacity=4, buffer=1)
    assert list(zip(start.tolist(), length.tolist())) == [(0, 4), (3, 4), (6, 4)]
    stats = packing_stats(np.array([10]), 4, doc, length, offsets)
    assert stats["documents_cut"] == 1.0 and stats["tokens_dropped"] == 0.0


@pytest.mark.parametrize("buffer", [1, 16, 1000])
def test_best_fit_fills_every_window_and_places_every_token_once(buffer):
    rng = np.random.default_rng(buffer)
    lengths = rng.geometric(1 / 20, size=2000) + 1
    capacity = 65
    offsets, doc, start, length = best_fit(lengths, capacity, buffer)
    sums = np.add.reduceat(length, offsets[:-1])
    assert (sums == capacity).all()  # no padding: every window exactly full
    assert (start + length <= lengths[doc]).all()
    # Each document's pieces, in order, cover it with one shared token between neighbours, up to the dropped tail.
    covered = {}
    for d, s, n in zip(doc.tolist(), start.tolist(), length.tolist()):
        if n == 1 and s == covered.get(d, 0):
            continue  # a last-slot filler: the piece stays whole for a later window
        assert s == max(0, covered.get(d, 0) - 1), (d, s)
        covered[d] = s + n
    # Left out: the buffer's last contents and the partial last window (documents have 2 tokens or more).
    incomplete = [d for d in range(len(lengths)) if covered.get(d) != lengths[d]]
    assert len(incomplete) <= buffer + capacity // 2
    stats = packing_stats(lengths, capacity, doc, length, offsets)
    assert stats["tokens_dropped"] * lengths.sum() == pytest.approx(lengths.sum() - sum(covered.values()))
    if buffer > 1:  # choosing among documents is what cuts fewer of them
        assert stats["documents_cut"] < 0.25 * concat_stats([lengths], capacity - 1)["documents_cut"]


def test_concat_stats_table():
    # seq_len 4: windows cover tokens [0,4], [4,8], [8,12] of a 14-token shard (token 13 is the dropped tail).
    # Documents [0,3) whole in window 0; [3,5) ends on the shared token 4 (not cut); [5,11) crosses edge 8 (cut);
    # [11,14) begins in window 2 and ends past it (cut).
    stats = concat_stats([np.array([3, 2, 6, 3])], 4)
    assert stats == {"documents": 4, "windows": 3, "documents_cut": 0.5, "padding": 0.0, "tokens_dropped": 1 / 14}
    starts, lengths = document_spans(np.array([5, 0, 7, 7, 0, 3]), eod_id=0)
    assert starts.tolist() == [0, 2, 5] and lengths.tolist() == [2, 3, 1]  # a tail without an EOD is a document


@pytest.fixture(scope="module")
def data(tiny_data_dir):
    cfg = config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", tiny_data_overrides(tiny_data_dir)))
    return replace(cfg.data, packing="best_fit", packing_buffer=64)


def make_dm(data, micro_batch_size=8, rank=None, world_size=None, seq_len=SEQ):
    dm = TokenShardDataModule(data, seq_len=seq_len, micro_batch_size=micro_batch_size, seed=3, val_windows=8,
                              rank=rank, world_size=world_size)
    dm.setup()
    return dm


def test_packed_windows_hold_whole_documents_where_document_masking_finds_them(data):
    dm = make_dm(data)
    ds, manifest = dm.train_dataset, dm.manifest
    eod = manifest["tokenizer"]["eod_id"]
    tokens = np.concatenate([np.asarray(open_shard(Path(data.prepared_dir) / s["file"], manifest["dtype"]))
                             for s in manifest["splits"]["train"]["shards"]])
    assert len(ds) == ds.stats["windows"] and ds.stats["padding"] == 0.0
    for w in np.linspace(0, len(ds) - 1, 64).astype(int).tolist():  # 64 windows spread over the split
        x, y = ds[w]
        assert x.shape == y.shape == (SEQ,) and torch.equal(x[1:], y[:-1])
        window = torch.cat([x, y[-1:]])
        a, b = ds.window_offsets[w], ds.window_offsets[w + 1]
        # Every piece but the first starts right after an EOD, so document_ids numbers the pieces (a document
        # masked alone is computed as if it were alone in the window).
        bounds = np.cumsum(ds.piece_length[a:b])[:-1]
        assert (window[bounds - 1] == eod).all()
        ids = document_ids(window[None, :-1], eod)[0]
        assert ids[-1].item() == int((bounds < SEQ).sum())
    docs = ds.stats["documents"]
    assert docs == int((tokens == eod).sum())
    # best_fit cuts a document only when it is longer than a window or fills one's end (at most one per window).
    long = sum(int((n > SEQ + 1).sum()) for n in ds.shard_lengths)
    assert long <= round(ds.stats["documents_cut"] * docs) <= long + len(ds)


def test_packed_order_is_one_global_order_on_any_number_of_ranks_and_resumes_exactly(data):
    single = make_dm(data)
    ranks = [make_dm(data, micro_batch_size=4, rank=r, world_size=2) for r in range(2)]
    loaders = [iter(dm.train_dataloader()) for dm in ranks]
    ref = iter(single.train_dataloader())
    rows = lambda x: sorted(map(tuple, x.tolist()))  # noqa: E731
    for _ in range(3):
        (x0, _), (x1, _), (xs, _) = next(loaders[0]), next(loaders[1]), next(ref)
        assert rows(torch.cat([x0, x1])) == rows(xs)
        for dm in ranks:
            dm.train_loader.take_trained_indices()  # trained (what the module's batch hook does in a run)
    # Resume the 2-rank run's position (3 global micro-batches trained) on 1 process: the next batch is the single
    # process's 4th.
    state = ranks[0].train_loader.state_dict()
    assert state["trained_samples"] == 3 * 8
    resumed = make_dm(data)
    loader = resumed.train_dataloader()
    loader.load_state_dict(state)
    assert torch.equal(next(iter(loader))[0], next(ref)[0])


def test_prepare_prints_the_share_of_documents_cut(tiny_data_dir, capsys):
    args = ["prepare", str(EXPERIMENTS / "runs" / "tiny.yaml"), *tiny_data_overrides(tiny_data_dir),
            f"model.seq_len={SEQ}", "data.packing_buffer=64"]
    assert cli.main(args) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("packing at")]
    assert len(line) == 1 and f"model.seq_len={SEQ}" in line[0] and "padding 0% either way" in line[0], line
    shown = float(line[0].split("best_fit (data.packing_buffer=64) ")[1].split("%")[0]) / 100
    stats = make_dm(replace(load_config_data(tiny_data_dir), packing="best_fit", packing_buffer=64)).packing_stats()
    assert shown == pytest.approx(stats["documents_cut"], abs=5e-4)


def load_config_data(folder):
    return config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", tiny_data_overrides(folder))).data


def test_best_fit_refuses_shuffle_blocks_at_load(tiny_data_dir):
    with pytest.raises(ConfigError, match="data.shuffle_block_tokens"):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", [*tiny_data_overrides(tiny_data_dir),
                                                          "data.packing=best_fit", "data.shuffle_block_tokens=128"])


@pytest.mark.slow
def test_a_packed_run_in_computed_order_resumes_on_two_processes(tiny_data_dir, tmp_path):
    """`lit-pretrain train` with best_fit, feistel and document masking: 4 steps on one process, and the same run
    resumed from its step-2 checkpoint on 2 data-parallel processes, whose steps 3 and 4 must train the same
    windows to the same losses."""
    common = ["data.packing=best_fit", "data.shuffle=feistel", "data.document_masking=true", "trainer.max_steps=4",
              "trainer.checkpoint_every_n_steps=2", "trainer.log_every_n_steps=1", "trainer.val_every_n_steps=4",
              "trainer.val_windows=8", "trainer.progress_bar=false", "schedule.warmup_steps=1",
              "strategy.timeout_seconds=60"]
    run_module(*train_args(tiny_data_dir, tmp_path, "one"), *common)
    resume = tmp_path / "one" / "checkpoints" / store.step_file(2)
    out = run_module(*train_args(tiny_data_dir, tmp_path, "two"), *common, "strategy=ddp", "trainer.devices=2",
                     "trainer.micro_batch_size=4", f"run.resume={resume}")
    assert sum(line.startswith(f"{tiny_data_dir}: packing at") for line in out.stdout.splitlines()) == 1  # rank 0
    one, two = (dict(series(read_metrics(tmp_path / name / "metrics.csv"), "train/loss")) for name in ("one", "two"))
    assert sorted(two) == [3, 4]
    # The same windows per step on 1 or 2 processes; the runs differ only in float summation order (two 4-window
    # gradient means averaged vs one 8-window mean): tests/resume/test_resume.py's tolerance, measured there.
    assert [two[k] for k in (3, 4)] == pytest.approx([one[k] for k in (3, 4)], abs=1e-5)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    expected = make_dm(replace(load_config_data(tiny_data_dir), packing="best_fit"), seq_len=64).packing_stats()
    assert summary["packing"] == expected and summary["packing"]["padding"] == 0.0
