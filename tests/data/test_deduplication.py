"""Deduplication: planted near-duplicates against brute-force Jaccard, exact duplicates after normalization,
determinism across pool sizes, real near-duplicates of the standard library, the LSH shape, the report and
manifest, bad input, and an index in a real Redis server."""

import json
import shutil
import subprocess
import sys
import time
import unicodedata
from dataclasses import replace

import numpy as np
import pytest
from datasketch import MinHash, MinHashLSH

from lit_pretrain import config
from lit_pretrain.data.preparation import minhash
from lit_pretrain.data.preparation.corpus import Document, read_documents
from lit_pretrain.data.preparation.deduplicate import deduplicate
from lit_pretrain.data.preparation.deduplication_report import REPORT_FILE, dataset_summary, format_report, read_removed
from lit_pretrain.data.preparation.lsh import bands_rows, candidate_probability, clusters
from lit_pretrain.data.preparation.prepare import prepare
from lit_pretrain.data.tokenizer import encode_texts, load_tokenizer
from lit_pretrain.errors import ConfigError, DataError
from lit_pretrain.schema import DataConfig, DeduplicationConfig
from tests.conftest import EXPERIMENTS, ROOT, free_port
from tests.helpers.planted import jaccard, planted_corpus

IN_PROCESS = DeduplicationConfig(processes=1)


@pytest.fixture(scope="module")
def planted():
    docs, pairs = planted_corpus()
    return docs, pairs, deduplicate(docs, IN_PROCESS, progress=False)


def removed_ids(result):
    return {d.id for d in result.removed}


# Planted near-duplicates


def test_planted_pairs_recall_and_false_removals_against_brute_force_jaccard(planted):
    docs, pairs, result = planted
    threshold = IN_PROCESS.threshold
    gone = removed_ids(result)
    high = [p for p in pairs if p.jaccard >= threshold + 0.05]
    low = [p for p in pairs if p.jaccard < threshold - 0.1]
    # The generator spreads similarities widely enough that both bins hold over 100 pairs (119 and 135 at seed 0).
    assert len(high) > 100 and len(low) > 100
    recall = np.mean([docs[p.copy].id in gone for p in high])
    false_removal = np.mean([docs[p.copy].id in gone for p in low])
    print(f"\nplanted pairs: recall {recall:.3f} over {len(high)} pairs with Jaccard >= {threshold + 0.05:.2f}; "
          f"false removals {false_removal:.3f} over {len(low)} pairs below {threshold - 0.1:.2f}")
    assert recall >= 0.95
    assert false_removal <= 0.05
    # Originals come first, so only copies may go; unrelated documents all stay.
    assert gone <= {docs[p.copy].id for p in pairs}
    near = result.report["near"]
    assert near["removed_documents"] == len(gone) and result.report["exact"]["removed_documents"] == 0
    assert near["verified_pairs"] + near["false_positive_pairs"] == near["candidate_pairs"]


def test_removal_records_pair_each_planted_copy_with_its_original(planted):
    docs, pairs, result = planted
    by_copy = {docs[p.copy].id: p for p in pairs}
    rows = result.removals
    assert [r["id"] for r in rows] == [d.id for d in result.removed]  # every removed document, in corpus order
    for row in rows:
        pair = by_copy[row["id"]]  # only planted copies are removed (asserted above), each paired with its original
        assert row["kind"] == "near" and row["duplicates"] == docs[pair.base].id == row["linked_to"]
        # 128 permutations: the estimate's standard deviation is sqrt(J(1 - J) / 128) <= 0.045; 4 of them, and the
        # estimate to the kept document is the one the pair was verified with.
        assert abs(row["jaccard"] - pair.jaccard) <= 4 * (pair.jaccard * (1 - pair.jaccard) / 128) ** 0.5 + 1e-9
        assert row["jaccard"] == row["link_jaccard"] >= IN_PROCESS.threshold


