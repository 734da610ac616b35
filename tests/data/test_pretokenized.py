"""Corpora tokenized elsewhere (data/pretokenized.py) and export-data (data/export.py): each format read from files
written here by minimal writers that follow the formats' own writers (not by our exporter, so the reader is not only
checked against itself), the checks that refuse a bad corpus before training, the windows served in place, and the
round trip prepared folder → export → read back."""

import gzip
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_pretrain import config
from lit_pretrain.data.datamodule import TokenShardDataModule
from lit_pretrain.data.export import export_data
from lit_pretrain.data.pretokenized import read_megatron, read_nanogpt, read_numpy
from lit_pretrain.data.shards import load_manifest, open_shard
from lit_pretrain.errors import ConfigError, DataError
from lit_pretrain.schema import DataConfig, SourceConfig
from tests.conftest import EXPERIMENTS

SEQ_LEN = 16


# Minimal writers, each from its format's description (not from data/export.py).
def megatron_by_spec(prefix: Path, documents, dtype, code: int) -> None:
    """Megatron-LM's _IndexWriter layout: each document split into sequences of at most 5 tokens, so sequences and
    documents differ (the reader must use the document indices, not the sequences, as boundaries)."""
    lengths, doc_idx = [], [0]
    with open(f"{prefix}.bin", "wb") as f:
        for doc in documents:
            for i in range(0, len(doc), 5):
                part = np.asarray(doc[i: i + 5], dtype=dtype)
                f.write(part.tobytes())
                lengths.append(len(part))
            doc_idx.append(len(lengths))
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * np.dtype(dtype).itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(lengths)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def llmc_by_spec(path: Path, ids, magic=20240520, version=1, dtype=np.uint16, count=None) -> None:
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, version, len(ids) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(ids, dtype=dtype).tobytes())


def olmo_by_spec(path: Path, documents, dtype) -> None:
    np.concatenate(documents).astype(dtype).tofile(path)
    with gzip.open(path.with_suffix(".csv.gz"), "wt") as f:
        start = 0
        for doc in documents:
            f.write(f"{start},{start + len(doc)}\n")  # OLMo-core write_document_indices: start,end
            start += len(doc)


def documents(n=40, eod=0, vocab=512, seed=0):
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(1, vocab, size=int(rng.integers(3, 30))), eod) for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer(tiny_data_dir) -> Path:
    return tiny_data_dir / load_manifest(tiny_data_dir)["tokenizer"]["file"]


@pytest.fixture(scope="module")
def eod(tiny_data_dir) -> int:
    return load_manifest(tiny_data_dir)["tokenizer"]["eod_id"]


def data_config(corpus, paths, tokenizer, **kw) -> DataConfig:
    return DataConfig(corpus=corpus, paths=[str(p) for p in paths], tokenizer_path=str(tokenizer), **kw)


