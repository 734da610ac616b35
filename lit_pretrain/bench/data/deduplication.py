"""Cases: MinHash signature throughput against bare datasketch, speed-up from 1 to 2 processes, the LSH stage
against datasketch's MinHashLSH, memory per 100k documents.

Throughput runs on the first THROUGHPUT_MB of the standard library's source, normalized as the stage does. The
reference is datasketch's own `MinHash.bulk` over the same shingle sets with the same num_perm and seed, shingling
included on both sides, so the ratio measures our numpy MinHash, chunking and packing against the library's.
The speed-up is documents/s of `compute_signatures` at 2 processes over 1, on SCALE_DOCS generated documents: enough
work (seconds) that a worker's start-up is amortised, as in a real prepare (goal: 2 processes >= 1.8x one).
The LSH stage (insert every signature, query every one, sorted pairs) is datasketch's in-memory MinHashLSH against
our numpy banding (lsh.band_pairs, what storage=memory runs) on the short documents of data_engines' comparison with
datatrove, where per-document Python dominates (goal: >= 10x); both must give the same pairs.
Memory is the peak resident-set growth of a fresh worker process that runs the near-duplicate stage (signatures,
candidate pairs, clusters) on synthetic 1 kB documents, against a process that does the same with datasketch's
objects as its own examples show (a list of `MinHash.bulk` results inserted into `MinHashLSH`).

The timings run in a fresh process away from torch and Lightning (bench/child.py).
"""

import json
import random
import resource
import string
import sys
import time
from dataclasses import asdict, replace
from typing import Dict, List

import numpy as np
from datasketch import MinHash, MinHashLSH

from lit_pretrain.bench import child, stats
from lit_pretrain.bench.child import series
from lit_pretrain.bench.data.data_engines import SHORT_DOCS, SHORT_WORDS, near_duplicate_texts
from lit_pretrain.bench.stats import alternate
from lit_pretrain.data.preparation.corpus import iter_documents
from lit_pretrain.data.preparation.lsh import (
    band_pairs,
    bands_rows,
    candidate_pairs,
    clusters,
    index_basename,
    minhashlsh_pairs,
)
from lit_pretrain.data.preparation.minhash import compute_signatures, estimated_jaccard, normalize, shingles
from lit_pretrain.data.preparation.workers import WorkerPool
from lit_pretrain.schema import DataConfig, DeduplicationConfig

THROUGHPUT_MB = 3
# ~350 bytes each (50 words): 35 MB, ~3.5 s on one process, against ~0.1 s to start a worker.
SCALE_DOCS, SCALE_WORDS = 100_000, 50
_MEMORY_DOCS = 20_000
# The bench's own processes run in the stage's worker pool (lit_pretrain/data/preparation/workers.py): one that cannot
# start or dies stops the bench with one line instead of leaving it waiting.
_FIX = "check that `lit-pretrain prepare` with data.deduplication.processes=2 runs on this machine"


def _texts(cfg: DeduplicationConfig) -> List[str]:
    """The first THROUGHPUT_MB of the standard library's source, normalized."""
    out, size = [], 0
    for doc in iter_documents(DataConfig(corpus="stdlib")):
        out.append(normalize(doc.text, cfg.lowercase, cfg.fold_whitespace))
        size += len(out[-1])
        if size >= THROUGHPUT_MB * 1e6:
            break
    return out


def _ours(texts, cfg, processes: int) -> float:
    start = time.perf_counter()
    compute_signatures(texts, cfg.shingle, cfg.shingle_size, cfg.num_perm, cfg.seed, processes, progress=False)
    return time.perf_counter() - start


def _worker_start(cfg) -> float:
    """Seconds to start one signature worker and have it import the signature code (an empty chunk)."""
    start = time.perf_counter()
    with WorkerPool("lit_pretrain.data.preparation.minhash:chunk_signatures", 1, "bench signature", _FIX) as pool:
        pool.submit(0, ([], cfg.shingle, cfg.shingle_size, cfg.num_perm, cfg.seed), "(an empty chunk)")
        list(pool.drain())
    return time.perf_counter() - start


def _spin(n: int) -> float:
    start = time.perf_counter()
    total = 0
    for i in range(n):
        total += i
    return time.perf_counter() - start


