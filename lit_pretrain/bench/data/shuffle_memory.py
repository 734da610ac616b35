"""Case: the training order's peak memory at 10^9 windows against 10^6 under data.shuffle=feistel (goal <= 1.2: the
order is computed per position, data/permutation.py), with data.shuffle=stored measured beside it at 10^6 and 10^7.

Each measure is a child process (a fresh interpreter, as bench/data/prepare_memory.py measures, for the same reason:
VmHWM of /proc/self/status, not ru_maxrss) that builds what the DataModule holds for training, the train windows
(datamodule.ShardWindows over one shard), the sampler and the TrainLoader, then takes BATCHES batches; it reports its
peak RSS over its peak once torch and the package were imported. The shard is a sparse file of n windows of
model.seq_len = 16 (n·16 + 1 uint16 ids, 32 GB at 10^9 that occupy no disk: the reads return zeros), so the
measure costs seconds whatever n. 10^12 windows is order_bytes' figure, the formula tests/data/test_permutation.py
checks against measured allocations.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict

from lit_pretrain.data.permutation import order_bytes

SEQ_LEN = 16
BATCHES = 100
FEISTEL = (10**6, 10**9)
STORED = (10**6, 10**7)
_CHILD = """
import json, sys
from lit_pretrain.data.datamodule import GlobalOrderSampler, ShardWindows
from lit_pretrain.data.train_loader import TrainLoader

def peak_kb():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmHWM"].split()[0])

path, n, seq_len, shuffle, batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
base = peak_kb()
windows = ShardWindows("/", [{"file": path, "tokens": n * seq_len + 1}], "uint16", seq_len)
loader = TrainLoader(windows, GlobalOrderSampler(len(windows), 8, 0, 1, 0, shuffle=shuffle), 8)
for i, batch in enumerate(loader):
    loader.take_trained_indices()
    if i + 1 == batches:
        break
print(json.dumps({"peak_kb": peak_kb() - base, "windows": len(windows)}))
"""


def measure(tmp: Path, n: int, shuffle: str) -> Dict:
    """Peak RSS (kB over the child's imports) of the training order of n windows under `shuffle`."""
    path = tmp / f"sparse-{n}.bin"
    with open(path, "wb") as f:
        f.truncate(2 * (n * SEQ_LEN + 1))  # uint16 ids, no block written
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[3]),
                                                        os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(n), str(SEQ_LEN), shuffle, str(BATCHES)],
                              capture_output=True, text=True, check=False, env=env)
    finally:
        path.unlink()
    if done.returncode != 0:
        raise RuntimeError(f"the {shuffle} order of {n} windows failed: {done.stderr.strip().splitlines()[-1:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "seconds": round(time.perf_counter() - start, 1)}


def run(tmp: Path) -> Dict:
    feistel = {n: measure(tmp, n, "feistel") for n in FEISTEL}
    stored = {n: measure(tmp, n, "stored") for n in STORED}
    small, large = (feistel[n]["peak_kb"] / 1024 for n in FEISTEL)
    return {"case": "order_peak_rss_1e9_vs_1e6_windows", "value": large, "reference": small,
            "ratio": large / max(small, 1e-9), "goal": "<= 1.2", "unit": "MB",
            "detail": {"feistel": feistel, "stored": stored, "formula_bytes": {
                f"{shuffle}_{n:.0e}": order_bytes(n, shuffle) for shuffle in ("feistel", "stored")
                for n in (10**9, 10**12)}}}
