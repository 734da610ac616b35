"""Case: tokens/s the mixture sampler (data/mixture.py) orders against tokens/s the training step consumes.

The sampler alone, without shards: three sources of a realistic spread of sizes and a schedule switch inside the
timed stretch, one rank's indices of whole epochs (the interleave, the per-source permutations, the rank's stride).
Reading the windows is the datamodule case's figure; this one shows the order itself costs nothing next to a step.
"""

import time
from typing import Dict

from lit_pretrain.bench import stats
from lit_pretrain.data.mixture import MixtureOrder, MixtureSampler

# Windows per source (~1.3 billion tokens of 1024-token windows in all) and the weights before and after a switch.
SIZES = (1_000_000, 250_000, 30_000)
WEIGHTS = ((0.6, 0.3, 0.1), (0.3, 0.4, 0.3))
EPOCHS = 2


def sampler_tokens_per_s(seq_len: int, micro_batch_size: int, seed: int) -> float:
    per_step = micro_batch_size * 8  # a global batch of 8 ranks' micro-batches: the order does not depend on it
    switch = sum(SIZES) // per_step // 2  # mid-way through the first epoch
    order = MixtureOrder(["web", "code", "books"], SIZES, [(0, WEIGHTS[0]), (switch, WEIGHTS[1])], per_step, seed)
    sampler = MixtureSampler(order, micro_batch_size, rank=0, world_size=1)
    start = time.perf_counter()
    slots = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        slots += len(list(sampler))
    return slots * seq_len / (time.perf_counter() - start)


def run(c, consumed_tokens_per_s: float, repeats: int) -> Dict:
    """`repeats` timings of the sampler against the step's tokens/s: their median and spread (bench/stats.py)."""
    values = [sampler_tokens_per_s(c.model.seq_len, c.trainer.micro_batch_size, c.run.seed) for _ in range(repeats)]
    return {"case": "mixture_sampler_tokens_per_s", **stats.single(values, lambda v: v / consumed_tokens_per_s),
            "reference": consumed_tokens_per_s, "goal": ">= 50", "unit": "tokens/s",
            "detail": {"source_windows": list(SIZES), "weights": [list(w) for w in WEIGHTS], "epochs": EPOCHS,
                       "reference": "trainer tokens/s of the step case"}}