def test_removal_records_of_exact_duplicates_and_of_a_chain(planted):
    docs, pairs, _ = planted
    pair = max(pairs, key=lambda p: p.jaccard if p.jaccard < 1 else 0)  # a near, not exact, planted copy
    base, copy = docs[pair.base], docs[pair.copy]
    chain = [base, copy, Document("again", copy.text), Document("twice", base.text), Document("blank", "  ")]
    rows = {r["id"]: r for r in deduplicate(chain, IN_PROCESS, progress=False).removals}
    assert rows["twice"] == {"id": "twice", "kind": "exact", "duplicates": base.id, "jaccard": 1.0}
    assert rows["blank"] == {"id": "blank", "kind": "empty", "duplicates": None, "jaccard": None}
    assert rows[copy.id]["kind"] == "near" and rows[copy.id]["duplicates"] == base.id
    # "again" repeats the copy, which went as a near duplicate of the base: it stands for the base, like the copy.
    assert rows["again"] == {"id": "again", "kind": "exact", "duplicates": base.id,
                             "jaccard": rows[copy.id]["jaccard"], "same_text_as": copy.id}


def test_verification_drops_lsh_false_positives(planted):
    """Without verification every LSH candidate is an edge; the candidates that verification rejects are exactly
    the pairs whose estimated Jaccard is below the threshold, so turning it off can only remove more."""
    docs, pairs, verified = planted
    unverified = deduplicate(docs, replace(IN_PROCESS, verify=False), progress=False)
    assert removed_ids(verified) < removed_ids(unverified)
    assert unverified.report["near"]["candidate_pairs"] == verified.report["near"]["candidate_pairs"]
    assert verified.report["near"]["false_positive_pairs"] > 0


# Exact duplicates and normalization


def variants():
    base = "Grösse  matters:\tthe café's menu\nlists crème brûlée."  # no ß: "ß".upper() is "SS", not a case variant
    return [
        Document("base", base),
        Document("nfd", unicodedata.normalize("NFD", base)),  # same text, decomposed accents
        Document("copy", base),
        Document("spaces", "  Grösse matters: the café's menu lists   crème brûlée.\n"),
        Document("upper", base.upper()),
        Document("other", "a different document altogether"),
    ]


@pytest.mark.parametrize("lowercase, fold, removed", [
    (False, True, {"nfd", "copy", "spaces"}),
    (False, False, {"nfd", "copy"}),
    (True, True, {"nfd", "copy", "spaces", "upper"}),
    (True, False, {"nfd", "copy", "upper"}),  # "upper" keeps the base's whitespace; "spaces" does not
])
def test_exact_duplicates_after_normalization_are_all_removed(lowercase, fold, removed):
    docs = variants()
    cfg = DeduplicationConfig(near=False, lowercase=lowercase, fold_whitespace=fold)
    result = deduplicate(docs, cfg, progress=False)
    assert removed_ids(result) == removed
    assert [d.id for d in result.kept] == [d.id for d in docs if d.id not in removed]
    report = result.report
    assert report["exact"]["removed_documents"] == len(removed)
    assert report["documents_in"] - report["documents_out"] == len(removed)
    assert report["bytes_in"] - report["bytes_out"] == sum(len(d.text.encode()) for d in docs if d.id in removed)


def test_empty_documents_are_dropped_and_counted():
    docs = [Document("a", "some text here"), Document("blank", " \n\t "), Document("b", "other text")]
    result = deduplicate(docs, IN_PROCESS, progress=False)
    assert [d.id for d in result.kept] == ["a", "b"]
    assert result.report["empty"] == {"documents": 1, "examples": ["blank"]}


# Determinism and the signatures themselves


