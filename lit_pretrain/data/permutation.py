"""A seeded permutation of [0, n) computed one index at a time (data.shuffle=feistel): the window at each position of
an epoch without a stored order, so the sampler's memory does not grow with the corpus.

A Feistel network permutes the b-bit integers, b = ceil(log2 n) (the next power of two above n - 1): each round
splits x into a high part L and a low part R and maps (L, R) to (R, L xor F(R)), which is invertible whatever F is,
so any keyed round function gives a permutation (Luby & Rackoff 1988). With b odd the two parts differ by a bit and
trade widths each round (an unbalanced Feistel network). A value at or above n walks the cycle on: apply the network
again until it lands below n (cycle-walking, Black & Rogaway 2002, "Ciphers with arbitrary finite domains",
section 3); the walk ends because the cycle through x also passes through x < n, and since 2^b < 2n it takes under
two steps on average. levanter's data/permutation.py shuffles its corpora by index in the same way.

The round function is splitmix64's finalizer (Steele et al. 2014) of R plus a round key; the keys come from the
seed by SHA-256. Six rounds: three are enough for a pseudo-random permutation in theory, four for a strong one
(Luby & Rackoff); the two more cost half again the network's time, 0.1-1.5 µs an index on a loaded 2-core CPU.
"""

import hashlib

import numpy as np

ROUNDS = 6
CHUNK = 1 << 14  # positions computed at once (the sampler's iteration, the loader's names of its batches)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(r: np.ndarray, key: np.uint64) -> np.ndarray:
    z = r + key
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class FeistelPermutation:
    """`perm(i)`: the image of each index of i (an int array, values in [0, n)) under a permutation of [0, n)
    fixed by (n, seed). Holds only the round keys."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        self.n = int(n)
        self.bits = max(0, (self.n - 1).bit_length())
        digest = hashlib.sha256(f"feistel:{seed}".encode()).digest()
        digest += hashlib.sha256(digest).digest()
        self.keys = [np.uint64(int.from_bytes(digest[8 * r:8 * r + 8], "little")) for r in range(ROUNDS)]

    def _network(self, x: np.ndarray) -> np.ndarray:
        low = self.bits // 2
        high = self.bits - low
        for key in self.keys:
            left, right = x >> np.uint64(low), x & np.uint64((1 << low) - 1)
            x = (right << np.uint64(high)) | ((left ^ _mix(right, key)) & np.uint64((1 << high) - 1))
            low, high = high, low  # the parts trade widths (unbalanced when bits is odd)
        return x

    def __call__(self, index) -> np.ndarray:
        index = np.atleast_1d(np.asarray(index))
        if index.size and (index.min() < 0 or index.max() >= self.n):
            raise IndexError(f"indices outside [0, {self.n})")
        x = self._network(index.astype(np.uint64))
        outside = np.flatnonzero(x >= self.n)
        while outside.size:  # cycle-walking
            x[outside] = self._network(x[outside])
            outside = outside[x[outside] >= self.n]
        return x.astype(np.int64)


class BlockTable:
    """Block j of the split (counted over shards in order) as its k window indices, computed: shard s has counts[s]
    blocks whose windows start at firsts[s] (ShardWindows.block_windows' rows, without holding them)."""

    def __init__(self, firsts: np.ndarray, counts: np.ndarray, k: int):
        self.firsts, self.k = firsts, k
        self.block_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.block_starts[-1])

    def windows(self, blocks: np.ndarray, within: np.ndarray) -> np.ndarray:
        """Window index of the `within`-th window of each block of `blocks`."""
        shard = np.searchsorted(self.block_starts, blocks, side="right") - 1
        return self.firsts[shard] + self.k * (blocks - self.block_starts[shard]) + within


def order_bytes(num_windows: int, shuffle: str, world_size: int = 1) -> int:
    """Bytes the training order holds for an epoch of `num_windows` windows on one rank of `world_size` (what
    tests/data/test_permutation.py checks against the allocations it measures).

    stored: the int64 permutation (8 bytes a window) that the sampler draws, the copy the loader keeps to name each
    batch's windows (8 more), and the sampler's list of this rank's windows as Python ints (an 8-byte pointer and a
    32-byte int object each: CPython's 28-byte int rounded up by its allocator). feistel: the arrays of one chunk of
    positions, whatever the corpus: the indices, the network's value and its two halves, the mixing's temporaries
    and the cycle-walk's positions, 8 arrays of CHUNK 8-byte ints, the chunk's list of ints, and the two chunks of
    windows the loader keeps to name each batch's windows (TrainLoader._computed_indices)."""
    if shuffle == "stored":
        return 16 * num_windows + 40 * (num_windows // world_size)
    return 8 * 8 * CHUNK + 40 * CHUNK + 2 * 8 * CHUNK
