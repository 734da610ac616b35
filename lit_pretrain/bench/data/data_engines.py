"""Cases: prepare's deduplication on the Ray engine against the local engine, Ray with 2 CPUs against 1, the Redis
LSH index against the in-memory one, and both engines against datatrove's MinHash pipeline.

Corpus: synthetic near-duplicate documents (random 3-9 letter words; each original followed later by a copy with
a few percent of its words replaced), written as jsonl files, so every run sees the same text: 8k documents of ~1 kB
for the engines, 15k of 40 words for the local engine against datatrove (alternated, bench/child.py). Timed: pass 1
of prepare (read, normalize, exact hashes, signatures, LSH, clusters), the part the engines do differently; the
tokenizer is the same code in both. Ray runs on a local cluster of 2 CPUs started here, timed after a warm-up run
that starts its workers. datatrove runs its four MinHash stages (signatures, buckets, clusters, filter) with the
same 5-word shingles, seed, bands and rows, on 2 local workers; it does not verify candidates by their estimated
Jaccard, so its removed set is compared, not required equal. Without datatrove, its case says why it was skipped."""

import json
import random
import shutil
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from lit_pretrain.bench import child
from lit_pretrain.bench.child import series
from lit_pretrain.bench.stats import alternate
from lit_pretrain.schema import DataConfig, DeduplicationConfig

_DOCS = 8_000  # originals and copies; ~1 kB each
_FILES = 16
# The corpus of the comparison with datatrove: many short documents (as Debian's fortunes), where a per-document
# cost in the LSH stage shows (goal: our whole stage >= 1.5x datatrove's).
SHORT_DOCS, SHORT_WORDS = 15_000, 40


def near_duplicate_texts(docs: int, seed: int = 0, words: int = 160) -> List[str]:
    """`docs` texts of `words` random words; half the originals are followed within 50 texts by a copy with up to 5%
    of its words replaced."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9))) for _ in range(20_000)]
    texts: List[str] = []
    while len(texts) < docs:
        original = [rng.choice(vocab) for _ in range(words)]
        texts.append(" ".join(original))
        if rng.random() < 0.5:
            copy = list(original)
            for i in rng.sample(range(words), rng.randint(0, words // 20)):
                copy[i] = rng.choice(vocab)
            texts.insert(rng.randint(max(0, len(texts) - 50), len(texts)), " ".join(copy))
    return texts[:docs]


def write_corpus(folder: Path, docs: int = _DOCS, seed: int = 0, words: int = 160) -> None:
    texts = near_duplicate_texts(docs, seed, words)
    per_file = -(-docs // _FILES)
    for k in range(_FILES):
        with open(folder / f"part-{k}.jsonl", "w") as f:
            for line, text in enumerate(texts[k * per_file : (k + 1) * per_file], start=1):
                f.write(json.dumps({"id": f"{k}:{line}", "text": text}) + "\n")


def _config(corpus: Path, **kw) -> DataConfig:
    return DataConfig(corpus="jsonl", paths=[str(corpus)], prepared_dir=str(corpus.parent / "unused"),
                      deduplication=DeduplicationConfig(processes=2), **kw)


def _local(cfg: DataConfig, work: Path):
    from lit_pretrain.data.preparation.corpus import CorpusStats
    from lit_pretrain.data.preparation.prepare import _first_pass

    tmp = Path(tempfile.mkdtemp(dir=work))
    start = time.perf_counter()
    _, _, decided, _ = _first_pass(cfg, CorpusStats(), tmp)
    return time.perf_counter() - start, decided


def _ray(cfg: DataConfig, session):
    from lit_pretrain.data.preparation import ray_engine
    from lit_pretrain.data.preparation.corpus import CorpusStats

    start = time.perf_counter()
    _, _, decided, _, _ = ray_engine.first_pass(cfg, session, CorpusStats(), log=lambda *_: None)
    return time.perf_counter() - start, decided


def _removed_lines(decided, cfg: DataConfig) -> set:
    """(file, line) of each removed document: the ids datatrove's exclusion writer gives back."""
    from lit_pretrain.data.preparation.corpus import iter_documents

    out = set()
    for i, doc in enumerate(iter_documents(cfg)):
        if decided.removed[i]:
            path, line = doc.id.rsplit(":", 1)
            out.add(f"{Path(path).stem.split('-')[1]}:{line}")
    return out


def _datatrove_missing() -> Optional[str]:
    """Why datatrove's MinHash pipeline cannot run here, or None."""
    try:
        import datatrove.pipeline.dedup  # noqa: F401
    except ImportError as err:
        return f"datatrove is not importable ({err}): pip install datatrove to measure this case"
    return None


