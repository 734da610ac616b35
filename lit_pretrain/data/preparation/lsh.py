"""Candidate pairs by LSH banding (numpy in memory, or datasketch's MinHashLSH index in Redis) and clusters by
union-find.

Banding (Leskovec, Rajaraman & Ullman, "Mining of Massive Datasets", section 3.4.2): a signature is cut into b
bands of r rows; two documents become a candidate pair when all r rows of at least one band agree. A pair of
Jaccard similarity s agrees on one row with probability s, so it becomes a candidate with probability
1 - (1 - s^r)^b.

In memory (storage=memory), the pairs come from one sort of the signature matrix per band (`band_pairs`): exactly
the pairs of datasketch's MinHashLSH (`minhashlsh_pairs`, tests/data/test_ray_engine.py compares them), which spends
per document a Python call per band to insert and again to query; that was half the stage on many short
documents, 15-25x the banding's time. Redis keeps datasketch's layout, so any MinHashLSH attached to the
same basename reads the index. datasketch (and scipy with it) is imported only where it is used: the Ray engine's
workers import this module for `bucket_pairs`.
"""

import pickle
import re
import uuid
from typing import Dict, List, Tuple

import numpy as np

from lit_pretrain.data.preparation.minhash import SCHEME
from lit_pretrain.errors import DataError

REPORTED_SIMILARITIES = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
# Redis round trips: documents are inserted and queried this many at a time, one script call per band (below): a
# query one document at a time made the Redis index 35x slower than the in-memory one.
_REDIS_BATCH = 10_000


def candidate_probability(s: float, bands: int, rows: int) -> float:
    """Probability that a pair of Jaccard similarity s shares at least one band: 1 - (1 - s^r)^b."""
    return 1.0 - (1.0 - s**rows) ** bands


def bands_rows(cfg) -> Tuple[int, int]:
    """(b, r): the configured ones, else the optimum datasketch's MinHashLSH picks for (threshold, num_perm, weights)
    (a grid search minimizing the weighted areas of false positives and false negatives under the S-curve)."""
    if cfg.bands is not None:
        return cfg.bands, cfg.rows
    from datasketch.lsh import _optimal_param

    # The function MinHashLSH's constructor calls; called directly because the constructor demands weights that
    # sum to exactly 1.0 in floating point, which (1 - 0.9) + 0.9 does not.
    return _optimal_param(cfg.threshold, cfg.num_perm, 1.0 - cfg.false_negative_weight, cfg.false_negative_weight)


def storage_config(cfg, basename: bytes) -> Dict:
    if cfg.storage == "memory":
        return {"type": "dict"}
    return {"type": "redis", "basename": basename,
            "redis": {"host": cfg.redis_host, "port": cfg.redis_port, "db": cfg.redis_db}}


def check_redis(cfg, basename: bytes) -> None:
    """Fail early, naming the keys, when the Redis server can't be reached or the index prefix is already in use."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    where = f"{cfg.redis_host}:{cfg.redis_port} db {cfg.redis_db}"
    # One try: the client's default retries with backoff would turn a refused connection into seconds of waiting.
    client = redis.Redis(host=cfg.redis_host, port=cfg.redis_port, db=cfg.redis_db, socket_connect_timeout=2,
                         retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
        in_use = next(client.scan_iter(match=_pattern(basename), count=1000), None)
    except redis.exceptions.RedisError as err:
        raise DataError(
            f"data.deduplication.storage=redis: cannot reach Redis at {where} ({err}): start a server there, fix "
            "data.deduplication.redis_host / redis_port / redis_db, or set data.deduplication.storage=memory"
        ) from None
    finally:
        client.close()
    if in_use is not None:
        raise DataError(
            f"data.deduplication.redis_basename={basename.decode()!r} already holds keys in Redis at {where} (e.g. "
            f"{in_use!r}): an index is built from one corpus; choose another basename or delete those keys"
        )


def _pattern(basename: bytes) -> bytes:
    """A SCAN pattern matching the keys under basename (glob characters in the name escaped)."""
    return re.sub(rb"([*?\[\]\\])", rb"\\\1", basename) + b"*"


def drop_redis_index(cfg, basename: bytes) -> None:
    import redis

    client = redis.Redis(host=cfg.redis_host, port=cfg.redis_port, db=cfg.redis_db)
    try:
        keys = list(client.scan_iter(match=_pattern(basename), count=10_000))
        for start in range(0, len(keys), 10_000):
            client.delete(*keys[start : start + 10_000])
    finally:
        client.close()


def index_basename(cfg) -> bytes:
    """The index's key prefix: the configured one, else a fresh one (nothing else can be under it)."""
    return cfg.redis_basename.encode() if cfg.redis_basename else f"lit-pretrain-{uuid.uuid4().hex}".encode()


