"""data.shuffle=feistel (data/permutation.py): a permutation on every n tried, seeded, the same global batches on any
number of ranks and after a resume, blocks read in a row as data.shuffle_block_tokens says, and memory that the
corpus size does not change (order_bytes, the formula docs/data.md quotes at 10^9 and 10^12 windows)."""

import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
import torch

from lit_pretrain import config
from lit_pretrain.data.datamodule import GlobalOrderSampler, TokenShardDataModule
from lit_pretrain.data.permutation import CHUNK, FeistelPermutation, order_bytes
from lit_pretrain.errors import ConfigError
from tests.conftest import EXPERIMENTS, tiny_data_overrides


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 255, 256, 1000, 4097])
def test_feistel_is_a_permutation_of_every_n(n):
    for seed in (0, 1):
        image = FeistelPermutation(n, seed)(np.arange(n))
        assert sorted(image.tolist()) == list(range(n))  # exhaustive: each index once, none outside [0, n)
    a, b = FeistelPermutation(n, 0)(np.arange(n)), FeistelPermutation(n, 1)(np.arange(n))
    if n >= 7:  # 2 of n! orders agree by chance with probability 1/n!
        assert not np.array_equal(a, b)
    assert np.array_equal(a, FeistelPermutation(n, 0)(np.arange(n)))


def test_feistel_on_a_trillion_is_one_to_one_and_spread():
    n = 10**12
    image = FeistelPermutation(n, 5)(np.arange(CHUNK))
    assert len(set(image.tolist())) == CHUNK and image.min() >= 0 and image.max() < n
    # Spread: the first CHUNK positions land all over [0, n), not near the start (mean n/2, standard error
    # n / sqrt(12 · CHUNK) = 0.23% of n; 2% is 9 standard errors).
    assert abs(image.mean() / n - 0.5) < 0.02


def test_computed_order_is_one_global_order_on_any_number_of_ranks():
    n, seed = 1000, 9
    single = GlobalOrderSampler(n, 8, 0, 1, seed, samples_per_step=16, shuffle="feistel")
    order = list(single)
    assert len(order) == 992 and len(set(order)) == 992  # 62 whole steps of 16
    assert order == FeistelPermutation(n, _epoch_seed(seed, 0))(np.arange(992)).tolist()
    for world in (2, 4):
        ranks = [GlobalOrderSampler(n, 8 // world, r, world, seed, samples_per_step=16, shuffle="feistel")
                 for r in range(world)]
        per_rank = [list(s) for s in ranks]
        for r in range(world):
            assert per_rank[r] == order[r::world]
    single.set_epoch(1)
    assert list(single) != order
    # Iteration crosses chunks of CHUNK positions the same way as one call does.
    big = GlobalOrderSampler(3 * CHUNK + 5, 1, 1, 2, seed, shuffle="feistel")
    assert list(big) == big.windows_at(0, np.arange(1, big.samples_per_epoch, 2)).tolist()


def _epoch_seed(seed, epoch):
    from lit_pretrain.data.datamodule import epoch_seed

    return epoch_seed(seed, epoch)


@pytest.fixture(scope="module")
def data(tiny_data_dir):
    cfg = config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", tiny_data_overrides(tiny_data_dir)))
    return replace(cfg.data, shuffle="feistel")


def make_dm(data, micro_batch_size=8, rank=None, world_size=None, seq_len=32):
    dm = TokenShardDataModule(data, seq_len=seq_len, micro_batch_size=micro_batch_size, seed=4, val_windows=8,
                              rank=rank, world_size=world_size)
    dm.setup()
    return dm


def test_datamodule_resumes_the_computed_order_exactly_on_another_layout(data):
    ranks = [make_dm(data, micro_batch_size=4, rank=r, world_size=2) for r in range(2)]
    loaders = [iter(dm.train_dataloader()) for dm in ranks]
    for _ in range(3):
        for dm, it in zip(ranks, loaders):
            x, _ = next(it)
            indices = dm.train_loader.take_trained_indices()
            assert torch.equal(x, torch.stack([dm.train_dataset[i][0] for i in indices]))  # the loader names them
    state = ranks[0].train_loader.state_dict()
    resumed = make_dm(data)
    loader = resumed.train_dataloader()
    loader.load_state_dict(state)
    x, _ = next(iter(loader))
    reference = make_dm(data).train_dataloader().sampler.windows_at(0, np.arange(24, 32))  # 3 steps of 8 trained
    assert resumed.train_loader.take_trained_indices() == reference.tolist()
    assert torch.equal(x, torch.stack([resumed.train_dataset[i][0] for i in reference.tolist()]))


def test_blocks_are_read_in_a_row_from_a_computed_block_order(data):
    block = 128
    dm = make_dm(replace(data, shuffle_block_tokens=block))
    table, rows = dm.train_dataset.block_table(block), dm.train_dataset.block_windows(block)
    assert len(table) == len(rows)
    ids = np.arange(len(rows))
    for i in range(rows.shape[1]):  # the rule gives block_windows' table, every block, every window
        assert table.windows(ids, np.full(len(ids), i)).tolist() == rows[:, i].tolist()
    sampler = dm.train_dataloader().sampler
    order = sampler.global_order(0)
    k = block // 32
    first = order[:k].tolist()
    assert first == list(range(first[0], first[0] + k)) and first in rows.tolist()


def test_memory_does_not_grow_with_the_corpus():
    peaks = {}
    for n in (10**4, 10**9, 10**12):
        sampler = GlobalOrderSampler(n, 8, 1, 2, 0, shuffle="feistel")
        tracemalloc.start()
        it = iter(sampler)
        next(it)  # the first chunk of positions is computed
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peaks[n] <= order_bytes(n, "feistel")
    assert order_bytes(10**12, "feistel") == order_bytes(10**4, "feistel") < 2**21
    # stored: the permutation tensor (8 bytes a window; torch's allocations are not traced, so read off the tensor)
    # and this rank's windows as a list of Python ints, traced: together the formula within 10% (CPython ints
    # below 2^30 request 28 bytes, counted by the formula as the 32 the allocator gives them).
    n = 200_000
    sampler = GlobalOrderSampler(n, 8, 1, 2, 0)
    assert sampler.global_order(0).nbytes == 8 * n
    tracemalloc.start()
    it = iter(sampler)
    listed = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del it
    assert 0.9 * (order_bytes(n, "stored", 2) - 16 * n) <= listed <= order_bytes(n, "stored", 2) - 16 * n
    assert order_bytes(10**9, "stored") == 56 * 10**9  # 56 GB: what data.shuffle=feistel avoids


def test_feistel_with_a_mixture_is_refused_at_load(tiny_data_dir):
    with pytest.raises(ConfigError, match="data.shuffle=feistel"):
        config.load(EXPERIMENTS / "runs" / "tiny.yaml", [
            *tiny_data_overrides(tiny_data_dir), "data.shuffle=feistel",
            f"data.sources=[{{name: a, prepared_dir: '{tiny_data_dir}'}}]"], check_inputs=False)