def _datatrove(corpus: Path, work: Path, bands: int, rows: int, seed: int) -> Dict:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers.jsonl import JsonlWriter
    from datatrove.utils.word_tokenizers import WordTokenizer

    class Whitespace(WordTokenizer):
        """Words split on whitespace, as our word shingles are (its default English tokenizer needs nltk data)."""

        def word_tokenize(self, text: str) -> List[str]:
            return text.split()

        def sent_tokenize(self, text: str) -> List[str]:
            return [text]

        def span_tokenize(self, text: str):
            return [(0, len(text))]

    from datatrove.utils.hashing import HashConfig

    # SHA-1's first 4 bytes per shingle: datasketch's shingle hash, so both hash the same shingles alike (its default
    # xxhash needs bytes that its own signature stage does not pass, with the installed xxhash).
    config = MinhashConfig(n_grams=5, num_buckets=bands, hashes_per_bucket=rows, seed=seed,
                           hash_config=HashConfig(precision=32, hash_fc="sha1"))
    out = work / "datatrove"
    logs = str(out / "logs")
    stages = [
        LocalPipelineExecutor(pipeline=[JsonlReader(str(corpus)), MinhashDedupSignature(str(out / "sigs"), config,
                                                                                      language=Whitespace())],
                              tasks=_FILES, workers=2, logging_dir=f"{logs}/1"),
        LocalPipelineExecutor(pipeline=[MinhashDedupBuckets(str(out / "sigs"), str(out / "buckets"), config=config)],
                              tasks=bands, workers=2, logging_dir=f"{logs}/2"),
        LocalPipelineExecutor(pipeline=[MinhashDedupCluster(str(out / "buckets"), str(out / "ids"), config=config)],
                              tasks=1, logging_dir=f"{logs}/3"),
        LocalPipelineExecutor(pipeline=[JsonlReader(str(corpus)), MinhashDedupFilter(
            str(out / "ids"), exclusion_writer=JsonlWriter(str(out / "removed"), compression=None))],
            tasks=_FILES, workers=2, logging_dir=f"{logs}/4"),
    ]
    start = time.perf_counter()
    for stage in stages:
        stage.run()
    seconds = time.perf_counter() - start
    removed = set()
    for path in (out / "removed").glob("*.jsonl"):
        removed.update(json.loads(line)["id"] for line in path.read_text().splitlines())
    return {"seconds": seconds, "removed": removed}


def _overlap(a: set, b: set) -> Dict:
    return {"ours": len(a), "datatrove": len(b), "both": len(a & b),
            "jaccard": round(len(a & b) / max(1, len(a | b)), 4)}


def _redis_vs_memory(cfg: DeduplicationConfig, signatures: np.ndarray) -> Optional[Dict]:
    """Seconds of the LSH stage (insert all, query all) with datasketch's index in Redis and in memory (the
    reference of the <= 3 goal), and of storage=memory's numpy banding."""
    from lit_pretrain.data.preparation.lsh import bands_rows, candidate_pairs, index_basename, minhashlsh_pairs

    binary = shutil.which("redis-server")
    if binary is None:
        return None
    import socket

    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    work = tempfile.mkdtemp()
    proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", work], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        bands, rows = bands_rows(cfg)
        redis_cfg = DeduplicationConfig(**{**cfg.__dict__, "storage": "redis", "redis_port": port})
        start = time.perf_counter()
        want = minhashlsh_pairs(signatures, bands, rows, cfg.seed)
        memory = time.perf_counter() - start
        start = time.perf_counter()
        banded = candidate_pairs(signatures, cfg, bands, rows, index_basename(cfg))
        banding = time.perf_counter() - start
        start = time.perf_counter()
        got = candidate_pairs(signatures, redis_cfg, bands, rows, index_basename(redis_cfg))
        in_redis = time.perf_counter() - start
        for pairs in (banded, got):
            assert np.array_equal(want[0], pairs[0]) and np.array_equal(want[1], pairs[1])
        return {"memory": memory, "redis": in_redis, "banding": banding, "pairs": int(len(want[0]))}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


