"""The Ray engine of `prepare` (data.engine=ray): reading, deduplication and tokenization as tasks on a Ray cluster,
giving the same prepared folder, byte for byte, as the local engine.

  read       one task per group of consecutive corpus files (~4 MB, or one large file): the corpus's own readers
             (corpus.read_files), and per document its size, quality counts, the sha256 of its text (the corpus
             fingerprint), of its normalized text (exact stage) and its MinHash signature (minhash.chunk_signatures:
             the same permutations as the local engine)
  exact      on the driver, in corpus order (the first copy of a text is kept, as StreamingDeduplication does)
  lsh        a shuffle by bucket: one map task per read group sends each (band, band values, position) to the
             reducer that owns hash(band values) mod P; each reducer groups equal band values (lsh.bucket_pairs, the
             exact slices MinHashLSH hashes) and returns its pairs; the driver merges them (lsh.unique_pairs)
  clusters   verification by estimated Jaccard and union-find on the driver (deduplicate.decide, the local
             engine's code): the candidate pairs, not the corpus, have to fit in its memory
  tokenize   one task per read group encodes its kept documents (tokenize_stage.encode_chunk); the driver writes
             the results in corpus order into the shards (tokenize_stage.write_encoded, the local engine's writer)

Why it is the same answer for any number of workers: every task's result depends only on its files, every result
is consumed in corpus (file) order, every document is named by its index in corpus order, and the LSH pairs are a
set (sorted and merged) whatever reducer found them. The workers must see the corpus at the same paths as the
driver (a shared filesystem) and have lit-pretrain installed.
"""

import os
import socket
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

import numpy as np

from lit_pretrain.data.preparation.corpus import (
    CorpusStats,
    Fingerprint,
    corpus_files,
    corpus_roots,
    is_validation,
    read_files,
    text_digest,
)
from lit_pretrain.data.preparation.deduplicate import Decisions, decide
from lit_pretrain.data.preparation.lsh import bucket_pairs, unique_pairs
from lit_pretrain.data.preparation.minhash import chunk_signatures, normalize, signature_dtype
from lit_pretrain.data.preparation.progress import stage_line
from lit_pretrain.data.preparation.quality import check_quality, count_control
from lit_pretrain.errors import DataError

GROUP_BYTES = 4 << 20  # files are read, hashed and tokenized in groups of about this size: one task each
# Test hook: when this variable names a folder holding a file `kill-read`, the first read task to remove that file
# ends its worker process abruptly (as a crash or an out-of-memory kill would); Ray runs the task again.
KILL_HOOK = "LIT_PRETRAIN_RAY_TEST_HOOKS"
_INSTALL = "pip install 'lit-pretrain[ray]'"


@dataclass
class Session:
    ray: object
    workers: int
    """Tasks run at once: data.workers, else the cluster's CPUs."""
    address: str
    task_cpus: float = 1.0
    """CPUs each task asks for: the cluster's CPUs / workers, so that Ray itself runs no more than `workers` tasks
    at once (the shuffle's tasks are all submitted together)."""


def _import_ray():
    try:
        import ray
    except ImportError:
        raise DataError(f"data.engine=ray needs Ray, which is not installed: {_INSTALL}, or set data.engine=local"
                        ) from None
    return ray


def check(cfg) -> None:
    if cfg.deduplication.near and cfg.deduplication.storage == "redis":
        raise DataError("data.deduplication.storage=redis is an index for data.engine=local; the Ray engine groups "
                        "LSH buckets by a shuffle on the cluster: set data.deduplication.storage=memory")


