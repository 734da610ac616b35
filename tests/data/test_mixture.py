"""Weighted mixtures of sources (data/mixture.py): the interleave as a pure function of the slot, its proportions,
schedule switches, the resume state, per-source validation, and the refusals of bad mixtures."""

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lit_pretrain import config
from lit_pretrain.data.datamodule import TokenShardDataModule
from lit_pretrain.data.mixture import PERIOD, MixtureOrder, MixtureSampler
from lit_pretrain.data.preparation.prepare import prepare
from lit_pretrain.data.tokenizer import EOD, token_byte_lengths, train_tokenizer
from lit_pretrain.errors import ConfigError, DataError
from lit_pretrain.schema import DataConfig, MixturePhase, SourceConfig
from tests.data.test_data import synthetic_documents, write_corpus

SEQ_LEN = 16


def order(weights=(1.0, 3.0), sizes=(50, 70), schedule=(), samples_per_step=8, max_epochs=None):
    return MixtureOrder(["a", "b", "c", "d"][: len(weights)], sizes, [(0, list(weights)), *schedule], samples_per_step,
                        seed=3, max_epochs=max_epochs)


def test_slot_order_is_a_pure_function_shared_by_every_world_size():
    o = order(schedule=[(5, [2.0, 1.0])])
    whole = o.windows(0, 400)
    # Any stretch computed on its own (a resume, another epoch's start) equals the same stretch of the whole.
    assert np.array_equal(np.concatenate([o.windows(0, 37), o.windows(37, 200), o.windows(200, 400)]), whole)
    assert np.array_equal(order(schedule=[(5, [2.0, 1.0])]).windows(0, 400), whole)  # no hidden state or clock
    # 1, 2 and 4 ranks (global micro-batch 8 each): the union of the ranks' k-th micro-batches is one global batch.
    steps = {}
    for world, micro in ((1, 8), (2, 4), (4, 2)):
        ranks = [list(MixtureSampler(o, micro, r, world)) for r in range(world)]
        steps[world] = [sorted(i for r in ranks for i in r[k * micro:(k + 1) * micro]) for k in range(20)]
    assert steps[1] == steps[2] == steps[4]
    assert steps[1][0] == sorted(whole[:8].tolist())


def test_proportions_stay_within_two_slots_of_the_weights_over_a_long_horizon():
    """Every prefix of a phase holds each source within 2 slots of its share of the period (the deadline order's
    bound, measured at 1.44 slots over random weights), and the period's shares are the weights to 1/2^16."""
    weights = np.array([0.5, 0.2, 0.17, 0.13])
    o = MixtureOrder(["w", "x", "y", "z"], [1000] * 4, [(0, weights)], 8, seed=0)
    n = 400_000
    src, draw = o.sources(0, n)
    counts = np.stack([np.cumsum(src == k) for k in range(4)])  # (sources, n): draws after each slot
    quantized = o.phases[0][1] / o.phases[0][1].sum()
    assert np.abs(counts - np.outer(quantized, np.arange(1, n + 1))).max() < 2
    assert np.abs(quantized - weights / weights.sum()).max() <= 0.5 / PERIOD + 1e-12
    assert np.abs(counts[:, -1] / n - weights).max() < 2 / n + 1 / PERIOD
    assert np.array_equal(o.draws_before(n), counts[:, -1])
    for k in range(4):  # each source's draws are numbered 0, 1, 2, ... in slot order
        assert np.array_equal(draw[src == k], np.arange(counts[k, -1]))


def test_schedule_switches_weights_at_the_given_step():
    o = order(weights=(1.0, 1.0), schedule=[(10, [0.0, 1.0]), (20, [1.0, 0.0])], samples_per_step=8)
    src, _ = o.sources(0, 240)
    assert src[:80].tolist().count(0) == 40  # steps 0-9: half and half
    assert set(src[80:160].tolist()) == {1}  # from global_step 10: b only
    assert set(src[160:].tolist()) == {0}  # from global_step 20: a only


def test_a_source_past_max_epochs_is_refused_by_key():
    o = order(weights=(1.0, 1.0), sizes=(10, 1000), max_epochs=[2, None])
    o.check_max_epochs(40)  # 20 draws of a: exactly 2 epochs
    with pytest.raises(ConfigError, match=r"data.sources\[0\].max_epochs=2: .* 2.10 epochs"):
        o.check_max_epochs(42)
    windows = o.windows(0, 60)
    assert (windows[40:] == -1).sum() == 10  # the slots past the limit are marked, and only those
    assert (windows[:40] >= 0).all()