@pytest.mark.slow
def test_same_kept_set_and_signatures_whatever_the_number_of_processes(planted, monkeypatch):
    docs, _, _ = planted
    docs = docs[:300]  # ~600 kB
    # Small chunks: 2 processes share 6 chunks, so the order in which chunks finish varies between runs.
    monkeypatch.setattr(minhash, "_CHUNK_CHARS", 100_000)
    one = deduplicate(docs, IN_PROCESS, progress=False)
    two = deduplicate(docs, replace(IN_PROCESS, processes=2), progress=False)
    assert (one.report["near"]["processes"], two.report["near"]["processes"]) == (1, 2)
    assert one.report["near"]["removed_documents"] > 10
    assert [d.id for d in two.kept] == [d.id for d in one.kept]
    assert two.report["near"]["candidate_pairs"] == one.report["near"]["candidate_pairs"]

    texts = [minhash.normalize(d.text, False, True) for d in docs[:120]]  # ~240 kB: 3 chunks
    sig2, used = minhash.compute_signatures(texts, "word", 5, 128, 1, processes=2, progress=False)
    # Each row is exactly what datasketch's own MinHash.bulk gives for the same shingles, seed and num_perm.
    bulk = MinHash.bulk([list(minhash.shingles(t, "word", 5)) for t in texts], num_perm=128, seed=1)
    assert used == 2 and np.array_equal(sig2, np.stack([m.hashvalues for m in bulk]))
    assert sig2.dtype == np.uint32 and sig2.nbytes == 120 * 128 * 4


def test_a_long_document_is_hashed_in_slices_to_the_same_signature():
    text = " ".join(f"w{i}" for i in range(40_000))  # 39,996 distinct 5-word shingles: 3 slices
    grams = minhash.shingles(text, "word", 5)
    assert len(grams) > 2 * minhash._UPDATE_BATCH
    sig = minhash.chunk_signatures((["a b", text, "c d e"], "word", 5, 64, 3))
    assert np.array_equal(sig[1], MinHash.bulk([grams], num_perm=64, seed=3)[0].hashvalues)


@pytest.mark.parametrize("kind, size, num_perm, seed", [("word", 5, 128, 1), ("char", 3, 64, 7), ("word", 1, 256, 0)])
def test_numpy_signatures_are_datasketchs_minhash_bit_for_bit(kind, size, num_perm, seed, monkeypatch):
    """minhash.py computes MinHash without datasketch (workers import numpy only): the same permutations, shingle
    hash and values as datasketch's MinHash, for texts that are empty, shorter than a shingle, or not ASCII, in
    blocks that end mid-chunk (_UPDATE_BATCH 50)."""
    rng = np.random.default_rng(seed)
    words = np.array(["ab", "cd", "é", "日本", "z", "ünï"])
    texts = ["", "a", "hello world"] + [" ".join(rng.choice(words, rng.integers(0, 60))) for _ in range(100)]
    monkeypatch.setattr(minhash, "_UPDATE_BATCH", 50)
    got = minhash.chunk_signatures((texts, kind, size, num_perm, seed))
    want = MinHash.bulk([list(minhash.shingles(t, kind, size)) for t in texts], num_perm=num_perm, seed=seed)
    assert got.dtype == np.uint32 and np.array_equal(got, np.stack([m.hashvalues for m in want]))
    a, b = minhash.permutations(num_perm, seed)
    assert np.array_equal(np.stack([a, b]), MinHash(num_perm=num_perm, seed=seed).permutations)


def test_chunks_shared_by_processes_shrink_near_the_end():
    """compute_signatures' chunks cover the texts in order; for 2 processes the last ones are small (each at most
    1/8 of what is left, down to _MIN_CHUNK_CHARS), so one process never computes a whole chunk while the other
    waits."""
    texts = ["x" * 1000] * 3000  # 3 MB
    one, two = list(minhash.chunks(texts, 1 << 20)), list(minhash.chunks(texts, 1 << 20, parts=2))
    for ranges in (one, two):
        assert ranges[0][0] == 0 and ranges[-1][1] == len(texts)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert len(one) == 3
    sizes = [1000 * (b - a) for a, b in two]
    assert sizes[0] >= 1 << 18 and max(sizes[-3:]) <= 2 * minhash._MIN_CHUNK_CHARS
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("lengths, max_chars, expected", [
    ([5, 0, 5, 10, 1], 10, [(0, 3), (3, 4), (4, 5)]),  # a chunk ends at the text that brings it to max_chars
    ([0, 0, 3], 1, [(0, 3)]),  # empty texts join the chunk of the next text
    ([30], 10, [(0, 1)]),  # a text longer than max_chars is a chunk of its own
    ([], 10, []),
])
def test_chunks_end_at_the_first_text_that_reaches_the_size(lengths, max_chars, expected):
    assert minhash.chunks(["x" * n for n in lengths], max_chars) == expected