def init_local(ray, num_cpus: int, **kwargs) -> None:
    """Start a one-machine Ray cluster whose servers (GCS, raylet, workers, object manager) listen on loopback only.

    Ray binds its servers to the node's IP, which it takes from the machine's outward interface unless Ray believes
    it runs on a laptop (ray_constants.ENABLE_RAY_CLUSTER false: then the node IP is 127.0.0.1). A local cluster
    needs no outside connection, and a Ray server runs whatever a client sends it (SECURITY.md), so the flag is
    lowered for the start and put back after: a later connection to a real cluster from this process is unaffected.
    """
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(num_cpus=num_cpus, _node_ip_address="127.0.0.1", **kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@contextmanager
def session(cfg, log: Callable[[str], None] = print) -> Iterator[Session]:
    """A Ray session for the stage: the caller's when Ray is already initialized (tests, notebooks), else a
    connection to data.ray_address, else a local cluster of data.workers CPUs, shut down afterwards."""
    check(cfg)
    ray = _import_ray()
    ours = not ray.is_initialized()
    if ours:
        quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR"}
        address = cfg.ray_address
        if address is None:
            init_local(ray, cfg.workers or os.cpu_count() or 1, **quiet)
        else:
            _check_reachable(address)
            try:
                ray.init(address=address, **quiet)
            except (ConnectionError, RuntimeError, ValueError) as err:
                raise DataError(_unreachable(address, err)) from None
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        workers = max(1, min(cfg.workers or cpus, cpus))
        where = cfg.ray_address or ("a local cluster" if ours else "the running Ray session")
        log(f"ray: {workers} workers on {where} ({cpus} CPUs)")
        # No task may ask for more CPUs than one machine has, or it would never be scheduled.
        largest = max((node["Resources"].get("CPU", 0) for node in ray.nodes() if node.get("Alive")), default=1)
        yield Session(ray, workers, str(where), min(cpus / workers, largest or 1))
    finally:
        if ours:
            ray.shutdown()


def _unreachable(address: str, err) -> str:
    return (f"data.ray_address={address!r}: no Ray cluster answers there ({err}): start one with `ray start --head` "
            "on that machine, fix data.ray_address, or set it to null to start a local cluster")


def _check_reachable(address: str) -> None:
    """HOST:PORT must accept a connection within seconds: ray.init would otherwise retry for a minute."""
    if address == "auto" or address.startswith("ray://") or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=3):
            pass
    except (OSError, ValueError) as err:
        raise DataError(_unreachable(address, err)) from None


