"""Streaming corpora and any tokenizer: every reader format, byte-identical shards for any
number of tokenize processes, a Llama-3-style tokenizer with a vocabulary past uint16, and bad input refused with
exit 2, one line, and no prepared folder."""

import gzip
import json
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from lit_pretrain.cli import main
from lit_pretrain.data.preparation import minhash, tokenize_stage
from lit_pretrain.data.preparation.corpus import CorpusStats, read_documents
from lit_pretrain.data.preparation.prepare import prepare
from lit_pretrain.data.shards import check_config, content_config
from lit_pretrain.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from lit_pretrain.errors import DataError
from lit_pretrain.schema import DataConfig, DeduplicationConfig

ROOT = Path(__file__).resolve().parents[2]
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
BIG_EXTRA = 65_600  # added tokens "tok00000".."tok65599": the last ones get ids above 65,535


def _texts(n: int = 40, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(500)] + ["café", "naïve", "日本語"]
    texts = [" ".join(rng.choice(words, 40)) for _ in range(n)]
    # Words that are added tokens of the big tokenizer below, one with an id past uint16.
    texts[1] += " tok65599 and tok00007"
    texts[2] = "tok65598 " + texts[2]
    return texts


def _write(folder: Path, texts: list, kind: str, column: str = "text") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({column: t}) + "\n" for t in texts).encode()
    if kind == "jsonl":
        path = folder / "c.jsonl"
        path.write_bytes(lines)
    elif kind == "gz":
        path = folder / "c.jsonl.gz"
        path.write_bytes(gzip.compress(lines))
    elif kind == "zst":
        import zstandard

        path = folder / "c.jsonl.zst"
        path.write_bytes(zstandard.ZstdCompressor().compress(lines))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "c.parquet"
        pq.write_table(pa.table({column: texts, "n": list(range(len(texts)))}), path, row_group_size=7)
    return path


def test_every_format_reads_the_same_documents_from_files_folders_and_globs(tmp_path):
    texts = _texts(20)
    paths = {kind: _write(tmp_path / kind, texts, kind) for kind in ("jsonl", "gz", "zst", "parquet")}
    for kind, path in paths.items():
        stats = CorpusStats()
        docs = read_documents(DataConfig(corpus="parquet" if kind == "parquet" else "jsonl", paths=[str(path)]), stats)
        assert [d.text for d in docs] == texts, kind
        assert [d.id for d in docs] == [f"{path.name}:{i}" for i in range(1, 21)] and stats.documents == 20
    # A folder holds every JSON Lines compression (sorted by name); a glob matches across folders.
    mixed = tmp_path / "mixed"
    for kind in ("zst", "jsonl", "gz"):
        (mixed / kind).mkdir(parents=True)
        paths[kind].rename(mixed / kind / paths[kind].name)
    docs = read_documents(DataConfig(corpus="jsonl", paths=[str(mixed)]))
    assert [d.text for d in docs] == texts * 3 and docs[0].id == "mixed/gz/c.jsonl.gz:1"
    # The glob's names start at the folder holding mixed/, its last part without wildcards: the same ids.
    globbed = read_documents(DataConfig(corpus="jsonl", paths=[str(mixed / "*" / "c.jsonl*")]))
    assert [d.id for d in globbed] == [d.id for d in docs]
    # A Parquet null is an empty document: dropped and counted, like an empty line.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", None, "b"]}), tmp_path / "nulls.parquet")
    stats = CorpusStats()
    docs = read_documents(DataConfig(corpus="parquet", paths=[str(tmp_path / "nulls.parquet")]), stats)
    assert [d.id.rsplit(":", 1)[1] for d in docs] == ["1", "3"] and stats.empty == 1


