"""Data path: corpus reading, tokenizer, token shards + manifest, prepare's reuse/refusal, the DataModule's order."""

import json
import math
import pickle
import random
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from lit_pretrain.data.datamodule import TokenShardDataModule
from lit_pretrain.data.preparation.corpus import CorpusStats, Document, corpus_fingerprint, read_documents
from lit_pretrain.data.preparation.prepare import is_validation, prepare, split_documents, tokenizer_training_texts
from lit_pretrain.data.shards import load_manifest, open_shard, verify_shards
from lit_pretrain.data.tokenizer import (
    EOD,
    batch_encoder,
    encode_texts,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)
from lit_pretrain.errors import DataError
from lit_pretrain.model.losses import IGNORE_INDEX
from lit_pretrain.schema import DataConfig

WORDS = (
    "the model reads tokens from shards while every rank takes its own windows of the global order and the loss "
    "falls as data parallelism splits each batch across devices that hold a full copy of the weights"
).split()


def synthetic_documents(n: int = 200, seed: int = 0):
    """Varied short documents: prose, code, non-ASCII text, numbers, and one holding the literal EOD string."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 200))).capitalize() + "."
        elif kind == 1:
            text = "\n".join(
                f"def f_{i}_{j}(x):\n    return x * {rng.randint(0, 999)} + {rng.random():.4f}"
                for j in range(rng.randint(3, 15))
            )
        elif kind == 2:
            words = ["Größe", "naïve", "中文文本", "データ", "🎉", "ñandú", *WORDS]
            text = " ".join(rng.choice(words) for _ in range(80))
        else:
            text = "\n".join(",".join(str(rng.randint(0, 10**6)) for _ in range(6)) for _ in range(rng.randint(5, 30)))
        docs.append(text)
    docs[7] = f"before {EOD} after: a document that quotes the separator"
    return docs


def write_corpus(folder: Path, texts) -> Path:
    folder.mkdir(parents=True)
    for i, text in enumerate(texts):
        (folder / f"doc_{i:04d}.txt").write_text(text, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def corpus_texts():
    return synthetic_documents()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus_texts):
    root = tmp_path_factory.mktemp("prepared")
    corpus = write_corpus(root / "corpus", corpus_texts)
    cfg = DataConfig(corpus="text", paths=[str(corpus)], prepared_dir=str(root / "shards"), vocab_size=400,
                     val_fraction=0.1, shard_tokens=4096)
    manifest = prepare(cfg, log=lambda _: None)
    return cfg, manifest


def copy_prepared(prepared, tmp_path: Path):
    cfg, _ = prepared
    shutil.copytree(cfg.prepared_dir, tmp_path / "copy")
    return replace(cfg, prepared_dir=str(tmp_path / "copy"))


def split_tokens(cfg, manifest, split):
    arrays = [np.asarray(open_shard(Path(cfg.prepared_dir) / s["file"], manifest["dtype"]))
              for s in manifest["splits"][split]["shards"]]
    return np.concatenate(arrays)


# Corpus


def test_stdlib_corpus_is_deterministic_and_excludes_site_packages():
    cfg = DataConfig(max_documents=20)
    first, second = read_documents(cfg), read_documents(cfg)
    ids = [d.id for d in first]
    assert len(first) == 20 and ids == [d.id for d in second]
    assert ids == sorted(ids) and len(set(ids)) == 20
    assert all(i.endswith(".py") and "site-packages" not in i and "dist-packages" not in i for i in ids)
    assert corpus_fingerprint(first) == corpus_fingerprint(second)
    changed = [*first[:-1], Document(first[-1].id, first[-1].text + " ")]
    assert corpus_fingerprint(changed) != corpus_fingerprint(first)
    with pytest.raises(DataError, match="data.paths"):
        read_documents(DataConfig(paths=["x.txt"]))


def test_text_corpus_reads_files_directories_and_globs(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    files = {"d/a.txt": "alpha", "d/sub/b.md": "beta", "d/sub/c.rst": "gamma", "d/e.py": "x = 1",
             "d/skip.bin": "binary", "d/skip.json": "{}", "d/blank.txt": " \n\t", "g/z.txt": "zeta",
             "g/y.txt": "ypsilon", "other.log": "explicit file"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    cfg = DataConfig(corpus="text", paths=[str(tmp_path / "d"), str(tmp_path / "other.log"), str(tmp_path / "g/*.txt")])
    stats = CorpusStats()
    docs = read_documents(cfg, stats)
    expected = ["d/a.txt", "d/e.py", "d/sub/b.md", "d/sub/c.rst", "other.log", "g/y.txt", "g/z.txt"]
    # Names are relative to the folder holding each entry (for the glob, the one holding g/), not absolute paths.
    assert [d.id for d in docs] == expected
    assert [d.id for d in read_documents(cfg, absolute_ids=True)] == [str(tmp_path / e) for e in expected]
    assert [d.text for d in docs] == [files[e] for e in expected]
    assert stats.empty == 1 and stats.documents == 7
    assert [d.id for d in read_documents(replace(cfg, max_documents=2))] == [d.id for d in docs[:2]]


def test_bytes_that_are_not_utf8_are_replaced_and_counted(tmp_path):
    (tmp_path / "a.txt").write_bytes("caf\u00e9 ok".encode("utf-8"))
    # latin-1 "café" (one invalid byte), a truncated 3-byte sequence, and a genuine U+FFFD that is text, not an error
    (tmp_path / "b.txt").write_bytes(b"caf\xe9 and \xe2\x82 and " + "\ufffd".encode("utf-8"))
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "na\xefve"}\n')
    stats = CorpusStats()
    docs = read_documents(DataConfig(corpus="text", paths=[str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]), stats)
    assert [d.text for d in docs] == ["caf\u00e9 ok", "caf\ufffd and \ufffd and \ufffd"]
    assert (stats.invalid_utf8_documents, stats.invalid_utf8_sequences) == (1, 2)
    stats = CorpusStats()
    docs = read_documents(DataConfig(corpus="jsonl", paths=[str(tmp_path / "c.jsonl")]), stats)
    assert [d.text for d in docs] == ["na\ufffdve"]
    assert (stats.invalid_utf8_documents, stats.invalid_utf8_sequences) == (1, 1)


def test_jsonl_corpus_and_its_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"body": "one"}\n\n{"body": "two", "meta": 1}\n{"body": "  "}\n{"body": "three"}\n')
    docs = read_documents(DataConfig(corpus="jsonl", paths=[str(good)], text_field="body"))
    # Ids count lines from 1 (blank and whitespace-only lines too) after the file's name: its path below tmp_path.
    assert [(d.id, d.text) for d in docs] == [("good.jsonl:1", "one"), ("good.jsonl:3", "two"),
                                              ("good.jsonl:5", "three")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2.*data\.text_field"):
        read_documents(DataConfig(corpus="jsonl", paths=[str(bad)], text_field="body"))
    with pytest.raises(DataError, match=r"good\.jsonl:1.*data\.text_field='text'"):
        read_documents(DataConfig(corpus="jsonl", paths=[str(good)]))


@pytest.mark.parametrize("case", ["missing", "empty_list", "only_empty_files", "glob_nothing", "empty_dir"])
def test_unusable_paths_are_data_errors_naming_data_paths(tmp_path, case):
    (tmp_path / "empty1.txt").write_text("")
    (tmp_path / "empty2.txt").write_text("   \n")
    (tmp_path / "nothing").mkdir()
    paths = {"missing": [str(tmp_path / "absent.txt")], "empty_list": [], "only_empty_files": [str(tmp_path)],
             "glob_nothing": [str(tmp_path / "*.md")], "empty_dir": [str(tmp_path / "nothing")]}[case]
    with pytest.raises(DataError, match="data.paths"):
        read_documents(DataConfig(corpus="text", paths=paths))


# Tokenizer


def test_tokenizer_round_trips_and_requires_eod(tmp_path, corpus_texts):
    tok = train_tokenizer(corpus_texts, 300)
    path = tmp_path / "tok.json"
    save_tokenizer(tok, path)
    loaded = load_tokenizer(path)
    for text in corpus_texts[:12]:
        assert loaded.decode(loaded.encode(text).ids) == text
    assert EOD not in [loaded.id_to_token(i) for i in loaded.encode(corpus_texts[7]).ids]
    # The stage encodes with encode_batch_fast where it exists (no offsets): the ids of encode_batch, the literal EOD
    # string included; encode_batch where it does not.
    slow = [enc.ids for enc in loaded.encode_batch(corpus_texts, add_special_tokens=False)]
    assert encode_texts(loaded, corpus_texts) == slow and loaded.token_to_id(EOD) not in slow[7]
    assert batch_encoder(SimpleNamespace(encode_batch=len)) is len
    data = json.loads(path.read_text())
    data["added_tokens"] = []
    (tmp_path / "no_eod.json").write_text(json.dumps(data).replace(json.dumps(EOD)[1:-1], "<|other|>"))
    with pytest.raises(DataError, match="end-of-document"):
        load_tokenizer(tmp_path / "no_eod.json")
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "absent.json")
    assert tokenizer_training_texts([Document("a", "ab"), Document("b", "cdé"), Document("c", "x")], 4) == ["ab", "cd"]


# prepare: content of the shards


def test_prepare_counts_add_up_and_shards_decode_to_the_documents(prepared, corpus_texts):
    cfg, m = prepared
    tok = load_tokenizer(Path(cfg.prepared_dir) / "tokenizer.json")
    eod = m["tokenizer"]["eod_id"]
    assert m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] <= 400
    docs = split_documents(read_documents(cfg), cfg)
    assert sum(m["splits"][s]["documents"] for s in ("train", "val")) == m["corpus"]["documents"] == 200
    for split in ("train", "val"):
        info = m["splits"][split]
        tokens = split_tokens(cfg, m, split)
        assert tokens.dtype == np.uint16
        assert info["tokens"] == sum(s["tokens"] for s in info["shards"]) == len(tokens)
        assert info["tokens"] == sum(len(tok.encode(d.text).ids) + 1 for d in docs[split])
        assert int((tokens == eod).sum()) == info["documents"] == len(docs[split])
        pieces = np.split(tokens, np.flatnonzero(tokens == eod) + 1)[:-1]
        assert [tok.decode(p[:-1].tolist()) for p in pieces] == [d.text for d in docs[split]]
        for shard in info["shards"][:-1]:  # a shard closes at the first document boundary past shard_tokens
            ids = np.asarray(open_shard(Path(cfg.prepared_dir) / shard["file"], m["dtype"]))
            assert ids[-1] == eod and len(ids) >= cfg.shard_tokens
            assert np.flatnonzero(ids[:-1] == eod)[-1] + 1 < cfg.shard_tokens  # tokens before its last document
    assert len(m["splits"]["train"]["shards"]) > 3


def test_split_is_by_document_seeded_and_deterministic(prepared):
    cfg, m = prepared
    docs = read_documents(cfg)
    split = split_documents(docs, cfg)
    assert [d.id for d in split["val"]] == [d.id for d in docs if is_validation(d.id, cfg.split_seed, 0.1)]
    assert split == split_documents(docs, cfg)
    assert 5 <= len(split["val"]) <= 40
    other = split_documents(docs, replace(cfg, split_seed=cfg.split_seed + 1))
    assert [d.id for d in other["val"]] != [d.id for d in split["val"]]
    with pytest.raises(DataError, match="data.val_fraction"):
        split_documents(docs[:1], cfg)


def test_unigram_entropy_matches_an_independent_count(prepared):
    cfg, m = prepared
    counts = Counter(split_tokens(cfg, m, "train").tolist())
    total = sum(counts.values())
    expected = -sum(c / total * math.log(c / total) for c in counts.values())
    assert m["unigram_entropy_nats"] == pytest.approx(expected, rel=1e-12)


# prepare: reuse, refusal, verification


def test_prepare_again_reuses_without_rewriting(prepared):
    cfg, m = prepared
    folder = Path(cfg.prepared_dir)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert prepare(cfg, log=lambda _: None) == m
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    assert sorted(p.name for p in folder.parent.iterdir()) == ["corpus", "shards"]  # no temporary folder left


def test_prepare_refuses_other_config_and_foreign_folders(prepared, tmp_path):
    cfg, _ = prepared
    folder = Path(cfg.prepared_dir)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    with pytest.raises(DataError, match=r"data\.vocab_size: 400 there, 512 here.*data\.prepared_dir"):
        prepare(replace(cfg, vocab_size=512), log=lambda _: None)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="without a manifest.json"):
        prepare(replace(cfg, prepared_dir=str(foreign)), log=lambda _: None)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"] and (foreign / "notes.txt").read_text() == "mine"


def test_prepare_refuses_a_changed_corpus(prepared, tmp_path, corpus_texts):
    corpus = write_corpus(tmp_path / "corpus", corpus_texts[:60])
    cfg = replace(prepared[0], paths=[str(corpus)], prepared_dir=str(tmp_path / "shards"))
    prepare(cfg, log=lambda _: None)
    (corpus / "doc_0003.txt").write_text("edited")
    with pytest.raises(DataError, match="changed since"):
        prepare(cfg, log=lambda _: None)


def test_a_corpus_moved_to_another_folder_splits_and_fingerprints_the_same(prepared, tmp_path):
    # The split hashes document ids; were they absolute paths, a corpus copied elsewhere (another machine's
    # scratch, another pytest folder) would put other documents in validation: 200 documents, 13 of them there.
    cfg, m = prepared
    moved = tmp_path / "elsewhere" / "corpus"
    shutil.copytree(cfg.paths[0], moved)
    m2 = prepare(replace(cfg, paths=[str(moved)], prepared_dir=str(tmp_path / "shards")), log=lambda _: None)
    assert m2["corpus"]["fingerprint"] == m["corpus"]["fingerprint"] and m2["splits"] == m["splits"]
    assert m["splits"]["val"]["documents"] == 13
    for split in ("train", "val"):
        for a, b in zip(m["splits"][split]["shards"], m2["splits"][split]["shards"]):
            assert (Path(cfg.prepared_dir) / a["file"]).read_bytes() == (tmp_path / "shards" / b["file"]).read_bytes()


def test_a_folder_prepared_with_absolute_ids_is_still_reused_and_still_checked(prepared, tmp_path):
    # Manifests written before ids were relative fingerprint absolute paths and have no corpus.document_ids.
    cfg = copy_prepared(prepared, tmp_path)
    path = Path(cfg.prepared_dir) / "manifest.json"
    old = json.loads(path.read_text())
    del old["corpus"]["document_ids"]
    old["corpus"]["fingerprint"] = corpus_fingerprint(read_documents(cfg, absolute_ids=True))
    assert old["corpus"]["fingerprint"] != prepared[1]["corpus"]["fingerprint"]
    path.write_text(json.dumps(old))
    lines = []
    assert prepare(cfg, log=lines.append) == old and lines[0].startswith("reusing")
    # The old fingerprint is only believed without the marker: a new manifest holding it means a changed corpus.
    marked = {**old["corpus"], "document_ids": prepared[1]["corpus"]["document_ids"]}
    path.write_text(json.dumps({**old, "corpus": marked}))
    with pytest.raises(DataError, match="changed since"):
        prepare(cfg, log=lambda _: None)


def test_prepare_with_a_given_tokenizer_reproduces_the_shards(prepared, tmp_path):
    cfg, m = prepared
    given = replace(cfg, tokenizer_path=str(Path(cfg.prepared_dir) / "tokenizer.json"),
                    prepared_dir=str(tmp_path / "again"))
    m2 = prepare(given, log=lambda _: None)
    assert m2["tokenizer"]["sha256"] == m["tokenizer"]["sha256"] and m2["splits"] == m["splits"]
    assert load_manifest(given.prepared_dir) == m2


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete"])
def test_damaged_shards_are_data_errors_naming_the_file(prepared, tmp_path, damage):
    cfg = copy_prepared(prepared, tmp_path)
    m = load_manifest(cfg.prepared_dir)
    shard = Path(cfg.prepared_dir) / m["splits"]["train"]["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    if damage == "flip_byte":
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[:-2]))
    else:
        shard.unlink()
    with pytest.raises(DataError, match=rf"{shard.name}.*lit-pretrain prepare.*data\.prepared_dir"):
        verify_shards(cfg.prepared_dir, m)
    with pytest.raises(DataError, match=shard.name):
        prepare(cfg, log=lambda _: None)


def test_a_different_tokenizer_does_not_match_the_shards(prepared, tmp_path):
    cfg = copy_prepared(prepared, tmp_path)
    save_tokenizer(train_tokenizer(["another corpus entirely", "with other merges"] * 20, 300),
                   Path(cfg.prepared_dir) / "tokenizer.json")
    with pytest.raises(DataError, match=r"tokenizer\.json.*does not match the shards"):
        prepare(cfg, log=lambda _: None)
    dm = TokenShardDataModule(cfg, seq_len=16, micro_batch_size=4, seed=0, val_windows=8)
    with pytest.raises(DataError, match="tokenizer.json"):
        dm.setup()


# DataModule


def make_dm(cfg, seed=0, micro_batch_size=4, rank=None, world_size=None, seq_len=16, val_windows=12):
    dm = TokenShardDataModule(cfg, seq_len=seq_len, micro_batch_size=micro_batch_size, seed=seed,
                              val_windows=val_windows, rank=rank, world_size=world_size)
    dm.setup()
    return dm


def batches(loader, n):
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out


def test_windows_are_shifted_pairs_inside_one_shard(prepared):
    cfg, m = prepared
    dm = make_dm(cfg)
    shards = m["splits"]["train"]["shards"]
    assert len(dm.train_dataset) == sum((s["tokens"] - 1) // 16 for s in shards)
    assert dm.vocab_size == m["tokenizer"]["vocab_size"] and dm.eod_id == m["tokenizer"]["eod_id"]
    assert dm.tokenizer_path.is_file()
    first = np.asarray(open_shard(Path(cfg.prepared_dir) / shards[0]["file"], m["dtype"]))
    per_shard = (shards[0]["tokens"] - 1) // 16
    x, y = dm.train_dataset[per_shard - 1]  # the last window of shard 0 ends inside it
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
    assert torch.equal(x, torch.from_numpy(first[(per_shard - 1) * 16 : per_shard * 16].astype(np.int64)))
    assert torch.equal(x[1:], y[:-1])
    second = np.asarray(open_shard(Path(cfg.prepared_dir) / shards[1]["file"], m["dtype"]))
    assert torch.equal(dm.train_dataset[per_shard][0], torch.from_numpy(second[:16].astype(np.int64)))
    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == (4, 16) and torch.equal(xb[:, 1:], yb[:, :-1])


def test_train_order_is_seeded(prepared):
    cfg, _ = prepared
    a, b, c = (batches(make_dm(cfg, seed=s).train_dataloader(), 3) for s in (7, 7, 8))
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))
    assert not all(torch.equal(p[0], q[0]) for p, q in zip(a, c))


def test_ranks_split_each_global_step_of_the_single_process_order(prepared):
    cfg, _ = prepared
    single = make_dm(cfg, micro_batch_size=8, world_size=1)
    ranks = [make_dm(cfg, micro_batch_size=4, rank=r, world_size=2) for r in range(2)]
    loaders = [dm.train_dataloader() for dm in ranks]
    single_loader = single.train_dataloader()
    for epoch in (0, 1):
        single.train_sampler.set_epoch(epoch)
        for dm in ranks:
            dm.train_sampler.set_epoch(epoch)
        order = list(single.train_sampler)
        assert len(order) == len(set(order)) and len(order) % 8 == 0
        per_rank = [list(dm.train_sampler) for dm in ranks]
        assert len(per_rank[0]) == len(per_rank[1]) == len(order) // 2
        assert not set(per_rank[0]) & set(per_rank[1])
        for step in range(len(order) // 8):
            union = per_rank[0][step * 4 : step * 4 + 4] + per_rank[1][step * 4 : step * 4 + 4]
            assert sorted(union) == sorted(order[step * 8 : step * 8 + 8])
        if epoch == 0:
            epoch0 = order
        else:
            assert order != epoch0
    # the batches themselves: rank 0 and rank 1 rows of step 0 are the single process's step-0 rows
    rows = lambda x: sorted(map(tuple, x.tolist()))  # noqa: E731
    single.train_sampler.set_epoch(0)
    for dm in ranks:
        dm.train_sampler.set_epoch(0)
    (x0, _), (x1, _), (xs, _) = next(iter(loaders[0])), next(iter(loaders[1])), next(iter(single_loader))
    assert rows(torch.cat([x0, x1])) == rows(xs)


def test_val_loader_is_fixed_and_split_across_ranks(prepared):
    cfg, _ = prepared
    dm = make_dm(cfg, val_windows=12)
    first, second = batches(dm.val_dataloader(), 10), batches(dm.val_dataloader(), 10)
    assert len(first) == 3 and all(torch.equal(p[0], q[0]) for p, q in zip(first, second))
    assert torch.equal(first[0][0], torch.stack([dm.val_dataset[i][0] for i in range(4)]))
    # 2 ranks validate the same 12 windows (trainer.val_windows counts them in all), every other one each, in full
    # batches of 4 (the places left hold a window that predicts nothing); so do 5 ranks.
    assert [list(make_dm(cfg, rank=r, world_size=2).val_dataloader().batch_sampler) for r in (0, 1)] == [
        [[0, 2, 4, 6], [8, 10, None, None]], [[1, 3, 5, 7], [9, 11, None, None]]]
    padded = make_dm(cfg, rank=4, world_size=5).val_dataloader()
    assert list(padded.batch_sampler) == [[4, 9, None, None]]
    (x, y), = list(padded)
    assert torch.equal(x[:2], torch.stack([dm.val_dataset[i][0] for i in (4, 9)]))
    assert (y[2:] == IGNORE_INDEX).all() and (y[:2] != IGNORE_INDEX).all()


@pytest.mark.parametrize("sizes, windows", [([10], 5), ([10], 40), ([3, 10], 4), ([7, 1, 12], 6)])
def test_the_validation_set_is_the_same_for_every_world_size(sizes, windows):
    """data/validation.py: the windows validated (padding aside) are the first min(windows, size) of each source
    for any number of ranks; every rank runs the same number of full batches, each from one source."""
    from lit_pretrain.data.validation import PAD, val_batches

    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    expected = sorted(o + i for o, size in zip(offsets, sizes) for i in range(min(windows, size)))
    for world_size in range(1, 6):
        for micro_batch_size in (1, 2, 4):
            ranks = [val_batches(sizes, offsets, windows, micro_batch_size, r, world_size) for r in range(world_size)]
            assert sorted(i for b, _ in ranks for batch in b for i in batch if i is not PAD) == expected
            assert all(len(batch) == micro_batch_size for b, _ in ranks for batch in b)
            assert len({tuple(s) for _, s in ranks}) == 1
            for b, src in ranks:
                for batch, k in zip(b, src):
                    assert all(offsets[k] <= i < offsets[k] + sizes[k] for i in batch if i is not PAD)
    # The table of one case: 5 windows on 2 ranks in batches of 2.
    assert val_batches([10], [0], 5, 2, 0, 2) == ([[0, 2], [4, PAD]], [0, 0])
    assert val_batches([10], [0], 5, 2, 1, 2) == ([[1, 3], [PAD, PAD]], [0, 0])


def test_too_few_windows_name_the_keys_to_change(prepared, tmp_path):
    cfg, _ = prepared
    with pytest.raises(DataError, match=r"model\.seq_len.*trainer\.micro_batch_size"):
        make_dm(cfg, seq_len=4096, micro_batch_size=64)
    one_shard = replace(cfg, shard_tokens=1 << 20, prepared_dir=str(tmp_path / "one_shard"))
    val_tokens = prepare(one_shard, log=lambda _: None)["splits"]["val"]["tokens"]
    with pytest.raises(DataError, match=r"validation split.*data\.val_fraction"):
        make_dm(one_shard, seq_len=val_tokens, micro_batch_size=1)


def test_dataset_pickles_without_its_memmaps_and_loads_in_a_worker(prepared):
    cfg, _ = prepared
    dm = make_dm(cfg)
    expected = dm.train_dataset[5]
    clone = pickle.loads(pickle.dumps(dm.train_dataset))
    assert clone._maps == {} and torch.equal(clone[5][0], expected[0])
    workers = make_dm(replace(cfg, num_workers=1))
    a = batches(make_dm(cfg).train_dataloader(), 2)
    b = batches(workers.train_dataloader(), 2)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))


class _Tiny(L.LightningModule):
    def __init__(self, vocab_size):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab_size, 8)
        self.head = torch.nn.Linear(8, vocab_size)
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(x.clone())
        return torch.nn.functional.cross_entropy(self.head(self.emb(x)).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_keeps_our_sampler_and_advances_its_epoch(prepared, tmp_path):
    cfg, _ = prepared
    dm = TokenShardDataModule(cfg, seq_len=128, micro_batch_size=16, seed=3, val_windows=16)
    module = _Tiny(400)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, use_distributed_sampler=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_train_batches=3, limit_val_batches=0, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=dm)
    assert trainer.train_dataloader.sampler is dm.train_sampler and dm.train_sampler.epoch == 1
    steps = 3
    assert len(module.seen) == 2 * steps
    ref = make_dm(cfg, seed=3, micro_batch_size=16, seq_len=128)
    ref_loader = ref.train_dataloader()
    ref.train_sampler.set_epoch(1)
    assert torch.equal(module.seen[steps][0], next(iter(ref_loader))[0][0])