def _machine_speedup(n: int = 3_000_000) -> float:
    """What 2 processes gain over 1 on this machine right now, for a pure CPU loop with no start-up or data: the
    ceiling for any 2-process speed-up measured alongside it (on a shared machine it can be far below 2)."""
    serial = _spin(n) + _spin(n)
    with WorkerPool("lit_pretrain.bench.data.deduplication:_spin", 2, "bench CPU loop", _FIX) as pool:
        for loops in (1, n):  # the first round starts the workers before the clock
            start = time.perf_counter()
            for worker in range(2):  # one task each: submit picks the least loaded worker
                pool.submit(worker, loops, f"(a loop of {loops})")
            list(pool.drain())
            parallel = time.perf_counter() - start
    return serial / parallel


def _bare(texts, cfg) -> float:
    start = time.perf_counter()
    MinHash.bulk([list(shingles(t, cfg.shingle, cfg.shingle_size)) for t in texts], num_perm=cfg.num_perm,
                 seed=cfg.seed)
    return time.perf_counter() - start


def _synthetic(n: int, seed: int = 0) -> List[str]:
    rng = random.Random(seed)
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9))) for _ in range(20_000)]
    return [" ".join(rng.choices(vocab, k=160)) for _ in range(n)]  # ~1 kB each


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_rss_mb() -> float:
    # VmHWM, this address space's high-water mark: unlike getrusage's ru_maxrss it is not carried over from the
    # parent across the fork + exec that starts a worker, which would report the parent's size instead of the child's.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status: the memory case needs Linux")


def _memory_child(task) -> float:
    kind, n, cfg = task
    texts = _synthetic(n)
    before = _rss_mb()
    bands, rows = bands_rows(cfg)
    if kind == "ours":
        sig, _ = compute_signatures(texts, cfg.shingle, cfg.shingle_size, cfg.num_perm, cfg.seed, 1, progress=False)
        left, right, _ = candidate_pairs(sig, cfg, bands, rows, index_basename(cfg))
        keep = estimated_jaccard(sig, left, right) >= cfg.threshold
        clusters(len(texts), left[keep], right[keep])
    else:
        sketches = MinHash.bulk([list(shingles(t, cfg.shingle, cfg.shingle_size)) for t in texts],
                                num_perm=cfg.num_perm, seed=cfg.seed)
        lsh = MinHashLSH(num_perm=cfg.num_perm, params=(bands, rows))
        for i, m in enumerate(sketches):
            lsh.insert(i, m)
        pairs = {(i, j) for i, m in enumerate(sketches) for j in lsh.query(m) if j > i}
        [sketches[i].jaccard(sketches[j]) >= cfg.threshold for i, j in pairs]
    return max(0.0, _peak_rss_mb() - before)


def _peak_mb(kind: str, n: int, cfg: DeduplicationConfig) -> float:
    """_memory_child's figure, measured in a fresh worker process (one pool per measurement)."""
    with WorkerPool("lit_pretrain.bench.data.deduplication:_memory_child", 1, "bench memory", _FIX) as pool:
        pool.submit(kind, (kind, n, cfg), f"(the {kind} memory case)")
        ((_, value),) = pool.drain()
    return value


def run(cfg: DeduplicationConfig, repeats: int = 2) -> List[Dict]:
    """The cases, measured in a fresh process (bench/child.py: memory and timings as `lit-pretrain prepare` sees
    them)."""
    return child.run("lit_pretrain.bench.data.deduplication", json.dumps(asdict(cfg)), str(repeats))


def measure(cfg: DeduplicationConfig, repeats: int) -> List[Dict]:
    """The paired series (bench/child.py) and the memory case."""
    cfg = replace(cfg, storage="memory")
    out = [*_throughput(cfg, repeats), _two_processes(cfg, repeats), _lsh(cfg, repeats)]
    ours, bare_mb = _peak_mb("ours", _MEMORY_DOCS, cfg), _peak_mb("datasketch", _MEMORY_DOCS, cfg)
    scale = 100_000 / _MEMORY_DOCS
    out.append({"case": "dedup_memory_MB_per_100k_docs", "value": ours * scale, "reference": bare_mb * scale,
                "ratio": ours / bare_mb if bare_mb else float("nan"), "goal": "<= 1.0 (lower is better)",
                "unit": "MB peak RSS growth per 100k 1 kB docs (ref: MinHash objects + MinHashLSH)",
                "detail": {"documents_measured": _MEMORY_DOCS,
                           "signature_MB_per_100k": 100_000 * cfg.num_perm * np.dtype(np.uint32).itemsize / 2**20}})
    return out


