"""Case: tokens/s the TokenShardDataModule delivers against tokens/s the training step consumes.

The delivered rate is this rank's train DataLoader iterated with no training (memmapped shards → windows →
batches, through our sampler and loader), on a sample of the experiment's corpus prepared into a temporary folder
with the experiment's tokenizer size; the consumed rate is our Trainer's tokens/s from the step case of the same
run. A ratio of 50 means loading takes 2% of the step's time in the training process.

Both `data.num_workers` settings are measured: worker processes hide loading behind the step, but on a machine
with as many cores as training threads they take time slices from the step itself, and each batch pays a pickle
and a queue hop. The detail records both, so the default (data.num_workers) is chosen by measurement.
"""

import dataclasses
import time
from pathlib import Path
from typing import Dict

from lit_pretrain.bench import stats
from lit_pretrain.data.datamodule import TokenShardDataModule
from lit_pretrain.data.preparation.prepare import prepare

SAMPLE_DOCUMENTS = 1000  # ~10 MB of the stdlib corpus: ~2-3M tokens, thousands of windows, prepared in seconds
TIMED_BATCHES = 300
WORKER_SETTINGS = (0, 2)


def prepare_sample(data, folder: Path):
    """The experiment's data config on its first SAMPLE_DOCUMENTS documents, prepared into `folder`."""
    # One deduplication process: preparing the sample is set-up, not a measured figure, and spawning costs seconds.
    dedup = dataclasses.replace(data.deduplication, processes=1)
    sample = dataclasses.replace(data, prepared_dir=str(folder), max_documents=SAMPLE_DOCUMENTS, deduplication=dedup)
    prepare(sample, log=lambda *_: None)
    return sample


def delivered_tokens_per_s(data, seq_len: int, micro_batch_size: int, seed: int, num_workers: int) -> float:
    """Tokens/s of the train loader over TIMED_BATCHES batches (the first batch, which starts workers, untimed)."""
    dm = TokenShardDataModule(dataclasses.replace(data, num_workers=num_workers), seq_len=seq_len,
                              micro_batch_size=micro_batch_size, seed=seed, val_windows=1)
    dm.setup("fit")
    loader = dm.train_dataloader()
    if len(loader) <= TIMED_BATCHES:
        raise ValueError(f"the sample has {len(loader)} batches, fewer than the {TIMED_BATCHES + 1} timed here")
    batches = iter(loader)
    next(batches)
    start = time.perf_counter()
    for _ in range(TIMED_BATCHES):
        x, _ = next(batches)
    seconds = time.perf_counter() - start
    del batches  # stops the workers
    return TIMED_BATCHES * x.numel() / seconds


def run(c, sample_data, consumed_tokens_per_s: float, repeats: int) -> Dict:
    """Both worker settings in turn, `repeats` times; the case is the experiment's setting (the faster one when
    it is neither): median and spread against the step's tokens/s (bench/stats.py)."""
    delivered = {f"num_workers_{n}": [] for n in WORKER_SETTINGS}
    for _ in range(repeats):
        for n in WORKER_SETTINGS:
            delivered[f"num_workers_{n}"].append(delivered_tokens_per_s(
                sample_data, c.model.seq_len, c.trainer.micro_batch_size, c.run.seed, n))
    key = f"num_workers_{c.data.num_workers}"
    values = delivered[key] if key in delivered else max(delivered.values(), key=stats.median)
    return {"case": "datamodule_tokens_per_s", **stats.single(values, lambda v: v / consumed_tokens_per_s),
            "reference": consumed_tokens_per_s, "goal": ">= 50", "unit": "tokens/s",
            "detail": {**delivered, "data.num_workers": c.data.num_workers, "timed_batches": TIMED_BATCHES,
                       "reference": "trainer tokens/s of the step case"}}