def test_signatures_spilled_to_a_file_equal_the_in_memory_ones(tmp_path, monkeypatch):
    texts = [minhash.normalize(t, False, True) for t in _texts(30)]
    monkeypatch.setattr(minhash, "_CHUNK_CHARS", 1_000)  # many chunks, each written at its own offset
    spill = minhash.SignatureSpill(tmp_path / "sig.bin", "word", 5, 64, 1, processes=1, progress=False)
    for i, text in enumerate(texts):
        spill.add(text, str(i))
    rows = spill.finish()
    expected, _ = minhash.compute_signatures(texts, "word", 5, 64, 1, processes=1, progress=False)
    assert isinstance(rows, np.memmap) and spill.chunks > 3
    np.testing.assert_array_equal(rows, expected)


def _cfg(tmp_path: Path, corpus: Path, kind: str = "jsonl", **kw) -> DataConfig:
    return DataConfig(corpus=kind, paths=[str(corpus)], prepared_dir=str(tmp_path / "out"), vocab_size=300,
                      val_fraction=0.2, deduplication=DeduplicationConfig(processes=1), **kw)


def _shards(manifest) -> dict:
    return {s: [x["sha256"] for x in manifest["splits"][s]["shards"]] for s in ("train", "val")}


@pytest.mark.slow  # starts a tokenizer worker process
def test_shards_are_byte_identical_for_one_and_two_tokenize_processes(tmp_path, monkeypatch):
    corpus = _write(tmp_path / "corpus", _texts(60), "gz")
    monkeypatch.setattr(tokenize_stage, "ENCODE_CHUNK_BYTES", 1_500)  # ~25 chunks: workers and this process share
    one = prepare(replace(_cfg(tmp_path, corpus), prepared_dir=str(tmp_path / "one"), shard_tokens=1024),
                  log=lambda _: None)
    two = prepare(replace(_cfg(tmp_path, corpus), prepared_dir=str(tmp_path / "two"), shard_tokens=1024,
                          tokenize_workers=2), log=lambda _: None)
    assert len(_shards(one)["train"]) > 2 and _shards(one) == _shards(two)
    for name in [s["file"] for split in ("train", "val") for s in one["splits"][split]["shards"]]:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    # The process count is not content: the folder made with 1 is reused with 2.
    lines = []
    prepare(replace(_cfg(tmp_path, corpus), prepared_dir=str(tmp_path / "one"), shard_tokens=1024,
                    tokenize_workers=2), log=lines.append)
    assert lines[0].startswith("reusing")


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory) -> Path:
    """A Llama-3-style tokenizer.json: byte-level BPE, 65,900+ tokens, <|begin_of_text|> and <|end_of_text|> as
    special tokens after every other id (as Llama 3 puts them at 128,000+), built in about a second."""
    tokenizer = train_tokenizer(_texts(), 300, special_tokens=[])
    tokenizer.add_tokens([f"tok{i:05d}" for i in range(BIG_EXTRA)])
    tokenizer.add_special_tokens([BOS, EOS])
    path = tmp_path_factory.mktemp("llama-style") / "tokenizer.json"
    save_tokenizer(tokenizer, path)
    return path


def test_llama_style_tokenizer_writes_uint32_shards_whose_ids_round_trip(tmp_path, big_tokenizer):
    texts = _texts()
    corpus = _write(tmp_path / "corpus", texts, "zst")
    cfg = _cfg(tmp_path, corpus, tokenizer_path=str(big_tokenizer), eos_token=EOS, bos_token=BOS)
    m = prepare(cfg, log=lambda _: None)
    tok = load_tokenizer(big_tokenizer, EOS, BOS)
    eos, bos = tok.token_to_id(EOS), tok.token_to_id(BOS)
    assert m["dtype"] == "uint32" and m["tokenizer"]["vocab_size"] > 1 << 16
    assert (m["tokenizer"]["eod_id"], m["tokenizer"]["bos_id"]) == (eos, bos) and min(eos, bos) > 65_535
    decoded, every = [], []
    for split in ("train", "val"):
        ids = np.concatenate([np.fromfile(tmp_path / "out" / s["file"], dtype=np.uint32)
                              for s in m["splits"][split]["shards"]])
        pieces = np.split(ids, np.flatnonzero(ids == eos) + 1)[:-1]
        assert all(p[0] == bos and p[-1] == eos for p in pieces)
        decoded += [tok.decode(p[1:-1].tolist()) for p in pieces]
        every.append(ids)
    assert tok.token_to_id("tok65599") > 65_535 and tok.token_to_id("tok65599") in np.concatenate(every)
    assert sorted(decoded) == sorted(texts)  # every document, and only its text, in the shards