def measure(docs: int = _DOCS, repeats: int = 5) -> List[Dict]:
    try:
        import ray
    except ImportError:  # the Ray cases need the extra; the others are measured without them
        ray = None
    from lit_pretrain.data.preparation import ray_engine
    from lit_pretrain.data.preparation.lsh import bands_rows
    from lit_pretrain.data.preparation.ray_engine import Session

    work = Path(tempfile.mkdtemp(prefix="lit-pretrain-bench-engines-"))
    try:
        corpus = work / "corpus"
        corpus.mkdir()
        write_corpus(corpus, docs)
        cfg = _config(corpus)
        local_s, local = _local(cfg, work)
        n = len(local.removed)
        dedup = cfg.deduplication
        bands, rows = bands_rows(dedup)
        cases, two_s = [], None
        if ray is not None:
            ray_engine.init_local(ray, 2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
            try:
                _ray(cfg, Session(ray, 2, "local", 1.0))  # warm-up: starts the workers
                two_s, two = _ray(cfg, Session(ray, 2, "local", 1.0))
                one_s, one = _ray(cfg, Session(ray, 1, "local", 2.0))
            finally:
                ray.shutdown()
            assert np.array_equal(local.removed, two.removed) and np.array_equal(local.removed, one.removed)
            cases += [
                {"case": "ray_engine_docs_per_s", "value": n / two_s, "reference": n / local_s,
                 "ratio": local_s / two_s, "goal": "report",
                 "unit": "documents/s, prepare pass 1, Ray 2 CPUs (ref: local engine, 2 processes)",
                 "detail": {"documents": n, "removed": int(local.removed.sum()), "seconds_local": local_s,
                            "seconds_ray_2": two_s, "seconds_ray_1": one_s}},
                {"case": "ray_engine_2_cpus_vs_1", "value": one_s / two_s, "reference": 1.7,
                 "ratio": one_s / two_s / 1.7, "goal": ">= 1.7",
                 "unit": "speed-up of pass 1 from 1 Ray worker to 2 (same 2-CPU cluster)"},
            ]
        # The LSH stage on its own: signatures of the corpus's documents from the local engine's code.
        from lit_pretrain.data.preparation.corpus import read_documents
        from lit_pretrain.data.preparation.minhash import compute_signatures, normalize

        texts = [normalize(d.text, dedup.lowercase, dedup.fold_whitespace) for d in read_documents(cfg)]
        signatures, _ = compute_signatures(texts, dedup.shingle, dedup.shingle_size, dedup.num_perm, dedup.seed, 2,
                                           progress=False)
        lsh = _redis_vs_memory(DeduplicationConfig(processes=2), signatures)
        if lsh is not None:
            cases.append({"case": "redis_lsh_vs_memory", "value": lsh["redis"] / lsh["memory"], "reference": 3.0,
                          "ratio": lsh["redis"] / lsh["memory"] / 3.0, "goal": "<= 3 (lower is better)",
                          "unit": "LSH stage seconds, datasketch's index in Redis / in memory (storage=memory is "
                          "now numpy banding: detail.banding)", "detail": lsh})
        if two_s is not None and not _datatrove_missing():
            trove = _datatrove(corpus, Path(tempfile.mkdtemp(dir=work)), bands, rows, dedup.seed)
            cases.append({"case": "ray_engine_vs_datatrove_docs_per_s", "value": n / two_s,
                          "reference": n / trove["seconds"], "ratio": trove["seconds"] / two_s, "goal": "report",
                          "unit": "documents/s, MinHash deduplication of ~1 kB documents, Ray 2 CPUs (ref: "
                          "datatrove, same shingles, bands, rows, 2 workers)",
                          "detail": {"removed_overlap": _overlap(_removed_lines(local, cfg), trove["removed"]),
                                     "bands": bands, "rows": rows}})
        cases.append(_versus_datatrove(work, repeats))
        return cases
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _versus_datatrove(work: Path, repeats: int) -> Dict:
    """Pass 1 of prepare on the local engine (2 processes) against datatrove's four MinHash stages (2 workers), both
    from the same jsonl files of SHORT_DOCS short documents, alternated `repeats` times; a case saying why when
    datatrove cannot run here."""
    from lit_pretrain.data.preparation.lsh import bands_rows

    case, goal = "local_engine_vs_datatrove_docs_per_s", ">= 1.5"
    unit = (f"documents/s, MinHash deduplication of {SHORT_DOCS} documents of {SHORT_WORDS} words (ref: datatrove, "
            "same shingles, bands, rows, 2 workers)")
    missing = _datatrove_missing()
    if missing:
        nan = float("nan")
        return {"case": case, "value": nan, "reference": nan, "ratio": nan, "goal": goal, "unit": unit,
                "skipped": missing}
    corpus = work / "short"
    corpus.mkdir()
    write_corpus(corpus, SHORT_DOCS, words=SHORT_WORDS)
    cfg = _config(corpus)
    bands, rows = bands_rows(cfg.deduplication)
    removed: Dict[str, set] = {}

    def ours() -> float:
        seconds, decided = _local(cfg, work)
        removed.setdefault("ours", _removed_lines(decided, cfg))
        return SHORT_DOCS / seconds

    def theirs() -> float:
        trove = _datatrove(corpus, Path(tempfile.mkdtemp(dir=work)), bands, rows, cfg.deduplication.seed)
        removed.setdefault("datatrove", trove["removed"])
        return SHORT_DOCS / trove["seconds"]

    refs, cands = alternate(theirs, ours, repeats)
    return series(case, refs, cands, goal, unit, ("datatrove", "ours"),
                  {"removed_overlap": _overlap(removed["ours"], removed["datatrove"]), "bands": bands, "rows": rows})


def run(repeats: int = 5) -> List[Dict]:
    """The cases, in a fresh process (as prepare runs), away from the torch that the bench has imported
    (bench/child.py). `repeats`: alternations of the comparison with datatrove (5 by default, the issue's
    minimum, ~50 s in all; the engines' own cases are single runs)."""
    return child.run("lit_pretrain.bench.data.data_engines", str(_DOCS), str(repeats))


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]) if len(sys.argv) > 1 else _DOCS,
                             int(sys.argv[2]) if len(sys.argv) > 2 else 5)))