# Prepared sources: two tiny synthetic corpora, the second tokenized with the first's tokenizer.


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    for name, seed in (("a", 0), ("b", 1)):
        write_corpus(root / f"corpus-{name}", synthetic_documents(60, seed=seed))
    data = DataConfig(prepared_dir=str(root / "prepared"), vocab_size=300, val_fraction=0.1, shard_tokens=4096,
                      sources=[SourceConfig(name="a", corpus="text", paths=[str(root / "corpus-a")]),
                               SourceConfig(name="b", corpus="text", paths=[str(root / "corpus-b")], weight=3.0)],
                      mixture_schedule=[MixturePhase(step=4, weights={"a": 3.0, "b": 1.0})])
    data = replace(data, deduplication=replace(data.deduplication, processes=1))
    TokenShardDataModule(data, seq_len=SEQ_LEN, micro_batch_size=4, seed=0, val_windows=8).prepare_data()
    return data, root


def make_dm(data, rank=0, world_size=1, micro_batch_size=4, accumulate=2, new_mixture=False):
    dm = TokenShardDataModule(data, seq_len=SEQ_LEN, micro_batch_size=micro_batch_size, seed=5, val_windows=12,
                              rank=rank, world_size=world_size, accumulate_grad_batches=accumulate,
                              new_mixture=new_mixture)
    dm.setup()
    return dm


def take(loader, n):
    out, it = [], iter(loader)
    for _ in range(n):
        x, _ = next(it)
        out.append(x)
        loader.take_trained_indices()  # as training would claim each batch
    return out


def test_prepared_sources_share_the_first_tokenizer(mixture):
    data, root = mixture
    dm = make_dm(data)
    a, b = dm.source_manifests
    assert a["tokenizer"]["sha256"] == b["tokenizer"]["sha256"] and "loaded from" in b["tokenizer"]["source"]
    assert dm.tokenizer_path == root / "prepared" / "a" / "tokenizer.json"
    assert len(dm.train_dataset) == sum(len(p) for p in dm.train_dataset.parts)


def test_resume_state_round_trips_mid_epoch_on_any_world_size(mixture):
    data, _ = mixture
    dm = make_dm(data)
    loader = dm.train_dataloader()
    expected = take(loader, 14)  # 7 optimizer steps of 2 micro-batches: crosses the step-4 schedule switch
    dm = make_dm(data)
    loader = dm.train_dataloader()
    take(loader, 6)
    state = loader.state_dict()
    draws = {name: s["draws"] for name, s in state["sources"].items()}
    assert draws == {"a": 6, "b": 18} and state["trained_samples"] == 24  # 3 steps of 8 windows at 1:3
    again = make_dm(data).train_dataloader()
    again.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(take(again, 8), expected[6:]))
    # Two ranks of 2 continue the same global batches from the one-process state.
    ranks = [make_dm(data, rank=r, world_size=2, micro_batch_size=2).train_dataloader() for r in (0, 1)]
    for r in ranks:
        r.load_state_dict(state)
    got = [take(r, 8) for r in ranks]
    for j in range(8):  # micro-batch j of each rank = half of the one-process micro-batch j, interleaved
        merged = torch.stack([got[0][j], got[1][j]], dim=1).reshape(4, SEQ_LEN)
        assert torch.equal(merged, expected[6 + j])
    # A mixture that would have drawn otherwise before the checkpoint is refused, naming the keys.
    changed = replace(data, sources=[data.sources[0], replace(data.sources[1], weight=1.0)])
    with pytest.raises(ConfigError, match="data.mixture_schedule only after"):
        make_dm(changed).train_dataloader().load_state_dict(state)


def test_a_stage_order_continues_each_source_where_it_stood():
    """A stage's mixture (b kept, c new, a left out) rebased at slot 40 of the first mixture: b continues at its
    41st-slot position on the same windows, c starts at its first, the stage's interleave starts afresh."""
    first = order()  # a:b = 1:3 over sizes 50, 70
    draws = first.draws_before(40)
    assert draws.tolist() == [10, 30]
    stage = MixtureOrder(["b", "c"], [70, 30], [(0, [3.0, 1.0])], samples_per_step=8, seed=3)
    stage.rebase(40, [draws[1], 0])
    src, draw = stage.sources(40, 48)
    assert src.tolist() == [0, 0, 1, 0, 0, 0, 1, 0]  # deadlines (j + 1/2)/a_k, ties to the lower index
    assert draw.tolist() == [30, 31, 0, 32, 33, 34, 1, 35]
    got = stage.windows(40, 48)
    b_next = first.permutation(1, 0)[30:36]  # b's permutation is a function of (seed, name, epoch): the same
    assert (got[src == 0] - stage.offsets[0]).tolist() == b_next.tolist()
    assert (got[src == 1] - stage.offsets[1]).tolist() == stage.permutation(1, 0)[:2].tolist()
    assert (stage.windows(36, 40) == -3).all()  # slots of the earlier mixture: a marker MixtureWindows refuses
    assert stage.draws_before(48).tolist() == [36, 2] and stage.state(48)["c"]["position"] == 2