def _tokenizer_without_eos(tmp_path: Path) -> Path:
    path = tmp_path / "no-eos.json"
    save_tokenizer(train_tokenizer(_texts(), 300, special_tokens=[EOS]), path)  # has <|end_of_text|> only
    return path


BAD_INPUT = {
    # case: (how to make the input, overrides, what the one line must name)
    "parquet_without_the_column": (lambda d: _write(d, _texts(), "parquet", column="body"), ["data.corpus=parquet"],
                                   r"c\.parquet has no column data\.text_field='text'"),
    "gz_truncated": (lambda d: _cut(_write(d, _texts(400), "gz")), [], r"c\.jsonl\.gz is truncated"),
    "zst_truncated": (lambda d: _cut(_write(d, _texts(400), "zst")), [], r"c\.jsonl\.zst is truncated"),
    "json_line_not_an_object": (lambda d: _append(_write(d, _texts(), "jsonl"), b"[1, 2]\n"), [],
                                r"c\.jsonl:41 is a JSON list, not an object"),
    "tokenizer_without_the_eos_token": (lambda d: _write(d, _texts(), "jsonl"), ["data.tokenizer_path={noeos}"],
                                        r"no-eos\.json has no end-of-document token data\.eos_token='<\|endoftext\|>'"),
    "vocabulary_past_the_chosen_dtype": (lambda d: _write(d, _texts(), "jsonl"),
                                         ["data.tokenizer_path={big}", f"data.eos_token='{EOS}'",
                                          "data.token_dtype=uint16"],
                                         r"data\.token_dtype=uint16 holds ids up to 65,535.*tokenizer\.json"),
}


def _cut(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _append(path: Path, line: bytes) -> Path:
    path.write_bytes(path.read_bytes() + line)
    return path


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_exits_2_with_one_line_and_leaves_no_prepared_folder(case, tmp_path, capsys, big_tokenizer):
    make, overrides, message = BAD_INPUT[case]
    corpus = make(tmp_path / "corpus")
    out = tmp_path / "prep" / "out"
    names = {"noeos": _tokenizer_without_eos(tmp_path), "big": big_tokenizer}
    args = ["prepare", str(ROOT / "experiments" / "runs" / "tiny.yaml"), "data.corpus=jsonl",
            f"data.paths=[{corpus}]", f"data.prepared_dir={out}", "data.vocab_size=300", "data.val_fraction=0.2",
            "data.max_documents=null", *[o.format(**names) for o in overrides]]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not out.exists() and not (out.parent.exists() and any(out.parent.iterdir()))  # no temporary folder either


def test_a_manifest_prepared_before_the_new_fields_still_matches(tmp_path):
    cfg = DataConfig()
    old = {k: v for k, v in content_config(cfg).items() if k not in ("eos_token", "bos_token", "token_dtype")}
    check_config({"config": old}, cfg, tmp_path)  # no error: made with the defaults
    with pytest.raises(DataError, match=r"data\.eos_token"):
        check_config({"config": old}, replace(cfg, eos_token=EOS), tmp_path)


def test_the_shards_dtype_is_chosen_by_the_vocabulary_and_refused_when_too_narrow():
    from lit_pretrain.data.shards import token_dtype

    assert token_dtype(65_536).name == "uint16" and token_dtype(65_537).name == "uint32"
    assert token_dtype(300, "uint32").name == "uint32"
    with pytest.raises(DataError, match=r"data\.token_dtype=uint16.*t\.json"):
        token_dtype(65_537, "uint16", "t.json")