def candidate_pairs(signatures: np.ndarray, cfg, bands: int, rows: int, basename: bytes
                    ) -> Tuple[np.ndarray, np.ndarray, Dict]:
    """All pairs (i < j) of rows that share an LSH bucket, sorted, as two index arrays; and how the index was kept.
    With storage=redis, `check_redis` must have passed for `basename`.

    Every document is inserted first and queried after, so the pairs do not depend on insertion order.
    """
    if cfg.storage != "redis":
        left, right = band_pairs(signatures, bands, rows)
        return left, right, {"storage": cfg.storage}
    from datasketch import MinHashLSH

    named = bool(cfg.redis_basename)
    lsh = MinHashLSH(num_perm=signatures.shape[1], params=(bands, rows), storage_config=storage_config(cfg, basename))
    try:
        _batched_inserts(lsh, signatures)
        left, right = _batched_queries(lsh, signatures)
    finally:
        if not named:
            drop = lsh.keys._redis.register_script(_DROP)
            for table in (*lsh.hashtables, lsh.keys):
                drop(keys=[table._name])
            drop_redis_index(cfg, basename)  # anything else under the prefix (none when all went well)
    pairs_left, pairs_right = _sorted_pairs(left, right)
    where = {"storage": cfg.storage, "redis": f"{cfg.redis_host}:{cfg.redis_port}/{cfg.redis_db}",
             "basename": basename.decode(), "kept": named}
    return pairs_left, pairs_right, where