def test_a_stage_on_a_new_mixture_resumes_inside_on_any_world_size_and_a_later_stage_continues(mixture):
    data, root = mixture
    dm = make_dm(data)
    original = dm.train_dataloader()
    take(original, 6)  # 3 steps of 8 windows: a 6, b 18
    state = original.state_dict()
    # The stage: b alone (a left out and carried; b's tokenizer named, as a's folder gave it), no schedule.
    stage_data = replace(data, sources=[replace(data.sources[1], weight=1.0)], mixture_schedule=[],
                         tokenizer_path=str(root / "prepared" / "a" / "tokenizer.json"))
    with pytest.raises(ConfigError, match="run.resume_allow_changes"):
        make_dm(stage_data).train_dataloader().load_state_dict(state)
    whole = make_dm(stage_data, new_mixture=True).train_dataloader()
    whole.load_state_dict(state)
    expected = take(whole, 8)
    end = whole.state_dict()
    assert end["sources"]["b"]["draws"] == 18 + 32 and end["carried"] == {"a": 6}
    assert end["mixture_start"] == {"slot": 24, "draws": {"b": 18}}
    # Inside the stage: stopped after 4 micro-batches, continued on 2 ranks of micro-batch 2 (no stage flag needed).
    part = make_dm(stage_data, new_mixture=True).train_dataloader()
    part.load_state_dict(state)
    take(part, 4)
    mid = part.state_dict()
    ranks = [make_dm(stage_data, rank=r, world_size=2, micro_batch_size=2).train_dataloader() for r in (0, 1)]
    for r in ranks:
        r.load_state_dict(mid)
    got = [take(r, 4) for r in ranks]
    for j in range(4):
        assert torch.equal(torch.stack([got[0][j], got[1][j]], dim=1).reshape(4, SEQ_LEN), expected[4 + j])
    # A later stage on the first mixture: a continues at its 7th window, b past the stage's; nothing repeats.
    later = make_dm(data, new_mixture=True)
    loader = later.train_dataloader()
    loader.load_state_dict(end)
    assert later.source_progress()["a"]["tokens_seen"] == 6 * SEQ_LEN
    seen = []
    it = iter(loader)
    for _ in range(4):
        next(it)
        seen += loader.take_trained_indices()
    unbroken = original.sampler.order.windows(0, 200)  # the first mixture never interrupted: a's windows in turn
    a_windows = unbroken[unbroken < later.train_dataset.offsets[1]].tolist()
    a_seen = [w for w in seen if w < later.train_dataset.offsets[1]]
    assert len(a_seen) == 12 and a_seen == a_windows[6:18]  # 16 windows at the 3:1 of the schedule's step 4 on
    assert loader.state_dict()["sources"]["b"]["draws"] > 50 and loader.state_dict()["carried"] == {}


def test_validation_batches_hold_one_source_each(mixture):
    data, _ = mixture
    dm = make_dm(data, rank=1, world_size=2, micro_batch_size=3)
    loader = dm.val_dataloader()
    batches = list(loader.batch_sampler)
    offsets = dm.val_dataset.offsets
    assert sorted(set(dm.val_batch_sources)) == [0, 1] and len(batches) == len(dm.val_batch_sources) <= 4
    for batch, k in zip(batches, dm.val_batch_sources):
        assert all(offsets[k] <= i < offsets[k + 1] for i in batch)


def test_a_source_prepared_with_another_tokenizer_is_refused(mixture, tmp_path):
    data, root = mixture
    other = replace(data, prepared_dir=str(tmp_path / "other"), sources=[], mixture_schedule=[], corpus="text",
                    paths=[str(root / "corpus-b")], vocab_size=280)
    prepare(other, log=lambda *_: None)  # its own tokenizer
    mixed = replace(data, sources=[data.sources[0], replace(data.sources[1], prepared_dir=other.prepared_dir)])
    with pytest.raises(DataError, match=r"data.sources\[1\].prepared_dir .* another tokenizer"):
        TokenShardDataModule(mixed, seq_len=SEQ_LEN, micro_batch_size=4, seed=0, val_windows=8).prepare_data()