def file_groups(files: List[Tuple[str, str]], workers: int) -> List[List[Tuple[str, str]]]:
    """Consecutive files of about GROUP_BYTES each, or less for a small corpus, so that each worker gets about 4
    groups (by size on disk; a file that cannot be sized counts as large, and its reader names it). A file is never
    split: the order of documents is that of the files, whatever the grouping."""
    sizes = []
    for _, path in files:
        try:
            sizes.append(os.path.getsize(path))
        except OSError:
            sizes.append(GROUP_BYTES)
    max_bytes = max(1, min(GROUP_BYTES, sum(sizes) // (4 * workers)))
    groups, current, size = [], [], 0
    for (name, path), file_size in zip(files, sizes):
        size += file_size
        current.append((name, path))
        if size >= max_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


# ---- tasks (module-level functions: Ray pickles them by reference, workers import this module) ----

def read_group(kind: str, files, text_field: str, dedup, split_seed: int, val_fraction: float):
    """Per document of the group, empty ones included: what the driver needs to take the local engine's decisions;
    and the signatures of the documents whose normalized text is not empty (zero rows for the others)."""
    _maybe_die()
    stats = CorpusStats()
    rows: Dict[str, list] = {k: [] for k in ("id", "source", "empty", "replaced", "invalid", "size", "chars",
                                             "control", "digest", "norm_empty", "norm_digest", "val")}
    texts: List[str] = []
    for source, doc in read_files(kind, files, text_field, stats):
        # The counters read_files moved for this document (decoding happens inside it).
        replaced, invalid = stats.invalid_utf8_sequences, stats.invalid_utf8_documents
        stats.invalid_utf8_sequences = stats.invalid_utf8_documents = 0
        empty = not doc.text.strip()
        text = "" if empty else normalize(doc.text, dedup.lowercase, dedup.fold_whitespace)
        control = 0 if empty else count_control(doc.text)
        for key, value in (("id", doc.id), ("source", source), ("empty", empty), ("replaced", replaced),
                           ("invalid", invalid), ("size", len(doc.text.encode("utf-8"))),
                           ("chars", 0 if empty else len(doc.text)), ("control", control),
                           ("digest", text_digest(doc.text)), ("norm_empty", not text),
                           ("norm_digest", text_digest(text) if dedup.exact and text else b""),
                           ("val", is_validation(doc.id, split_seed, val_fraction))):
            rows[key].append(value)
        texts.append(text)
    signatures = np.zeros((len(texts), dedup.num_perm), dtype=signature_dtype(dedup.num_perm, dedup.seed))
    if dedup.near:
        todo = [k for k, text in enumerate(texts) if text]
        if todo:
            signatures[todo] = chunk_signatures(([texts[k] for k in todo], dedup.shingle, dedup.shingle_size,
                                                 dedup.num_perm, dedup.seed))
    return rows, signatures


def _maybe_die() -> None:
    folder = os.environ.get(KILL_HOOK)
    if folder:
        try:
            os.remove(os.path.join(folder, "kill-read"))
        except FileNotFoundError:
            return
        os._exit(1)


def band_map(signatures: np.ndarray, rows: np.ndarray, first: int, bands: int, r: int, parts: int):
    """Each band's values of the candidate `rows` (positions first, first + 1, ...) sent to reducer
    hash(values) mod parts: a list of `parts` (band, position, values) triples."""
    positions = np.arange(first, first + len(rows), dtype=np.int64)
    out: List[List] = [[] for _ in range(parts)]
    for band in range(bands):
        keys = np.ascontiguousarray(signatures[rows, band * r : (band + 1) * r]).astype(np.uint64)
        h = np.full(len(rows), band + 1, dtype=np.uint64)
        for column in keys.T:  # a multiplicative hash of the values: only spreads buckets, never decides a pair
            h = h * np.uint64(0x9E3779B97F4A7C15) + column
        owner = (h >> np.uint64(17)) % np.uint64(parts)
        for p in range(parts):
            mask = owner == p
            if mask.any():
                out[p].append((band, positions[mask], keys[mask]))
    return out if parts > 1 else out[0]


def band_reduce(n: int, *pieces) -> np.ndarray:
    """The pairs (coded i * n + j) of the buckets this reducer owns, from every map task's share."""
    by_band: Dict[int, List] = {}
    for piece in pieces:
        for band, positions, keys in piece:
            by_band.setdefault(band, []).append((positions, keys))
    codes = []
    for band in sorted(by_band):
        positions = np.concatenate([p for p, _ in by_band[band]])
        keys = np.concatenate([k for _, k in by_band[band]])
        a, b = bucket_pairs(keys, positions)
        codes.append(a * n + b)
    return np.unique(np.concatenate(codes)) if codes else np.empty(0, dtype=np.int64)


def encode_group(kind: str, files, text_field: str, take: int, where: bytes, tokenizer, key: str, bos, eos,
                 dtype: str):
    """The first `take` non-empty documents of the group: (their ids and text digests, and tokenize_stage.
    encode_chunk's ids and lengths for them with destinations `where`)."""
    from lit_pretrain.data.preparation.tokenize_stage import _TOKENIZERS, encode_chunk, remember_tokenizer

    if key not in _TOKENIZERS:
        from tokenizers import Tokenizer

        loaded = Tokenizer.from_str(tokenizer)
        loaded.encode_special_tokens = True  # as tokenize_stage._tokenizer
        remember_tokenizer(key, loaded)
    ids, digests, texts = [], [], []
    for _, doc in read_files(kind, files, text_field, CorpusStats()):
        if len(texts) == take:
            break
        if doc.text.strip():
            ids.append(doc.id)
            digests.append(text_digest(doc.text))
            texts.append(doc.text)
    return ids, digests, encode_chunk((key, texts, where, bos, eos, dtype))


# ---- driver ----

def _in_order(session: Session, fn, argses, num_returns: int = 1) -> Iterator:
    """Run fn over argses with at most session.workers tasks at once; yield their results in argses' order (a
    worker that dies is replaced and its task run again by Ray)."""
    remote = session.ray.remote(num_returns=num_returns, max_retries=3, num_cpus=session.task_cpus)(fn)
    pending: deque = deque()
    queue = iter(argses)
    try:
        while True:
            while len(pending) < session.workers:
                args = next(queue, None)
                if args is None:
                    break
                pending.append(remote.remote(*args))
            if not pending:
                return
            yield _get(session, pending.popleft())
    finally:
        for ref in pending:  # results not wanted (the corpus was cut, or an error): stop their tasks
            session.ray.cancel(ref if num_returns == 1 else ref[0])


def _get(session: Session, ref):
    try:
        return session.ray.get(ref)
    except session.ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, DataError):
            raise DataError(str(err.cause)) from None
        raise _task_failed(err) from None
    except session.ray.exceptions.RayError as err:  # a worker that died more often than Ray retries, a lost node
        raise _task_failed(err) from None


def _task_failed(err) -> DataError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return DataError(f"data.engine=ray: a task failed on the cluster ({type(err).__name__}: {first}): see the "
                     "workers' logs (`ray logs`), or run with data.engine=local to see the error here")


def _stage_line(log, stage: str, documents: int, seconds: float) -> None:
    stage_line(log, "ray", stage, documents, seconds)


def first_pass(cfg, session: Session, stats: CorpusStats, log: Callable[[str], None] = print):
    """prepare's pass 1 on the cluster: (fingerprint, quality, decisions, in_val, groups) as prepare._first_pass
    returns them (plus the file groups and how many documents each contributes, for the second pass)."""
    dedup = cfg.deduplication
    dedup.check()
    seconds: Dict[str, float] = {}
    start = time.perf_counter()
    groups = file_groups(corpus_files(cfg), session.workers)
    fingerprint = Fingerprint()
    sizes, in_val, empty, exact_removed = [], [], [], {}
    first_copy: Dict[bytes, int] = {}
    candidates: List[int] = []
    signature_parts: List[np.ndarray] = []
    taken: List[int] = []  # non-empty documents each group contributes (the corpus may be cut in the middle)
    args = ((cfg.corpus, files, cfg.text_field, dedup, cfg.split_seed, cfg.val_fraction) for files in groups)
    done = False
    for rows, signatures in _in_order(session, read_group, args, num_returns=2):
        take, picked = 0, []
        for k in range(len(rows["id"])):
            stats.invalid_utf8_sequences += rows["replaced"][k]
            stats.invalid_utf8_documents += rows["invalid"][k]
            if rows["replaced"][k]:
                stats.source(rows["source"][k]).replaced += rows["replaced"][k]
            if rows["empty"][k]:
                stats.empty += 1
                continue
            i = stats.documents
            stats.documents += 1
            stats.bytes += rows["size"][k]
            quality = stats.source(rows["source"][k])
            quality.characters += rows["chars"][k]
            quality.control += rows["control"][k]
            fingerprint.add_digest(rows["id"][k], rows["digest"][k])
            sizes.append(rows["size"][k])
            in_val.append(rows["val"][k])
            take += 1
            if rows["norm_empty"][k]:
                empty.append(i)
            elif dedup.exact and first_copy.setdefault(rows["norm_digest"][k], i) != i:
                exact_removed[i] = first_copy[rows["norm_digest"][k]]
            else:
                candidates.append(i)
                picked.append(k)
            if cfg.max_documents is not None and stats.documents >= cfg.max_documents:
                done = True
                break
        taken.append(take)
        if dedup.near and picked:
            signature_parts.append(signatures[picked])
        if done:
            break
    if stats.documents == 0:
        raise DataError(f"the {cfg.corpus} corpus at data.paths={corpus_roots(cfg)} has no non-empty documents "
                        f"({stats.empty} empty): point data.paths at files with text")
    seconds["read_signatures"] = time.perf_counter() - start
    _stage_line(log, "read, exact and signatures", stats.documents, seconds["read_signatures"])
    quality = check_quality(stats.sources, cfg.max_invalid_fraction, f"data.paths={corpus_roots(cfg)}")
    first_copy.clear()

    signatures = None
    if dedup.near:
        signatures = (np.concatenate(signature_parts) if signature_parts else
                      np.empty((0, dedup.num_perm), dtype=signature_dtype(dedup.num_perm, dedup.seed)))
    candidates_arr = np.asarray(candidates, dtype=np.int64)
    decided = decide(dedup, np.asarray(sizes, dtype=np.int64), empty, exact_removed, candidates_arr, signatures,
                     seconds, session.workers, lambda sig, bands, r: _shuffle_pairs(session, sig, bands, r))
    for stage in ("lsh", "clusters"):
        if stage in seconds:
            _stage_line(log, stage, len(candidates), seconds[stage])
    return fingerprint.hexdigest(), quality, decided, np.asarray(in_val, dtype=bool), (groups[: len(taken)], taken)


def _shuffle_pairs(session: Session, signatures: np.ndarray, bands: int, r: int):
    """Candidate pairs by a shuffle of (band, values) to `session.workers` reducers; the same pairs as
    lsh.band_pairs (and so as MinHashLSH), sorted, each once."""
    ray, n, parts = session.ray, len(signatures), session.workers
    block = max(1, -(-n // (4 * parts)))  # a few map tasks per worker
    shared = ray.put(np.ascontiguousarray(signatures))
    mapper = ray.remote(num_returns=parts, max_retries=3, num_cpus=session.task_cpus)(band_map)
    maps = [mapper.remote(shared, np.arange(a, min(a + block, n)), a, bands, r, parts) for a in range(0, n, block)]
    if parts == 1:
        maps = [[m] for m in maps]
    reducer = ray.remote(max_retries=3, num_cpus=session.task_cpus)(band_reduce)
    codes = [_get(session, ref) for ref in [reducer.remote(n, *[m[p] for m in maps]) for p in range(parts)]]
    left, right = unique_pairs(codes, n)
    # Components: union-find on the driver (deduplicate.decide), which holds the candidate pairs (16 bytes each)
    # and the candidates' signatures; no distributed algorithm is needed while those fit one machine's memory.
    return left, right, {"storage": "ray", "reducers": parts, "components": "union-find on the driver"}


def tokenize_pass(cfg, session: Session, tok_info: Dict, folder: Path, decided: Decisions, in_val: np.ndarray,
                  fingerprint: str, groups, log: Callable[[str], None] = print):
    """prepare's pass 2 on the cluster: each group's kept documents encoded by a task, written here in corpus order
    by tokenize_stage.write_encoded. Returns what prepare._tokenize_stage does."""
    from lit_pretrain.data.preparation.tokenize_stage import COUNT, TRAIN, VAL, write_encoded

    files, taken = groups
    dest = np.where(decided.removed, COUNT, np.where(in_val, VAL, TRAIN)).astype(np.uint8)
    offsets = np.concatenate(([0], np.cumsum(taken)))
    tokenizer = session.ray.put((folder / tok_info["file"]).read_text(encoding="utf-8"))
    key = f"ray:{tok_info['sha256']}"
    args = ((cfg.corpus, group, cfg.text_field, take, dest[offsets[g] : offsets[g + 1]].tobytes(), tokenizer, key,
             tok_info["bos_id"], tok_info["eod_id"], tok_info["dtype"])
            for g, (group, take) in enumerate(zip(files, taken)))
    needed = decided.needed_ids()
    ids: Dict[int, str] = {}
    check = Fingerprint()
    split_bytes = {TRAIN: 0, VAL: 0}

    def encoded():
        for g, (group_ids, digests, (flat, lengths)) in enumerate(_in_order(session, encode_group, args)):
            for k, (doc_id, digest) in enumerate(zip(group_ids, digests), int(offsets[g])):
                check.add_digest(doc_id, digest)
                if k in needed:
                    ids[k] = doc_id
                if dest[k] != COUNT:
                    split_bytes[int(dest[k])] += int(decided.sizes[k])
            yield dest[offsets[g] : offsets[g + 1]].tobytes(), flat, lengths

    splits, counts, removed_tokens = write_encoded(cfg, tok_info, folder, encoded())
    if check.hexdigest() != fingerprint:
        raise DataError(
            f"the corpus at data.paths={corpus_roots(cfg)} changed while it was being prepared (the second read "
            "differs from the first): prepare it again once nothing writes to it"
        )
    for split, d in (("train", TRAIN), ("val", VAL)):
        splits[split]["bytes"] = split_bytes[d]
    return splits, counts, removed_tokens, ids

