"""Candidate pairs from datasketch's MinHashLSH (in memory or in Redis) and clusters by union-find.

Banding (Leskovec, Rajaraman & Ullman, "Mining of Massive Datasets", section 3.4.2): a signature is cut into b
bands of r rows; two documents become a candidate pair when all r rows of at least one band agree. A pair of
Jaccard similarity s agrees on one row with probability s, so it becomes a candidate with probability
1 - (1 - s^r)^b.
"""

import re
import uuid
from typing import Dict, List, Tuple

import numpy as np
from datasketch import LeanMinHash, MinHashLSH
from datasketch.lsh import _optimal_param

from lit_pretrain.errors import DataError

REPORTED_SIMILARITIES = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
_SCHEME = "affine32"  # datasketch 2.0's default, the scheme of minhash.template()


def candidate_probability(s: float, bands: int, rows: int) -> float:
    """Probability that a pair of Jaccard similarity s shares at least one band: 1 - (1 - s^r)^b."""
    return 1.0 - (1.0 - s**rows) ** bands


def bands_rows(cfg) -> Tuple[int, int]:
    """(b, r): the configured ones, else the optimum datasketch's MinHashLSH picks for (threshold, num_perm, weights)
    (a grid search minimizing the weighted areas of false positives and false negatives under the S-curve)."""
    if cfg.bands is not None:
        return cfg.bands, cfg.rows
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
    named = cfg.storage == "redis" and cfg.redis_basename
    lsh = MinHashLSH(num_perm=signatures.shape[1], params=(bands, rows), storage_config=storage_config(cfg, basename))
    seed = cfg.seed
    try:
        with lsh.insertion_session(buffer_size=10_000) as session:
            for i, row in enumerate(signatures):
                session.insert(i, _lean(row, seed), check_duplication=False)
        left: List[int] = []
        right: List[int] = []
        for i, row in enumerate(signatures):
            for j in lsh.query(_lean(row, seed)):
                if j > i:
                    left.append(i)
                    right.append(j)
    finally:
        if cfg.storage == "redis" and not named:
            drop_redis_index(cfg, basename)
    order = np.lexsort((np.asarray(right, dtype=np.int64), np.asarray(left, dtype=np.int64)))
    pairs_left = np.asarray(left, dtype=np.int64)[order]
    pairs_right = np.asarray(right, dtype=np.int64)[order]
    where = {"storage": cfg.storage}
    if cfg.storage == "redis":
        where.update(redis=f"{cfg.redis_host}:{cfg.redis_port}/{cfg.redis_db}", basename=basename.decode(),
                     kept=bool(named))
    return pairs_left, pairs_right, where


def _lean(row: np.ndarray, seed: int) -> LeanMinHash:
    return LeanMinHash(seed=seed, hashvalues=row, scheme=_SCHEME)


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