@pytest.mark.parametrize("overrides, message", [
    (["data.sources=[{name: a, weight: -1}]"], r"data.sources\[0\].weight=-1.0: a weight is a finite number >= 0"),
    (["data.sources=[{name: a, weight: 0}, {name: b, weight: 0}]"], "data.sources: every weight is 0"),
    (["data.sources=[{name: ../x}]"], r"data.sources\[0\].name='../x': expected one folder name"),
    (["data.sources=[{name: a}, {name: a}]"], r"data.sources\[1\].name='a' names a source twice"),
    (["data.sources=[{name: a}]", "data.mixture_schedule=[{step: 5, weights: {c: 1}}]"],
     r"data.mixture_schedule\[0\].weights names 'c'"),
    (["data.sources=[{name: a}, {name: b}]", "data.mixture_schedule=[{step: 5, weights: {a: 0, b: 0}}]"],
     r"data.mixture_schedule\[0\]: every weight is 0"),
    (["data.sources=[{name: a, max_documents: 0}]"], r"data.sources\[0\].max_documents=0: expected a value >= 1"),
])
def test_bad_mixtures_are_refused_at_config_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load(None, overrides)


def test_bits_per_byte_per_source_against_a_hand_count(tmp_path):
    import lightning as L
    from torch.utils.data import DataLoader

    from lit_pretrain.model.config import GPTConfig
    from lit_pretrain.module import PretrainModule
    from lit_pretrain.schema import OptimConfig, ScheduleConfig

    tokenizer = train_tokenizer(["héllo wörld, ☃ snow\n" * 4, "plain ascii text here\n"] * 3, vocab_size=280)
    eod = tokenizer.token_to_id(EOD)
    texts = {"a": "wörld ☃ héllo snow, plain text\n", "b": "plain text here\n"}  # 35 and 16 UTF-8 bytes
    pairs = []
    for text in texts.values():
        ids = [eod] + tokenizer.encode(text).ids + [eod]
        pairs.append((torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])))

    class Data(L.LightningDataModule):
        token_bytes = token_byte_lengths(tokenizer)
        source_names = list(texts)
        val_batch_sources = [1, 0]  # batch 0 holds source b, batch 1 source a

        def val_dataloader(self):
            return DataLoader([(x[0], y[0]) for x, y in reversed(pairs)], batch_size=1)

    cfg = GPTConfig(vocab_size=tokenizer.get_vocab_size(), n_layers=1, d_model=32, n_heads=2, seq_len=64)
    module = PretrainModule(cfg, OptimConfig(), ScheduleConfig(), max_steps=1, tokens_per_step=1, seed=0)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path)
    logged = trainer.validate(module, datamodule=Data(), verbose=False)[0]
    with torch.no_grad():
        nats = {name: F.cross_entropy(module.model(x)[0], y[0], reduction="sum").item()
                for name, (x, y) in zip(texts, pairs)}
    tokens = {name: y.numel() for name, (_, y) in zip(texts, pairs)}
    for name, n_bytes in (("a", 35), ("b", 16)):
        assert len(texts[name].encode("utf-8")) == n_bytes
        assert logged[f"val/{name}/loss"] == pytest.approx(nats[name] / tokens[name], rel=1e-5)
        assert logged[f"val/{name}/bits_per_byte"] == pytest.approx(nats[name] / n_bytes / math.log(2), rel=1e-5)
    assert logged["val/bits_per_byte"] == pytest.approx(sum(nats.values()) / 51 / math.log(2), rel=1e-5)


def test_train_refuses_max_steps_that_pass_a_source_max_epochs(mixture):
    data, _ = mixture
    limited = replace(data, sources=[data.sources[0], replace(data.sources[1], max_epochs=1.0)])
    dm = make_dm(limited)
    size_b = len(dm.train_dataset.parts[1])
    # b draws 6 of each step's 8 windows before the step-4 switch and 2 after: size_b steps pass over it twice.
    with pytest.raises(ConfigError, match=r"data.sources\[1\].max_epochs=1.0: "):
        dm.check_mixture(dm.train_dataset, max_steps=size_b, samples_per_step=8)
    dm.check_mixture(dm.train_dataset, max_steps=4, samples_per_step=8)  # 24 of its windows: within one pass


def test_a_mixture_runs_tokenizer_is_in_its_first_sources_folder():
    """generate, evaluate and export find a run's tokenizer through data/shards.py tokenizer_folder: for a mixture
    the first source's folder (every source shares its tokenizer), not data.prepared_dir, which holds no manifest."""
    from lit_pretrain.data.shards import tokenizer_folder

    assert tokenizer_folder(DataConfig(prepared_dir="data/one")) == Path("data/one")
    mix = DataConfig(prepared_dir="data/mix", sources=[SourceConfig(name="web"), SourceConfig(name="books")])
    assert tokenizer_folder(mix) == Path("data/mix/web")
    own = DataConfig(prepared_dir="data/mix", sources=[SourceConfig(name="web", prepared_dir="elsewhere/web")])
    assert tokenizer_folder(own) == Path("elsewhere/web")
