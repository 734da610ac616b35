"""Cases: the TokenShardDataModule over a Megatron .bin/.idx trained on in place (data/pretokenized.py).

datamodule_megatron_tokens_per_s: the datamodule case (bench/data/datamodule.py) on the experiment's sample exported by
  export-data --to megatron: tokens/s the train loader delivers against tokens/s the step consumes.
megatron_bytes_read_per_token: bytes the process fetched from storage (/proc/self/io read_bytes, which counts page
  faults of a memmap too) per training token, over TIMED_BATCHES batches of a Megatron corpus of CORPUS_TOKENS random
  ids dropped from the page cache after setup (fsync + POSIX_FADV_DONTNEED; the vocabulary scan at setup is a
  sequential read and is not counted). The reference is the id width: "the tokens, nothing more". The detail
  holds the floor that page-granular reads allow: the distinct 4 KiB pages the read windows touch, per token.
  The corpus is larger than what is read, so no page is read twice: what a corpus far larger than memory costs.
megatron_restart_setup_bytes: bytes a start reads from storage before its first batch (open_corpus: the checks,
  the fingerprint, the index) when data.check_cache_dir holds the record of the first start (data/check_record.py),
  against what the first start read (the whole corpus: the vocabulary scan), the same corpus dropped from the page
  cache before each. Goal: what the fingerprint reads (its first and last MiB and the index), not the corpus.
"""

import dataclasses
import mmap
import os
import time
from pathlib import Path
from typing import Dict, List

import numpy as np

from lit_pretrain.bench import stats
from lit_pretrain.bench.data import datamodule as dm_case
from lit_pretrain.data import pretokenized
from lit_pretrain.data.datamodule import TokenShardDataModule
from lit_pretrain.data.export import export_data, write_megatron_index

CORPUS_TOKENS = 1 << 25  # 64 MiB of uint16 ids: about 40x what TIMED_BATCHES of the default experiment read
PAGE = mmap.PAGESIZE


def megatron_sample(sample_data, folder: Path):
    """The prepared sample exported to `folder` as Megatron files, and a data config that trains on them."""
    export_data(sample_data.prepared_dir, folder, "megatron")
    return dataclasses.replace(sample_data, corpus="megatron", paths=[str(folder / "train")],
                               val_paths=[str(folder / "val")], tokenizer_path=str(folder / "tokenizer.json"))