def datamodule(data, micro_batch_size=2, **kw):
    dm = TokenShardDataModule(data, seq_len=SEQ_LEN, micro_batch_size=micro_batch_size, seed=0,
                             val_windows=2 * micro_batch_size, **kw)
    dm.prepare_data()
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("dtype, code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5)])
def test_megatron_reads_ids_and_document_ends(tmp_path, dtype, code):
    docs = documents()
    megatron_by_spec(tmp_path / "c", docs, dtype, code)
    tf = read_megatron(str(tmp_path / "c"))
    assert tf.dtype == np.dtype(dtype) and tf.offset == 0
    assert np.array_equal(tf.ids(), np.concatenate(docs))
    assert np.array_equal(tf.doc_ends, np.cumsum([len(d) for d in docs]))


def test_nanogpt_raw_and_llmc_files_read_the_same_ids(tmp_path):
    ids = np.concatenate(documents())
    ids.astype(np.uint16).tofile(tmp_path / "raw.bin")  # nanoGPT prepare.py: arr.tofile of uint16
    llmc_by_spec(tmp_path / "gpt2.bin", ids)
    llmc_by_spec(tmp_path / "llama3.bin", ids, magic=20240801, version=7, dtype=np.uint32)
    for name, dtype, offset in (("raw.bin", np.uint16, 0), ("gpt2.bin", np.uint16, 1024), ("llama3.bin", np.uint32,
                                                                                           1024)):
        tf = read_nanogpt(str(tmp_path / name))
        assert (tf.dtype, tf.offset, tf.doc_ends) == (np.dtype(dtype), offset, None)
        assert np.array_equal(tf.ids(), ids)


def test_numpy_reads_ids_with_and_without_metadata(tmp_path):
    docs = documents()
    olmo_by_spec(tmp_path / "part-0.npy", docs, np.uint32)
    tf = read_numpy(str(tmp_path / "part-0.npy"), np.dtype(np.uint32))
    assert np.array_equal(tf.ids(), np.concatenate(docs))
    assert np.array_equal(tf.doc_ends, np.cumsum([len(d) for d in docs]))
    (tmp_path / "part-0.csv.gz").unlink()
    assert read_numpy(str(tmp_path / "part-0.npy"), np.dtype(np.uint32)).doc_ends is None
    np.save(tmp_path / "saved.npy", np.concatenate(docs).astype(np.uint16))  # a real .npy: its header's dtype rules
    tf = read_numpy(str(tmp_path / "saved.npy"), np.dtype(np.uint32))
    assert tf.dtype == np.uint16 and np.array_equal(tf.ids(), np.concatenate(docs))


@pytest.mark.parametrize("damage, message", [
    ("magic", "not a Megatron index"),
    ("truncate_bin", r"c.bin has \d+ bytes, c.idx describes"),
    ("version", "version 2; this reads version 1"),
    ("float", "dtype code 7 is not an integer token dtype"),
])
def test_damaged_megatron_files_are_refused_by_name(tmp_path, damage, message):
    megatron_by_spec(tmp_path / "c", documents(), np.uint16, 8)
    idx, bin_ = tmp_path / "c.idx", tmp_path / "c.bin"
    raw = bytearray(idx.read_bytes())
    if damage == "magic":
        raw[0:1] = b"X"
    elif damage == "version":
        raw[9:17] = struct.pack("<Q", 2)
    elif damage == "float":
        raw[17] = 7
    idx.write_bytes(bytes(raw))
    if damage == "truncate_bin":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    with pytest.raises(DataError, match=message):
        read_megatron(str(tmp_path / "c"))


def test_llmc_count_that_disagrees_with_the_size_is_refused(tmp_path):
    llmc_by_spec(tmp_path / "x.bin", np.arange(100), count=101)
    with pytest.raises(DataError, match=r"x.bin has 1224 bytes, its llm.c header promises 101 uint16 ids"):
        read_nanogpt(str(tmp_path / "x.bin"))


def test_an_id_past_the_vocabulary_is_refused_with_file_and_offset(tmp_path, tokenizer):
    docs = documents()
    bad = np.concatenate(docs)
    bad[77] = 600  # the tiny tokenizer has 512 ids
    bad.astype(np.uint16).tofile(tmp_path / "train.bin")
    dm = TokenShardDataModule(data_config("nanogpt", [tmp_path / "train.bin"], tokenizer), seq_len=SEQ_LEN,
                              micro_batch_size=2, seed=0, val_windows=4)
    with pytest.raises(DataError, match=r"train.bin: id 600 at token offset 77 \(byte 154\) is outside the "
                                        r"vocabulary of .*tokenizer.json \(512 ids\)"):
        dm.prepare_data()


def test_a_dtype_too_narrow_for_the_tokenizer_is_refused(tmp_path, tokenizer):
    megatron_by_spec(tmp_path / "c", documents(vocab=100), np.int8, 2)
    with pytest.raises(DataError, match=r"c.bin stores int8 ids, which cannot hold .* 512 ids"):
        datamodule(data_config("megatron", [tmp_path / "c"], tokenizer))


def test_pretokenized_corpus_needs_a_tokenizer_and_val_paths_need_one():
    with pytest.raises(ConfigError, match="data.corpus=megatron holds ids of another pipeline's tokenizer: set "
                                          "data.tokenizer_path"):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", ["data=megatron", "data.tokenizer_path=null"])
    with pytest.raises(ConfigError, match="data.val_paths is for pretokenized corpora"):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", ["data.val_paths=[x.bin]"])


def test_windows_are_slices_of_the_file_and_validation_starts_at_a_document(tmp_path, tokenizer, eod):
    docs = documents(n=200, eod=eod)
    megatron_by_spec(tmp_path / "c", docs, np.uint16, 8)
    dm = datamodule(data_config("megatron", [tmp_path / "c"], tokenizer, val_fraction=0.1))
    ids, ends = np.concatenate(docs), np.cumsum([len(d) for d in docs])
    train, val = dm.manifest["splits"]["train"], dm.manifest["splits"]["val"]
    cut = train["tokens"]
    assert cut in ends and abs(cut - 0.9 * len(ids)) <= max(len(d) for d in docs)  # the next document end
    assert train["documents"] + val["documents"] == 200 and val["tokens"] == len(ids) - cut
    for i in (0, 5, len(dm.train_dataset) - 1):
        x, y = dm.train_dataset[i]
        assert np.array_equal(x.numpy(), ids[i * SEQ_LEN: (i + 1) * SEQ_LEN])
        assert np.array_equal(y.numpy(), ids[i * SEQ_LEN + 1: (i + 1) * SEQ_LEN + 1])
    x, _ = dm.val_dataset[0]
    assert np.array_equal(x.numpy(), ids[cut: cut + SEQ_LEN])
    batch = next(iter(dm.train_dataloader()))
    assert batch[0].shape == (2, SEQ_LEN)


def test_document_masking_needs_documents_ending_in_the_eod_id(tmp_path, tokenizer, eod):
    megatron_by_spec(tmp_path / "c", documents(eod=eod), np.uint16, 8)
    datamodule(data_config("megatron", [tmp_path / "c"], tokenizer, document_masking=True))  # every one ends in it
    megatron_by_spec(tmp_path / "d", documents(eod=1), np.uint16, 8)
    with pytest.raises(DataError, match=rf"d.bin: document 0 \(of 40\) ends at token offset \d+ with id 1, not "
                                        rf"data.eos_token='<\|endoftext\|>' \(id {eod}\)"):
        datamodule(data_config("megatron", [tmp_path / "d"], tokenizer, document_masking=True))
    np.concatenate(documents(eod=1)).astype(np.uint16).tofile(tmp_path / "e.bin")
    with pytest.raises(DataError, match="holds no data.eos_token"):
        datamodule(data_config("nanogpt", [tmp_path / "e.bin"], tokenizer, document_masking=True))


def shard_ids(folder: Path, split: str) -> np.ndarray:
    m = load_manifest(folder)
    return np.concatenate([open_shard(folder / s["file"], m["dtype"]) for s in m["splits"][split]["shards"]])


@pytest.mark.parametrize("to", ["megatron", "numpy"])
def test_export_round_trip_reads_back_the_same_tokens_and_documents(tmp_path, tiny_data_dir, eod, to):
    out = tmp_path / to
    written = export_data(tiny_data_dir, out, to)
    assert out / "tokenizer.json" in written
    for split in ("train", "val"):
        ours = shard_ids(tiny_data_dir, split)
        tf = (read_megatron(str(out / split)) if to == "megatron" else
              read_numpy(str(out / f"{split}.npy"), np.dtype(np.uint16)))
        assert np.array_equal(tf.ids(), ours)
        assert np.array_equal(tf.doc_ends, np.flatnonzero(ours == eod) + 1)  # each document ends in the EOD id
        assert len(tf.doc_ends) == load_manifest(tiny_data_dir)["splits"][split]["documents"]
    if to == "megatron":  # the exporter's index, read by the spec's field order (not by our reader)
        raw = (out / "val.idx").read_bytes()
        assert raw[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<QBQQ", raw[9:34])[:2] == (1, 8)
    with pytest.raises(DataError, match="exists and is not an empty folder"):
        export_data(tiny_data_dir, out, to)


def test_exported_corpus_serves_the_prepared_folders_windows(tmp_path, tiny_data_dir):
    """The same tokens in the same single shard per split: the same windows, sampler order and validation set."""
    out = tmp_path / "m"
    export_data(tiny_data_dir, out, "megatron")
    ours = datamodule(replace(DataConfig(), prepared_dir=str(tiny_data_dir), vocab_size=512, max_documents=400))
    theirs = datamodule(replace(data_config("megatron", [out / "train"], out / "tokenizer.json"),
                                val_paths=[str(out / "val")]))
    assert len(ours.train_dataset) == len(theirs.train_dataset) and len(ours.val_dataset) == len(theirs.val_dataset)
    a, b = next(iter(ours.train_dataloader())), next(iter(theirs.train_dataloader()))
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert np.array_equal(ours.val_dataset[3][0], theirs.val_dataset[3][0])
    assert (theirs.vocab_size, theirs.eod_id) == (ours.vocab_size, ours.eod_id)


def test_a_mixture_takes_a_megatron_source_beside_a_prepared_one(tmp_path, tiny_data_dir):
    out = tmp_path / "m"
    export_data(tiny_data_dir, out, "megatron")
    data = replace(DataConfig(), vocab_size=512, max_documents=400, prepared_dir=str(tmp_path / "mix"), sources=[
        SourceConfig(name="ours", prepared_dir=str(tiny_data_dir)),
        SourceConfig(name="mega", corpus="megatron", paths=[str(out / "train")], val_paths=[str(out / "val")],
                     weight=3.0)])
    dm = datamodule(data)
    ours, mega = dm.train_dataset.parts
    assert len(ours) == len(mega)  # the same tokens, read from each place
    assert np.array_equal(ours[7][0], mega[7][0])
    assert dm.manifest["sources"]["mega"]["pretokenized"] == "megatron"
    batch = next(iter(dm.train_dataloader()))
    assert batch[0].shape == (2, SEQ_LEN)


def test_cold_reads_fetch_only_the_pages_the_windows_touch(tmp_path, tokenizer, eod):
    """Windows are read in shuffled order, so the shards are mapped without readahead (shards.open_shard): bytes
    fetched from storage on a cold page cache equal the distinct 4 KiB pages of the windows read. With the kernel's
    default readahead the same read fetched 6.5x those pages (bench/data/pretokenized.py)."""
    from lit_pretrain.bench.data import pretokenized as bench

    data = data_config("megatron", [], tokenizer)
    big = bench.synthetic_megatron(data, tmp_path, 512, eod, tokens=1 << 22)  # 8 MiB, far more than 40 batches read
    if bench.read_bytes() == 0 and not Path("/proc/self/io").is_file():
        pytest.skip("no /proc/self/io")
    got = bench.bytes_per_token(big, seq_len=SEQ_LEN * 16, micro_batch_size=2, seed=0, batches=40)
    if got["bytes_per_token"] == 0:
        pytest.skip("this filesystem reports no reads (tmpfs?)")
    # The floor counts pages; the kernel may fault one page more at a mapping's edge: 1% slack.
    assert got["page_floor_bytes_per_token"] <= got["bytes_per_token"] <= 1.01 * got["page_floor_bytes_per_token"]


def test_a_run_on_a_pretokenized_corpus_names_its_tokenizer_for_generate_and_export(tmp_path, tiny_data_dir,
                                                                                     tokenizer, eod):
    from lit_pretrain.data.shards import run_tokenizer_entry

    folder, tok = run_tokenizer_entry(data_config("megatron", [tmp_path / "c"], tokenizer))
    assert (folder / tok["file"], tok["eod_id"]) == (tokenizer.resolve(), eod)
    mixed = replace(DataConfig(), tokenizer_path=str(tokenizer), sources=[
        SourceConfig(name="mega", corpus="megatron", paths=["x"]), SourceConfig(name="ours")])
    assert run_tokenizer_entry(mixed)[1] == tok
    ours = run_tokenizer_entry(replace(DataConfig(), prepared_dir=str(tiny_data_dir)))
    assert ours[1] == load_manifest(tiny_data_dir)["tokenizer"]


def test_paths_take_folders_globs_and_either_megatron_file(tmp_path, tokenizer, eod):
    from lit_pretrain.data.pretokenized import expand

    for name in ("b", "a"):
        megatron_by_spec(tmp_path / name, documents(eod=eod), np.uint16, 8)
    assert expand("megatron", [str(tmp_path)]) == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert expand("megatron", [str(tmp_path / "b.bin"), str(tmp_path / "*.idx")]) == [str(tmp_path / "b"),
                                                                                    str(tmp_path / "a")]
    with pytest.raises(DataError, match=r"matches no .idx file"):
        expand("megatron", [str(tmp_path / "z*")])
    dm = datamodule(data_config("megatron", [tmp_path], tokenizer))
    assert len(dm.manifest["splits"]["train"]["shards"]) == 2


def test_export_data_command(tmp_path, tiny_data_dir, capsys):
    from lit_pretrain.cli import main

    assert main(["export-data", "--to", "numpy", str(tiny_data_dir), str(tmp_path / "n")]) == 0
    assert f"wrote {tmp_path / 'n' / 'train.npy'}" in capsys.readouterr().out
    assert main(["export-data", "--to", "numpy", str(tiny_data_dir), str(tmp_path / "n")]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err


def test_ranks_split_each_global_batch_of_a_pretokenized_corpus_as_one_process_reads_it(tmp_path, tokenizer, eod):
    megatron_by_spec(tmp_path / "c", documents(n=200, eod=eod), np.uint16, 8)
    data = data_config("megatron", [tmp_path / "c"], tokenizer)
    one = [b[0] for b, _ in zip(datamodule(replace(data), micro_batch_size=4).train_dataloader(), range(3))]
    two = [[b[0] for b, _ in zip(datamodule(replace(data), rank=r, world_size=2).train_dataloader(), range(3))]
           for r in range(2)]
    for k in range(3):  # global batch k: rank 0 reads positions 0, 2, ..., rank 1 positions 1, 3, ...
        merged = torch.stack([two[r][k][i] for i in range(2) for r in range(2)])
        assert torch.equal(merged, one[k])


def test_a_checked_file_is_read_once_until_it_changes(tmp_path, tokenizer, eod, monkeypatch):
    """data.check_cache_dir: a file that passed is not scanned again at the next start (a fresh process: the
    per-process cache emptied); a changed file, a damaged record and a refused file are scanned at every start."""
    import lit_pretrain.data.pretokenized as pretokenized

    records = tmp_path / "records"
    megatron_by_spec(tmp_path / "c", documents(n=200, eod=eod), np.uint16, 8)
    data = data_config("megatron", [tmp_path / "c"], tokenizer, val_fraction=0.1, check_cache_dir=str(records),
                       document_masking=True)
    scans, real = [], pretokenized.check_ids
    monkeypatch.setattr(pretokenized, "check_ids", lambda tf, *a: scans.append(tf.path) or real(tf, *a))

    def start():
        monkeypatch.setattr(pretokenized, "_OPENED", {})  # what a new process starts with
        lines = []
        m = pretokenized.open_corpus(data, log=lines.append)
        return {k: v for k, v in m.items() if k != "seconds"}, lines[-1]

    first, line = start()
    assert len(scans) == 1 and "as recorded" not in line and len(list(records.glob("*.json"))) == 1
    again, line = start()
    assert len(scans) == 1 and again == first  # the same splits, documents and EOD counts, from the record
    assert line.endswith(f"(1 of 1 files as recorded in {records})")
    record = next(records.glob("*.json"))
    text = record.read_text()
    record.write_text(text[: len(text) // 2])  # a torn or damaged record: scanned again, and recorded anew
    assert start()[0] == first and len(scans) == 2 and record.read_text() != text[: len(text) // 2]
    record.write_text(text.replace(f'"cut": {first["splits"]["train"]["tokens"]}', '"cut": 1'))
    assert start()[0] == first and len(scans) == 3  # a record naming other fields than its key's: scanned
    megatron_by_spec(tmp_path / "c", documents(n=200, eod=eod, seed=1), np.uint16, 8)  # rewritten in place
    changed, _ = start()
    assert len(scans) == 4 and changed["splits"] != first["splits"]
    start()
    assert len(scans) == 4 and len(list(records.glob("*.json"))) == 2  # each version of the file has its record
    bad = np.concatenate(documents(eod=eod))
    bad[5] = 600
    bad.astype(np.uint16).tofile(tmp_path / "bad.bin")
    data = data_config("nanogpt", [tmp_path / "bad.bin"], tokenizer, check_cache_dir=str(records))
    for _ in range(2):
        with pytest.raises(DataError, match="id 600 at token offset 5"):
            start()
    assert len(scans) == 6 and len(list(records.glob("*.json"))) == 2  # refused, never recorded


def test_an_unwritable_record_folder_costs_only_the_record(tmp_path, tokenizer, eod, monkeypatch):
    import lit_pretrain.data.pretokenized as pretokenized

    (tmp_path / "not-a-folder").write_text("x")
    megatron_by_spec(tmp_path / "c", documents(eod=eod), np.uint16, 8)
    for setting in (str(tmp_path / "not-a-folder"), None):  # a file where the folder should be; records off
        monkeypatch.setattr(pretokenized, "_OPENED", {})
        m = pretokenized.open_corpus(data_config("megatron", [tmp_path / "c"], tokenizer, check_cache_dir=setting),
                                     log=lambda _: None)
        assert m["splits"]["train"]["documents"] + m["splits"]["val"]["documents"] == 40
    assert (tmp_path / "not-a-folder").read_text() == "x"


def test_ranks_starting_together_scan_a_file_once(tmp_path):
    """The first of two concurrent starts takes the key's lock and scans; the other waits, then reads its record."""
    import threading
    import time

    from lit_pretrain.data.check_record import checked

    scans, results = [], []

    def scan():
        scans.append(1)
        time.sleep(0.3)  # long enough that the second start arrives while the first scans
        return 7, 3

    threads = [threading.Thread(target=lambda: results.append(checked(tmp_path, {"file": "x"}, scan)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(scans) == 1 and sorted(results) == [((7, 3), False), ((7, 3), True)]


def test_the_record_folder_follows_the_xdg_rule(monkeypatch, tmp_path):
    from lit_pretrain.data.check_record import cache_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_folder("auto") == tmp_path / "lit-pretrain" / "corpus-checks"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_folder("auto") == Path.home() / ".cache" / "lit-pretrain" / "corpus-checks"
    assert cache_folder("~/x") == Path.home() / "x" and cache_folder(None) is None