def test_a_signature_worker_imports_neither_datasketch_nor_scipy():
    """What a worker loads (lit_pretrain/data/preparation/workers.py imports the target's module): importing datasketch
    and scipy took ~2.5 s per worker."""
    code = ("import sys, lit_pretrain.data.preparation.minhash, lit_pretrain.data.preparation.ray_engine; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'datasketch', 'scipy', 'torch', 'lightning'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_another_seed_gives_other_signatures_but_finds_the_same_duplicates(planted):
    docs, pairs, result = planted
    other = deduplicate(docs, replace(IN_PROCESS, seed=7), progress=False)
    # Pairs far from the threshold are decided alike by any seed; only borderline pairs may differ.
    clear = {docs[p.copy].id for p in pairs if p.jaccard >= 0.9 or p.jaccard < 0.7}
    assert removed_ids(other) & clear == removed_ids(result) & clear


# Real text: the standard library's code-page tables


@pytest.fixture(scope="module")
def encodings_docs():
    return [d for d in read_documents(DataConfig()) if d.id.startswith("encodings/")]


def test_stdlib_code_page_tables_are_found_and_distinct_files_kept(encodings_docs):
    docs = {d.id: d for d in encodings_docs}
    result = deduplicate(encodings_docs, IN_PROCESS, progress=False)
    gone = removed_ids(result)
    # cp1254 (Turkish) differs from cp1252 (Western) in a handful of the 256 table lines; cp860/cp865 from cp437
    # likewise. Brute force confirms they are above the threshold, and the earlier file of each pair stays.
    for kept, removed in (("encodings/cp1252.py", "encodings/cp1254.py"), ("encodings/cp437.py", "encodings/cp865.py"),
                          ("encodings/cp437.py", "encodings/cp860.py")):
        assert jaccard(docs[kept].text, docs[removed].text) >= 0.8
        assert removed in gone and kept not in gone
    for distinct in ("encodings/__init__.py", "encodings/utf_8.py", "encodings/idna.py", "encodings/punycode.py",
                     "encodings/cp932.py", "encodings/aliases.py"):
        assert distinct not in gone
    clusters_ = result.report["near"]["largest_clusters"]
    assert clusters_[0]["size"] >= clusters_[-1]["size"] and all(c["kept"] not in gone for c in clusters_)


# LSH shape


@pytest.mark.parametrize("threshold, num_perm", [(0.5, 64), (0.7, 128), (0.8, 128), (0.9, 256)])
def test_bands_rows_are_datasketchs_optimum(threshold, num_perm):
    even = DeduplicationConfig(threshold=threshold, num_perm=num_perm, false_negative_weight=0.5)
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)  # its default weights are (0.5, 0.5)
    assert bands_rows(even) == (lsh.b, lsh.r)
    default = DeduplicationConfig(threshold=threshold, num_perm=num_perm)
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.1, 0.9))
    assert bands_rows(default) == (lsh.b, lsh.r)


def test_explicit_bands_rows_are_honoured(planted):
    docs, _, _ = planted
    cfg = replace(IN_PROCESS, bands=16, rows=8)
    assert bands_rows(cfg) == (16, 8)
    near = deduplicate(docs, cfg, progress=False).report["near"]
    assert (near["bands"], near["rows"], near["bands_rows_source"]) == (16, 8, "config")
    assert near["candidate_probability"]["0.80"] == pytest.approx(1 - (1 - 0.8**8) ** 16, abs=1e-4)


@pytest.mark.parametrize("s, expected", [(0.2, 0.006), (0.3, 0.047), (0.4, 0.186), (0.5, 0.470), (0.6, 0.802),
                                         (0.7, 0.975), (0.8, 0.9996)])