def synthetic_megatron(data, folder: Path, vocab_size: int, eod: int, tokens: int = CORPUS_TOKENS):
    """`tokens` random ids in documents of 1,000 tokens ending in the EOD id, as one Megatron pair."""
    folder.mkdir(parents=True, exist_ok=True)
    ids = np.random.default_rng(0).integers(0, vocab_size, tokens, dtype=np.uint16)
    ids[999::1000] = eod
    ids.tofile(folder / "big.bin")
    lengths = np.full(tokens // 1000, 1000, dtype=np.int64)
    lengths = np.append(lengths, tokens - lengths.sum()) if tokens % 1000 else lengths
    write_megatron_index(folder / "big.idx", np.dtype(np.uint16), lengths)
    return dataclasses.replace(data, paths=[str(folder / "big")], val_paths=[])


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def drop_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped: a file just written must reach the disk first
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bytes_per_token(data, seq_len: int, micro_batch_size: int, seed: int,
                    batches: int = dm_case.TIMED_BATCHES) -> Dict:
    """Cold-cache bytes read per training token over `batches` batches, and the page floor (module docstring)."""
    dm = TokenShardDataModule(dataclasses.replace(data, num_workers=0), seq_len=seq_len,
                              micro_batch_size=micro_batch_size, seed=seed, val_windows=micro_batch_size)
    dm.setup("fit")
    loader = dm.train_dataloader()
    shard = dm.manifest["splits"]["train"]["shards"][0]
    itemsize = np.dtype(shard["dtype"]).itemsize
    drop_from_page_cache(shard["file"])
    it, before, start = iter(loader), read_bytes(), time.perf_counter()
    for _ in range(batches):
        x, _ = next(it)
    seconds, fetched = time.perf_counter() - start, read_bytes() - before
    tokens = batches * x.numel()
    windows = np.asarray(loader.sampler.global_order(0)[: batches * micro_batch_size], dtype=np.int64)
    first = shard["offset"] + windows * seq_len * itemsize  # byte range of each window of seq_len + 1 ids
    last = first + (seq_len + 1) * itemsize - 1
    pages = np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first // PAGE, last // PAGE)]))
    return {"bytes_per_token": fetched / tokens, "itemsize": itemsize, "page_floor_bytes_per_token":
            len(pages) * PAGE / tokens, "read_seconds": seconds, "tokens": tokens}


def setup_reads(data, records: Path) -> Dict:
    """Bytes read and seconds of open_corpus at a first start and at the next (a new process: nothing cached in
    memory, the files dropped from the page cache), the checks recorded under `records`."""
    data = dataclasses.replace(data, check_cache_dir=str(records))
    files = [f"{p}.{ext}" for p in data.paths for ext in ("bin", "idx")]
    out = {}
    for start in ("first_start", "restart"):
        pretokenized._OPENED.clear()
        for f in files:
            drop_from_page_cache(f)
        before, t = read_bytes(), time.perf_counter()
        pretokenized.open_corpus(data, log=lambda _: None)
        out[start] = {"bytes": read_bytes() - before, "seconds": time.perf_counter() - t}
    out["corpus_bytes"] = sum(os.path.getsize(f) for f in files)
    return out


def run(c, sample_data, consumed_tokens_per_s: float, repeats: int, tmp: Path) -> List[Dict]:
    data = megatron_sample(sample_data, tmp / "megatron")
    delivered = {f"num_workers_{n}": [] for n in dm_case.WORKER_SETTINGS}
    for _ in range(repeats):
        for n in dm_case.WORKER_SETTINGS:
            delivered[f"num_workers_{n}"].append(dm_case.delivered_tokens_per_s(
                data, c.model.seq_len, c.trainer.micro_batch_size, c.run.seed, n))
    key = f"num_workers_{c.data.num_workers}"
    values = delivered[key] if key in delivered else max(delivered.values(), key=stats.median)
    tokens_case = {"case": "datamodule_megatron_tokens_per_s",
                   **stats.single(values, lambda v: v / consumed_tokens_per_s), "reference": consumed_tokens_per_s,
                   "goal": ">= 50", "unit": "tokens/s",
                   "detail": {**delivered, "data.num_workers": c.data.num_workers,
                              "reference": "trainer tokens/s of the step case"}}
    manifest = TokenShardDataModule(data, seq_len=c.model.seq_len, micro_batch_size=1, seed=0, val_windows=1).manifest
    big = synthetic_megatron(data, tmp / "megatron-big", manifest["tokenizer"]["vocab_size"],
                             manifest["tokenizer"]["eod_id"])
    reads = [bytes_per_token(big, c.model.seq_len, c.trainer.micro_batch_size, c.run.seed + r) for r in range(repeats)]
    itemsize = reads[0]["itemsize"]
    bytes_case = {"case": "megatron_bytes_read_per_token",
                  **stats.single([r["bytes_per_token"] for r in reads], lambda v: v / itemsize),
                  "reference": float(itemsize), "goal": "1 (the ids only)", "unit": "bytes/token",
                  "detail": {"runs": reads, "corpus_tokens": CORPUS_TOKENS, "page_bytes": PAGE,
                             "seq_len": c.model.seq_len, "micro_batch_size": c.trainer.micro_batch_size}}
    setups = [setup_reads(big, tmp / f"check-records-{r}") for r in range(repeats)]
    restart_case = {"case": "megatron_restart_setup_bytes",
                    **stats.single([r["restart"]["bytes"] / r["first_start"]["bytes"] for r in setups], lambda v: v),
                    "reference": "bytes the first start read", "goal": "the fingerprint's (2 MiB + the .idx)",
                    "unit": "ratio", "detail": {"runs": setups, "corpus_tokens": CORPUS_TOKENS}}
    return [tokens_case, bytes_case, restart_case]
