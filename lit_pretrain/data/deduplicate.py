"""Deduplication: the pipeline stage between reading documents and training the tokenizer.

Repeated text is a leading cause of memorization and wasted compute (Lee et al. 2022, "Deduplicating Training Data
Makes Language Models Better"), so removal comes before the split and the tokenizer:

1. normalize each document (Unicode NFC; optional lower-casing and whitespace folding, `data.deduplication.*`);
2. exact: drop a document whose normalized text has the sha256 of an earlier one;
3. near: MinHash signatures of the survivors' shingle sets (lit_pretrain/data/minhash.py), candidate pairs from
   datasketch's MinHashLSH, optionally verified by their estimated Jaccard, clusters by union-find
   (lit_pretrain/data/lsh.py); the first document of each cluster in corpus order is kept.

Every decision depends only on the texts, their order and the config, never on the number of processes.

What was removed is listed document by document (`DeduplicationResult.removals`, written as `removed.jsonl` beside
`deduplication.json`), so the recall of the stage can be audited:
  id            the removed document
  kind          the stage that removed it: "exact", "near" or "empty"
  duplicates    the id of the kept document it stands for (null for "empty"). Exact: the first document with the
                same normalized text; near: the first document of its cluster in corpus order. When an exact
                duplicate's first copy was itself removed as a near duplicate, it is that copy's kept document, and
                `same_text_as` names the copy
  jaccard       estimated Jaccard similarity to `duplicates`: 1.0 for an exact duplicate (same normalized text, same
                shingles); for a near one, the agreement of the two MinHash signatures with the kept document itself,
                not with the member it was linked to, which can be lower than the threshold in a chained cluster
  linked_to, link_jaccard   (near only) the accepted LSH pair that tied it into its cluster with the highest
                estimate: the other document and that estimate
"""

import hashlib
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from lit_pretrain.data.corpus import Document
from lit_pretrain.data.lsh import (
    REPORTED_SIMILARITIES,
    bands_rows,
    candidate_pairs,
    candidate_probability,
    check_redis,
    clusters,
    index_basename,
)
from lit_pretrain.data.minhash import compute_signatures, estimated_jaccard, normalize
from lit_pretrain.data.shards import DEDUPLICATION_CONTENT_FIELDS
from lit_pretrain.schema import DeduplicationConfig

_LARGEST_CLUSTERS = 5
_EXAMPLES = 5


@dataclass
class DeduplicationResult:
    kept: List[Document]
    """Documents kept, in corpus order."""
    removed: List[Document]
    """Documents removed (exact and near duplicates, and empty ones), in corpus order."""
    report: Dict = field(default_factory=dict)
    """What `deduplication.json` holds (see `deduplicate`)."""
    removals: List[Dict] = field(default_factory=list)
    """One record per removed document, in corpus order: what `removed.jsonl` holds (see the module docstring)."""


def deduplicate(docs: List[Document], cfg: Optional[DeduplicationConfig] = None, progress: bool = True
                ) -> DeduplicationResult:
    """Drop empty documents, then exact, then near duplicates; return what is kept and a report of it."""
    cfg = cfg if cfg is not None else DeduplicationConfig()
    cfg.check()
    basename = index_basename(cfg)
    if cfg.near and cfg.storage == "redis":
        check_redis(cfg, basename)  # before any work: an unreachable server or a used prefix is a config error
    seconds: Dict[str, float] = {}
    start = time.perf_counter()
    normalized = [normalize(d.text, cfg.lowercase, cfg.fold_whitespace) for d in docs]
    empty = [i for i, text in enumerate(normalized) if not text]
    candidates = [i for i, text in enumerate(normalized) if text]
    seconds["normalize"] = time.perf_counter() - start

    start = time.perf_counter()
    exact_removed: Dict[int, int] = {}  # removed index -> the index of the document it repeats
    if cfg.exact:
        first: Dict[bytes, int] = {}
        survivors = []
        for i in candidates:
            digest = hashlib.sha256(normalized[i].encode("utf-8")).digest()
            if digest in first:
                exact_removed[i] = first[digest]
            else:
                first[digest] = i
                survivors.append(i)
        candidates = survivors
    seconds["exact"] = time.perf_counter() - start

    near_removed: Dict[int, Dict] = {}  # removed index -> {"kept": index, "jaccard", "linked_to": index, ...}
    near_report: Dict = {"enabled": cfg.near}
    if cfg.near and len(candidates) > 1:
        near_removed, near_report = _near(docs, normalized, candidates, cfg, basename, seconds, progress)
    elif cfg.near:
        near_report.update(_shape_report(cfg))

    removed_set = set(empty) | set(exact_removed) | set(near_removed)
    kept = [d for i, d in enumerate(docs) if i not in removed_set]
    removed = [d for i, d in enumerate(docs) if i in removed_set]
    report = {
        "documents_in": len(docs),
        "bytes_in": _bytes(docs),
        "documents_out": len(kept),
        "bytes_out": _bytes(kept),
        "empty": {"documents": len(empty), "examples": [docs[i].id for i in empty[:_EXAMPLES]]},
        "exact": {
            "enabled": cfg.exact,
            "normalization": {"unicode": "NFC", "lowercase": cfg.lowercase, "fold_whitespace": cfg.fold_whitespace},
            "hash": "sha256",
            "removed_documents": len(exact_removed),
            "removed_bytes": _bytes(docs[i] for i in exact_removed),
            "examples": [{"removed": docs[i].id, "repeats": docs[j].id}
                         for i, j in list(exact_removed.items())[:_EXAMPLES]],
        },
        "near": {**near_report, "removed_documents": len(near_removed),
                 "removed_bytes": _bytes(docs[i] for i in near_removed)},
        "config": {name: getattr(cfg, name) for name in DEDUPLICATION_CONTENT_FIELDS},
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
    }
    removals = _removals(docs, set(empty), exact_removed, near_removed)
    return DeduplicationResult(kept=kept, removed=removed, report=report, removals=removals)


