"""Case: prepare's peak memory on a generated JSON Lines corpus of two sizes (20 MB and 200 MB by default): the
larger's peak RSS over the smaller's. Streaming keeps it near 1 (goal <= 1.2): the corpus is never held.

Each size is prepared by a child process (`prepare` in a fresh interpreter, one tokenize process) that reports
its own peak RSS: VmHWM of /proc/self/status, not getrusage's ru_maxrss, which on Linux keeps the high-water mark
of the forked copy of this (large) bench process across exec and read ~830 MB for every size.
Near-duplicate search is off: its LSH index is the one structure that is meant to grow with the corpus (in memory
or in Redis, data.deduplication.storage); exact hashes, sizes and split bits (~200 bytes a document) still grow,
which is why documents are ~8 kB. LIT_PRETRAIN_BENCH_PREPARE_MB="20,100" picks other sizes.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

SIZES_MB = (20, 200)
DOC_WORDS = 1400  # ~8 kB a document
_CHILD = """
import json, sys
from lit_pretrain.data.preparation.prepare import prepare
from lit_pretrain.schema import DataConfig, DeduplicationConfig
corpus, out = sys.argv[1], sys.argv[2]
cfg = DataConfig(corpus="jsonl", paths=[corpus], prepared_dir=out, vocab_size=1024, tokenizer_train_bytes=4_000_000,
                 deduplication=DeduplicationConfig(near=False))
manifest = prepare(cfg, log=lambda *_: None)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"peak_kb": int(status["VmHWM"].split()[0]), "documents": manifest["corpus"]["documents"],
                  "tokens": manifest["splits"]["train"]["tokens"] + manifest["splits"]["val"]["tokens"]}))
"""


def sizes_mb() -> List[int]:
    text = os.environ.get("LIT_PRETRAIN_BENCH_PREPARE_MB", "")
    return [int(x) for x in text.split(",")] if text else list(SIZES_MB)


def write_corpus(path: Path, megabytes: int, seed: int = 0) -> int:
    """A JSON Lines file of about `megabytes` MB of distinct random-word documents; returns its size in bytes."""
    rng = np.random.default_rng(seed)
    words = np.array([f"w{i}" for i in range(20_000)])
    target = megabytes * 1_000_000
    written = 0
    with open(path, "w") as f:
        while written < target:
            lines = [json.dumps({"text": " ".join(words[rng.integers(0, len(words), DOC_WORDS)])}) + "\n"
                     for _ in range(64)]
            block = "".join(lines)
            f.write(block)
            written += len(block)
    return written


def _measure(corpus: Path, out: Path) -> Dict:
    start = time.perf_counter()
    # The child imports this copy of lit_pretrain, whatever the current folder.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[3]),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(corpus), str(out)], capture_output=True, text=True,
                          check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"prepare of {corpus} failed: {done.stderr.strip().splitlines()[-1:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def run(tmp: Path) -> Dict:
    small, large = sizes_mb()
    measured = {}
    for mb in (small, large):
        corpus = tmp / f"corpus-{mb}mb.jsonl"
        size = write_corpus(corpus, mb)
        measured[mb] = {**_measure(corpus, tmp / f"prepared-{mb}mb"), "bytes": size}
        corpus.unlink()
    peak = {mb: m["peak_kb"] / 1024 for mb, m in measured.items()}
    return {"case": f"prepare_peak_rss_{large}mb_vs_{small}mb", "value": peak[large], "reference": peak[small],
            "ratio": peak[large] / peak[small], "goal": "<= 1.2", "unit": "MB", "detail": measured}