def minhashlsh_pairs(signatures: np.ndarray, bands: int, rows: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """The candidate pairs of datasketch's in-memory MinHashLSH, every row inserted, then every row queried: what
    storage=memory computed before `band_pairs`, kept as the reference the tests and the bench compare against."""
    from datasketch import LeanMinHash, MinHashLSH

    lsh = MinHashLSH(num_perm=signatures.shape[1], params=(bands, rows))
    with lsh.insertion_session(buffer_size=_REDIS_BATCH) as session:
        for i, row in enumerate(signatures):
            session.insert(i, LeanMinHash(seed=seed, hashvalues=row, scheme=SCHEME), check_duplication=False)
    left, right = [], []
    for i, row in enumerate(signatures):
        for j in lsh.query(LeanMinHash(seed=seed, hashvalues=row, scheme=SCHEME)):
            if j > i:
                left.append(i)
                right.append(j)
    return _sorted_pairs(left, right)


def _sorted_pairs(left: List[int], right: List[int]) -> Tuple[np.ndarray, np.ndarray]:
    left_arr, right_arr = np.asarray(left, dtype=np.int64), np.asarray(right, dtype=np.int64)
    order = np.lexsort((right_arr, left_arr))
    return left_arr[order], right_arr[order]


# datasketch's Redis layout, written and read a batch at a time by scripts that run inside Redis: a table (band
# bucket tables are sets, the keys table a list) is a hash KEYS[1] from each entry's name to its Redis key,
# KEYS[1] .. name, which holds the values (datasketch's RedisStorage.redis_key and _insert). One script call per
# table and batch: redis-py spends ~50 us of Python per command, and datasketch's insertion_session sends 2 per
# band and document (30 at 14 bands), which made inserts alone 10x the in-memory stage. Bucket names all have the
# same width (a band's values as bytes), so a batch's names travel as one string ARGV[1] of width ARGV[2] each.
_INSERT_SETS = """
local names, width = ARGV[1], tonumber(ARGV[2])
for i = 3, #ARGV do
  local name = string.sub(names, (i - 3) * width + 1, (i - 2) * width)
  local key = KEYS[1] .. name
  redis.call('HSET', KEYS[1], name, key)
  redis.call('SADD', key, ARGV[i])
end
return 0
"""
# The keys table: document ARGV[i] (i >= 4) -> its ARGV[3] bucket names, in band order.
_INSERT_LISTS = """
local names, width, bands = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 4, #ARGV do
  local key = KEYS[1] .. ARGV[i]
  local values = {}
  for b = 1, bands do
    local at = ((i - 4) * bands + b - 1) * width
    values[b] = string.sub(names, at + 1, at + width)
  end
  redis.call('HSET', KEYS[1], ARGV[i], key)
  redis.call('RPUSH', key, unpack(values))
end
return 0
"""
# Only buckets of 2 or more come back, each after its position among the names: most buckets hold only the row
# queried, and reading every reply element costs the client more than the server's work.
_SHARED = """
local names, width = ARGV[1], tonumber(ARGV[2])
local out = {}
for i = 1, #names / width do
  local key = KEYS[1] .. string.sub(names, (i - 1) * width + 1, i * width)
  if redis.call('SCARD', key) > 1 then
    out[#out + 1] = i
    out[#out + 1] = redis.call('SMEMBERS', key)
  end
end
return out
"""
# Deletes a table and the keys its hash names, a few thousand per DEL.
_DROP = """
local keys = redis.call('HVALS', KEYS[1])
for i = 1, #keys, 4096 do
  redis.call('DEL', unpack(keys, i, math.min(i + 4095, #keys)))
end
redis.call('DEL', KEYS[1])
return #keys
"""


def _batched_inserts(lsh, signatures: np.ndarray) -> None:
    """What `session.insert(i, signature)` does for every row inside datasketch's insertion_session (check_duplication
    off), as one script call per table and batch: the same keys and values, so any datasketch MinHashLSH attached to
    the same basename reads the index as its own."""
    client = lsh.keys._redis
    insert_sets, insert_lists = client.register_script(_INSERT_SETS), client.register_script(_INSERT_LISTS)
    width = lsh.r * signatures.dtype.itemsize
    for start in range(0, len(signatures), _REDIS_BATCH):
        block = signatures[start : start + _REDIS_BATCH]
        keys = [pickle.dumps(i) for i in range(start, start + len(block))]  # datasketch's prepickle of the key
        buckets = [_names(lsh, block, lo, hi) for lo, hi in lsh.hashranges]
        per_document = b"".join(b"".join(band[k * width : (k + 1) * width] for band in buckets)
                                for k in range(len(block)))
        insert_lists(keys=[lsh.keys._name], args=[per_document, width, len(buckets), *keys])
        for table, band in zip(lsh.hashtables, buckets):
            insert_sets(keys=[table._name], args=[band, width, *keys])


def _names(lsh, block: np.ndarray, lo: int, hi: int) -> bytes:
    """The bucket names of rows `block` in band [lo, hi), concatenated: each is datasketch's `_H` (the band's values,
    byte-swapped, as bytes), computed for all rows at once."""
    names = np.ascontiguousarray(block[:, lo:hi]).byteswap().tobytes()
    assert names[: (hi - lo) * block.dtype.itemsize] == lsh._H(block[0, lo:hi])  # the layout datasketch reads
    return names


def _batched_queries(lsh, signatures: np.ndarray) -> Tuple[List[int], List[int]]:
    """What `lsh.query` returns for every row, as pairs (i, j > i), reading a batch of rows' buckets of one band in
    one script call instead of one bucket at a time: the same buckets are read, so the same pairs come back."""
    shared = lsh.keys._redis.register_script(_SHARED)
    left: List[int] = []
    right: List[int] = []
    for start in range(0, len(signatures), _REDIS_BATCH):
        block = signatures[start : start + _REDIS_BATCH]
        found = [set() for _ in range(len(block))]
        for (lo, hi), table in zip(lsh.hashranges, lsh.hashtables):
            reply = shared(keys=[table._name], args=[_names(lsh, block, lo, hi), (hi - lo) * block.dtype.itemsize])
            for position, bucket in zip(reply[::2], reply[1::2]):
                found[position - 1].update(bucket)
        for i, seen in enumerate(found, start):
            for j in sorted(_int_key(key) for key in seen):
                if j > i:
                    left.append(i)
                    right.append(j)
    return left, right


def _int_key(data: bytes) -> int:
    """The int datasketch pickled as a Redis key (its prepickle), decoded without unpickling: nothing read from a
    server is executed. Pickle protocol 4/5 ints: an optional frame, then K (1 byte), M (2), J (4, signed) or
    LONG1; checked by pickling the value again."""
    body = data[2:] if data[:1] == b"\x80" else b""
    if body[:1] == b"\x95":
        body = body[9:]
    op, rest = body[:1], body[1:]
    widths = {b"K": 1, b"M": 2, b"J": 4}
    if op in widths:
        value = int.from_bytes(rest[: widths[op]], "little", signed=op == b"J")
    elif op == b"\x8a" and rest:
        value = int.from_bytes(rest[1 : 1 + rest[0]], "little", signed=True)
    else:
        value = None
    if value is None or pickle.dumps(value, protocol=data[1] if len(data) > 1 else None) != data:
        raise DataError(f"the Redis LSH index holds a key that is not one of ours ({data[:40]!r}): use a fresh "
                        "data.deduplication.redis_basename")
    return value


def band_pairs(signatures: np.ndarray, bands: int, rows: int) -> Tuple[np.ndarray, np.ndarray]:
    """The candidate pairs datasketch's MinHashLSH gives for these signatures (every row inserted, then every row
    queried: `candidate_pairs` with storage=memory), computed with numpy: band k is columns [k*r, (k+1)*r), the
    same slices MinHashLSH hashes (`hashranges`), and rows whose slices are equal share its bucket. Sorted (i < j)
    pairs, each once. `candidate_pairs` with storage=memory; the Ray engine's reducers call `bucket_pairs` on their
    share of the buckets instead."""
    n = len(signatures)
    codes = []
    positions = np.arange(n, dtype=np.int64)
    for band in range(bands):
        a, b = bucket_pairs(signatures[:, band * rows : (band + 1) * rows], positions)
        codes.append(a * n + b)
    return unique_pairs(codes, n)


def unique_pairs(codes: List[np.ndarray], n: int) -> Tuple[np.ndarray, np.ndarray]:
    """Pairs coded as i * n + j, merged from several bands (or reducers): sorted by (i, j), each once."""
    merged = np.unique(np.concatenate(codes)) if codes else np.empty(0, dtype=np.int64)
    return (merged // n).astype(np.int64), (merged % n).astype(np.int64)


def bucket_pairs(keys: np.ndarray, positions: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """All pairs (positions[a], positions[b]), smaller first, of rows of `keys` (one band's values, a row per
    document) that are equal: order the rows so that equal ones are adjacent, cut the runs, and pair the members of
    each run."""
    if len(keys) < 2:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    keys = np.ascontiguousarray(keys)
    order, same = _runs(keys)
    starts = np.flatnonzero(np.concatenate(([True], ~same, [True])))
    sizes = np.diff(starts)
    left, right = [], []
    for size in np.unique(sizes[sizes > 1]).tolist():
        # Every run of this size at once: (runs, pairs within a run) positions into `order`.
        first = starts[:-1][sizes == size]
        a, b = np.triu_indices(size, 1)
        members = positions[order[first[:, None] + np.arange(size)]]  # (runs, size)
        left.append(np.minimum(members[:, a], members[:, b]).ravel())
        right.append(np.maximum(members[:, a], members[:, b]).ravel())
    if not left:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    return np.concatenate(left), np.concatenate(right)


def _runs(keys: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(order, same): an order of the rows that puts equal rows next to each other, and for each adjacent pair in it
    whether the two rows are equal. Sorted by a 64-bit hash of each row: one sort instead of lexsort's one pass per
    column (8x faster on 15k rows, 14 bands of 9). Rows of equal hash are compared; should two different rows share
    a hash, the band is sorted by lexsort instead, so the grouping is exact either way."""
    hashes = _row_hashes(keys)
    order = np.argsort(hashes)
    ranked, sorted_hashes = keys[order], hashes[order]
    same_hash = sorted_hashes[1:] == sorted_hashes[:-1]
    same = same_hash & (ranked[1:] == ranked[:-1]).all(axis=1)
    if np.array_equal(same, same_hash):
        return order, same
    order = np.lexsort(keys.T[::-1])
    ranked = keys[order]
    return order, (ranked[1:] == ranked[:-1]).all(axis=1)


_MIX = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio, odd: multiplying by it is a bijection mod 2^64


def _row_hashes(keys: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row (it only orders rows; equality is always checked on the values)."""
    h = np.zeros(len(keys), dtype=np.uint64)
    for column in keys.T:
        h ^= column.astype(np.uint64)
        h *= _MIX
        h ^= h >> np.uint64(31)
    return h


class UnionFind:
    """Disjoint sets over 0..n-1 whose representative is always the smallest member: the first document of a
    cluster in corpus order, whatever order the edges come in."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:  # path compression
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            lo, hi = min(ra, rb), max(ra, rb)
            self.parent[hi] = lo


def clusters(n: int, left: np.ndarray, right: np.ndarray) -> Dict[int, List[int]]:
    """Clusters (of 2 or more) of the graph with edges (left[k], right[k]), keyed by their smallest member."""
    uf = UnionFind(n)
    for a, b in zip(left.tolist(), right.tolist()):
        uf.union(a, b)
    out: Dict[int, List[int]] = {}
    for i in range(n):
        root = uf.find(i)
        if root != i:
            out.setdefault(root, [root]).append(i)
    return out
