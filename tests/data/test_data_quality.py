"""prepare's quality gate: a corpus that is mostly not text is refused before anything is written."""

import random
import re
import sys
import unicodedata
from pathlib import Path

import pytest

from lit_pretrain import cli
from lit_pretrain.data.preparation.corpus import CorpusStats, read_documents
from lit_pretrain.data.preparation.prepare import prepare
from lit_pretrain.data.preparation.quality import SourceQuality, check_quality, corpus_quality, count_control
from lit_pretrain.errors import DataError
from lit_pretrain.schema import DataConfig
from tests.conftest import EXPERIMENTS


def random_binary_files(folder: Path, n: int, size: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        # The last three are 2, 3 and 4 times larger: the files with most invalid characters, in reverse order.
        (folder / f"blob_{i:02d}.txt").write_bytes(rng.randbytes(size * max(1, i - n + 5)))
    return folder


def test_control_characters_are_category_cc_less_tab_newline_return():
    cc = {c for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cc"}
    counted = {c for c in cc | set(range(0x100)) if count_control(chr(c))}
    assert counted == cc - {0x09, 0x0A, 0x0D} and len(counted) == 62
    assert count_control("tab\tline\nreturn\r\ufffd\u00a0\u200b") == 0  # U+FFFD counts only as a replacement


def test_eighty_random_binary_files_are_refused_before_anything_is_written(tmp_path):
    corpus = random_binary_files(tmp_path / "blobs", 80, 2000)
    out = tmp_path / "prepared" / "blobs"
    cfg = DataConfig(corpus="text", paths=[str(corpus)], prepared_dir=str(out), vocab_size=300)
    with pytest.raises(DataError) as err:
        prepare(cfg, log=lambda _: None)
    message = str(err.value)
    assert "\n" not in message and "data.max_invalid_fraction=0.01" in message
    named = re.findall(r"blob_(\d\d)\.txt \((\d+\.\d)% of", message)
    assert [int(i) for i, _ in named] == [79, 78, 77], message
    # Random bytes: about half are not UTF-8 and about a quarter of the ASCII rest are control characters.
    assert all(50 < float(pct) < 75 for _, pct in named)
    assert "and 77 more files" in message
    assert not (tmp_path / "prepared").exists()  # refused before the folder (or a temporary sibling) was made


def test_the_same_files_prepare_when_the_gate_is_opened(tmp_path):
    # The split hashes each document's id, its path below tmp_path (the same every run since ids are relative):
    # 24 files at val_fraction 0.5 put documents in both splits.
    corpus = random_binary_files(tmp_path / "blobs", 24, 600)
    cfg = DataConfig(corpus="text", paths=[str(corpus)], prepared_dir=str(tmp_path / "out"), vocab_size=300,
                     val_fraction=0.5, max_invalid_fraction=1.0)
    manifest = prepare(cfg, log=lambda _: None)
    assert 0.5 < manifest["corpus"]["invalid_fraction"] < 0.75


def test_a_few_bad_files_among_good_ones_are_the_ones_named(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    for i in range(40):
        (folder / f"good_{i:02d}.txt").write_text(f"plain text document number {i} " * 50)
    (folder / "nul.txt").write_bytes(b"text\x00" * 300)  # 1 in 5 characters is a NUL
    (folder / "latin1.txt").write_bytes("caf\u00e9 ".encode("latin-1") * 400)  # 1 in 5 bytes is not UTF-8
    stats = CorpusStats()
    read_documents(DataConfig(corpus="text", paths=[str(folder)]), stats)
    total = corpus_quality(stats.sources)
    assert (total.control, total.replaced) == (300, 400)
    assert stats.sources["mixed/nul.txt"].fraction == pytest.approx(0.2)
    with pytest.raises(DataError, match=r"latin1\.txt \(20\.0% of 2,000 characters\), .*nul\.txt \(20\.0% of 1,500 "
                                        r"characters\)\. Remove or convert"):
        check_quality(stats.sources, 0.01, "here")
    assert check_quality(stats.sources, total.fraction, "here") == total  # at the limit: accepted, the totals returned


def test_control_characters_inside_jsonl_text_count(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a\\u0000b\\u0001c\\td"}\n{"text": "clean"}\n')
    stats = CorpusStats()
    read_documents(DataConfig(corpus="jsonl", paths=[str(path)]), stats)
    assert stats.sources["c.jsonl"] == SourceQuality(characters=7 + 5, control=2, replaced=0)


def test_the_default_stdlib_corpus_passes_the_default_gate():
    stats = CorpusStats()
    read_documents(DataConfig(), stats)
    # Measured 1.8e-6 on Python 3.11.7 (58 replacements in deliberately mis-encoded test files): far under 0.01.
    assert check_quality(stats.sources, DataConfig().max_invalid_fraction, "stdlib").fraction < 1e-4


def test_prepare_on_the_command_line_exits_2_with_one_line(tmp_path, capsys):
    corpus = random_binary_files(tmp_path / "blobs", 5, 500)
    rc = cli.main(["prepare", str(EXPERIMENTS / "runs" / "tiny.yaml"), "data=text", f"data.paths=[{corpus}]",
                   f"data.prepared_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and err.startswith("lit-pretrain prepare: error: the corpus at data.paths=")
    assert "blob_04.txt" in err and "data.max_invalid_fraction" in err