def test_candidate_probability_table(s, expected):
    # Leskovec, Rajaraman & Ullman, Mining of Massive Datasets, section 3.4.2, Figure 3.8: b = 20 bands, r = 5 rows.
    assert candidate_probability(s, 20, 5) == pytest.approx(expected, abs=6e-4)


def test_clusters_keep_the_first_document_whatever_the_edge_order():
    left, right = np.array([5, 3, 1, 7]), np.array([6, 5, 2, 8])
    assert clusters(9, left, right) == {1: [1, 2], 3: [3, 5, 6], 7: [7, 8]}
    assert clusters(9, right[::-1], left[::-1]) == {1: [1, 2], 3: [3, 5, 6], 7: [7, 8]}


# Report, manifest, tokens


@pytest.mark.slow
def test_prepare_writes_the_report_and_tokens_before_and_after(tmp_path):
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(3000)]
    texts = [" ".join(rng.choice(words, 200)) for _ in range(60)]
    texts += [texts[3], texts[4].upper(), texts[5] + " tail words added"]  # exact, case variant, near duplicate
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(texts):
        (corpus / f"d{i:03d}.txt").write_text(text)
    cfg = DataConfig(corpus="text", paths=[str(corpus)], prepared_dir=str(tmp_path / "out"), vocab_size=300,
                     val_fraction=0.2, deduplication=IN_PROCESS)
    lines = []
    manifest = prepare(cfg, log=lines.append)
    entry = manifest["deduplication"]
    counts = (entry["documents_in"], entry["removed_exact"], entry["removed_near"], entry["documents_out"])
    assert counts == (63, 1, 1, 61)
    # Tokens before = every document encoded with the shards' tokenizer, one EOD each.
    tok = load_tokenizer(tmp_path / "out" / "tokenizer.json")
    assert entry["tokens_before"] == sum(len(ids) + 1 for ids in encode_texts(tok, texts))
    assert entry["tokens_after"] == manifest["splits"]["train"]["tokens"] + manifest["splits"]["val"]["tokens"]
    report = json.loads((tmp_path / "out" / REPORT_FILE).read_text())
    # removed.jsonl beside it: the exact repeat of d003 and the near copy of d005, each with the document it repeats.
    removed = {r["id"]: r for r in read_removed(tmp_path / "out")}
    assert set(removed) == {"corpus/d060.txt", "corpus/d062.txt"}
    assert removed["corpus/d060.txt"] == {"id": "corpus/d060.txt", "kind": "exact", "duplicates": "corpus/d003.txt",
                                          "jaccard": 1.0}
    near = removed["corpus/d062.txt"]
    assert near["kind"] == "near" and near["duplicates"] == "corpus/d005.txt" and near["jaccard"] > 0.9
    assert report["tokens_after"] == entry["tokens_after"] and report["near"]["candidate_probability"]
    assert "deduplication" in "\n".join(lines) and "near duplicates" in format_report(report)

    summary = dataset_summary(manifest, params=1000, tokens_seen=2 * manifest["splits"]["train"]["tokens"])
    assert summary["dataset_tokens_per_param"] == manifest["splits"]["train"]["tokens"] / 1000
    assert summary["epochs"] == 2.0 and summary["deduplication"] == entry

    # The pool size does not decide the content; any other deduplication setting does.
    lines.clear()
    prepare(replace(cfg, deduplication=replace(IN_PROCESS, processes=2)), log=lines.append)
    assert lines[0].startswith("reusing") and lines[1].startswith("deduplication: 63 documents in, 61 out")
    with pytest.raises(DataError, match=r"data\.deduplication"):
        prepare(replace(cfg, deduplication=replace(IN_PROCESS, threshold=0.7)), log=lambda _: None)


# Bad input


@pytest.mark.parametrize("override, message", [
    ("data.deduplication.threshold=1.0", "expected a value < 1.0"),
    ("data.deduplication.threshold=0", "expected a value > 0.0"),
    ("data.deduplication.bands=20", "set both"),
    ("data.deduplication.rows=20", "set both"),
])
def test_bad_config_is_refused_at_load(override, message):
    with pytest.raises(ConfigError, match=message):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", [override])