def _throughput(cfg: DeduplicationConfig, repeats: int) -> List[Dict]:
    texts = _texts(cfg)
    n, mb = len(texts), sum(len(t.encode("utf-8")) for t in texts) / 1e6
    bare, ours = alternate(lambda: _bare(texts, cfg), lambda: _ours(texts, cfg, 1), repeats)
    detail = {"documents": n, "MB": round(mb, 2), "num_perm": cfg.num_perm,
              "shingles": f"{cfg.shingle_size}-{cfg.shingle}"}
    names = ("MinHash.bulk", "ours")
    return [series("dedup_signatures_docs_per_s", [n / s for s in bare], [n / s for s in ours], ">= 0.9",
                   "documents/s, 1 process (ref: MinHash.bulk)", names, detail),
            series("dedup_signatures_MB_per_s", [mb / s for s in bare], [mb / s for s in ours], ">= 0.9",
                   "MB/s, 1 process (ref: MinHash.bulk)", names, detail)]


def _two_processes(cfg: DeduplicationConfig, repeats: int) -> Dict:
    texts = near_duplicate_texts(SCALE_DOCS, words=SCALE_WORDS)
    n, mb = len(texts), sum(len(t) for t in texts) / 1e6
    machine: List[float] = []

    def one() -> float:
        machine.append(_machine_speedup())  # the ceiling right now, next to the pair it bounds
        return n / _ours(texts, cfg, 1)

    refs, cands = alternate(one, lambda: n / _ours(texts, cfg, 2), repeats)
    detail = {"documents": n, "MB": round(mb, 2),
              # What 2 processes gain for a pure CPU loop with no start-up or data: the ceiling for any 2-process
              # speed-up measured alongside it (on a shared machine it can be far below 2).
              "machine_speedups": machine,
              # A worker's start-up (a fresh interpreter importing numpy and minhash.py): this process computes
              # chunks meanwhile, but the start-up still takes CPU time from the second core.
              "seconds_worker_start": _worker_start(cfg)}
    case = series("dedup_signatures_2_processes", refs, cands, ">= 1.8", "documents/s, 2 processes (ref: 1 process)",
                  ("1_process", "2_processes"), detail)
    ratios = [c / r for r, c in zip(refs, cands)]
    case["detail"]["share_of_machine_speedup"] = stats.median(ratios) / stats.median(machine)
    return case


def _lsh(cfg: DeduplicationConfig, repeats: int) -> Dict:
    texts = near_duplicate_texts(SHORT_DOCS, words=SHORT_WORDS)
    signatures, _ = compute_signatures(texts, cfg.shingle, cfg.shingle_size, cfg.num_perm, cfg.seed, 1,
                                       progress=False)
    bands, rows = bands_rows(cfg)
    want, got = minhashlsh_pairs(signatures, bands, rows, cfg.seed), band_pairs(signatures, bands, rows)
    if not (np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1])):
        raise AssertionError("numpy banding and datasketch's MinHashLSH gave different candidate pairs")
    n = len(texts)

    def timed(pairs) -> float:
        start = time.perf_counter()
        pairs(signatures, bands, rows, cfg.seed)
        return n / (time.perf_counter() - start)

    refs, cands = alternate(lambda: timed(minhashlsh_pairs), lambda: timed(lambda s, b, r, _: band_pairs(s, b, r)),
                            repeats)
    return series("dedup_lsh_docs_per_s", refs, cands, ">= 10",
                  "documents/s, LSH candidate pairs (ref: datasketch MinHashLSH in memory)",
                  ("MinHashLSH", "band_pairs"),
                  {"documents": n, "words": SHORT_WORDS, "bands": bands, "rows": rows, "pairs": int(len(got[0]))})


if __name__ == "__main__":
    print(json.dumps(measure(DeduplicationConfig(**json.loads(sys.argv[1])), int(sys.argv[2]))))