def _removals(docs: List[Document], empty: set, exact: Dict[int, int], near: Dict[int, Dict]) -> List[Dict]:
    out = []
    for i in sorted(empty | set(exact) | set(near)):
        if i in empty:
            out.append({"id": docs[i].id, "kind": "empty", "duplicates": None, "jaccard": None})
        elif i in exact:
            first = exact[i]
            row = {"id": docs[i].id, "kind": "exact", "duplicates": docs[first].id, "jaccard": 1.0}
            if first in near:  # its first copy went as a near duplicate: name the document that stands for both
                row.update(duplicates=docs[near[first]["kept"]].id, jaccard=near[first]["jaccard"],
                           same_text_as=docs[first].id)
            out.append(row)
        else:
            n = near[i]
            out.append({"id": docs[i].id, "kind": "near", "duplicates": docs[n["kept"]].id, "jaccard": n["jaccard"],
                        "linked_to": docs[n["linked_to"]].id, "link_jaccard": n["link_jaccard"]})
    return out


def _near(docs, normalized, candidates: List[int], cfg: DeduplicationConfig, basename: bytes, seconds: Dict,
          progress: bool):
    """MinHash → LSH candidates → (verified) edges → clusters. Returns {removed index: its record} and a report."""
    start = time.perf_counter()
    texts = [normalized[i] for i in candidates]
    signatures, processes = compute_signatures(texts, cfg.shingle, cfg.shingle_size, cfg.num_perm, cfg.seed,
                                               cfg.processes, progress, ids=[docs[i].id for i in candidates])
    seconds["signatures"] = time.perf_counter() - start

    start = time.perf_counter()
    bands, rows = bands_rows(cfg)
    left, right, index = candidate_pairs(signatures, cfg, bands, rows, basename)
    seconds["lsh"] = time.perf_counter() - start

    start = time.perf_counter()
    estimates = estimated_jaccard(signatures, left, right)
    accepted = estimates >= cfg.threshold if cfg.verify else np.ones(len(left), dtype=bool)
    groups = clusters(len(candidates), left[accepted], right[accepted])
    removed = _near_records(signatures, candidates, groups, left[accepted], right[accepted], estimates[accepted])
    seconds["clusters"] = time.perf_counter() - start

    largest = sorted(groups.values(), key=lambda g: (-len(g), g[0]))[:_LARGEST_CLUSTERS]
    report = {
        "enabled": True,
        **_shape_report(cfg, bands, rows),
        "processes": processes,
        "signature_bytes": int(signatures.nbytes),
        "index": index,
        "candidate_pairs": int(len(left)),
        "verify": cfg.verify,
        "verified_pairs": int(accepted.sum()),
        "false_positive_pairs": int(len(left) - accepted.sum()) if cfg.verify else None,
        "clusters": len(groups),
        "largest_clusters": [
            {"size": len(g), "kept": docs[candidates[g[0]]].id,
             "removed_examples": [docs[candidates[m]].id for m in g[1 : 1 + _EXAMPLES]]}
            for g in largest
        ],
    }
    return removed, report


def _near_records(signatures: np.ndarray, candidates: List[int], groups: Dict[int, List[int]], left: np.ndarray,
                  right: np.ndarray, estimates: np.ndarray) -> Dict[int, Dict]:
    """{removed document index: kept index, estimated Jaccard to it, and its strongest accepted pair}."""
    strongest: Dict[int, tuple] = {}  # candidate position -> (estimate, other position) of its best accepted pair
    for a, b, e in zip(left.tolist(), right.tolist(), estimates.tolist()):
        for one, other in ((a, b), (b, a)):
            # Ties go to the earlier document, so the record does not depend on the order LSH returned pairs in.
            if one not in strongest or (e, -other) > (strongest[one][0], -strongest[one][1]):
                strongest[one] = (e, other)
    members = [(root, m) for root, group in groups.items() for m in group[1:]]
    if not members:
        return {}
    roots, removed = np.array([r for r, _ in members]), np.array([m for _, m in members])
    to_kept = estimated_jaccard(signatures, removed, roots)
    return {candidates[m]: {"kept": candidates[r], "jaccard": float(j), "linked_to": candidates[strongest[m][1]],
                            "link_jaccard": strongest[m][0]}
            for (r, m), j in zip(members, to_kept.tolist())}


def _shape_report(cfg: DeduplicationConfig, bands: Optional[int] = None, rows: Optional[int] = None) -> Dict:
    if bands is None:
        bands, rows = bands_rows(cfg)
    return {
        "shingle": cfg.shingle,
        "shingle_size": cfg.shingle_size,
        "num_perm": cfg.num_perm,
        "seed": cfg.seed,
        "threshold": cfg.threshold,
        "bands": bands,
        "rows": rows,
        "bands_rows_source": "config" if cfg.bands is not None else
        f"datasketch optimum (false_negative_weight {cfg.false_negative_weight})",
        "candidate_probability": {f"{s:.2f}": round(candidate_probability(s, bands, rows), 4)
                                  for s in REPORTED_SIMILARITIES},
    }


def _bytes(docs) -> int:
    return sum(len(d.text.encode("utf-8")) for d in docs)