def test_bands_times_rows_above_num_perm_is_refused():
    with pytest.raises(ConfigError, match=r"bands × rows = 20 × 7 = 140 exceeds data\.deduplication\.num_perm=128"):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", ["data.deduplication.bands=20", "data.deduplication.rows=7"])
    with pytest.raises(ConfigError, match=r"threshold=1\.5 is outside \(0, 1\)"):
        DeduplicationConfig(threshold=1.5)


def test_unreachable_redis_is_a_clear_error(planted):
    docs, _, _ = planted
    cfg = replace(IN_PROCESS, storage="redis", redis_port=free_port())  # nothing listens there
    with pytest.raises(DataError, match=r"cannot reach Redis at 127\.0\.0\.1:\d+.*storage=memory"):
        deduplicate(docs[:50], cfg, progress=False)


# Redis


@pytest.fixture
def redis_server(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server binary on PATH (.ci/run installs Debian's redis-server)")
    redis = pytest.importorskip("redis", reason="the redis Python client is not installed (pyproject dependency)")
    port = free_port()
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.skip(f"redis-server could not be started on 127.0.0.1:{port}")
                time.sleep(0.05)
        yield client, port
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_lsh_index_in_redis_gives_the_same_kept_set_and_is_shared(planted, redis_server):
    client, port = redis_server
    docs, pairs, _ = planted
    docs = docs[:300]
    in_memory = deduplicate(docs, IN_PROCESS, progress=False)
    cfg = replace(IN_PROCESS, storage="redis", redis_port=port)
    result = deduplicate(docs, cfg, progress=False)
    assert in_memory.report["near"]["removed_documents"] > 10
    assert [d.id for d in result.kept] == [d.id for d in in_memory.kept]
    assert result.report["near"]["index"]["storage"] == "redis"
    assert client.dbsize() == 0  # an unnamed index is deleted after the stage

    named = replace(cfg, redis_basename="corpus-a")
    deduplicate(docs, named, progress=False)
    assert client.dbsize() > 0
    # Another process attaches to the same index through datasketch's own storage and finds a planted copy's
    # original by querying with the copy's signature.
    lsh = MinHashLSH(num_perm=128, params=bands_rows(cfg), storage_config={
        "type": "redis", "basename": b"corpus-a", "redis": {"host": "127.0.0.1", "port": port}})
    pair = max((p for p in pairs if p.copy < 300), key=lambda p: p.jaccard)
    m = MinHash(num_perm=128, seed=1)
    m.update_batch(list(minhash.shingles(minhash.normalize(docs[pair.copy].text, False, True), "word", 5)))
    # Keys are positions among the documents left after exact deduplication: all of them in this corpus.
    assert in_memory.report["exact"]["removed_documents"] == 0
    assert pair.base in lsh.query(m)
    with pytest.raises(DataError, match="already holds keys"):
        deduplicate(docs, named, progress=False)


def test_batched_redis_index_gives_the_in_memory_pairs_and_leaves_nothing(redis_server):
    """The Redis index is written and read a batch at a time by scripts (lsh.py): the pairs are the in-memory
    index's, across batch boundaries and in buckets of many documents, and an unnamed index is deleted after."""
    from lit_pretrain.data.preparation import lsh

    client, port = redis_server
    rng = np.random.default_rng(1)
    signatures = rng.integers(0, 4, size=(250, 128)).astype(np.uint32)  # few values: large shared buckets
    cfg = replace(IN_PROCESS, storage="redis", redis_port=port)
    memory = lsh.candidate_pairs(signatures, IN_PROCESS, 16, 2, lsh.index_basename(IN_PROCESS))
    old_batch, lsh._REDIS_BATCH = lsh._REDIS_BATCH, 64  # 4 batches
    try:
        in_redis = lsh.candidate_pairs(signatures, cfg, 16, 2, lsh.index_basename(cfg))
    finally:
        lsh._REDIS_BATCH = old_batch
    assert len(memory[0]) > 1000
    np.testing.assert_array_equal(in_redis[0], memory[0])
    np.testing.assert_array_equal(in_redis[1], memory[1])
    assert client.dbsize() == 0
