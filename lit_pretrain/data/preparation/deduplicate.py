"""Deduplication: the pipeline stage between reading documents and training the tokenizer.

Repeated text is a leading cause of memorization and wasted compute (Lee et al. 2022, "Deduplicating Training Data
Makes Language Models Better"), so removal comes before the split and the tokenizer:

1. normalize each document (Unicode NFC; optional lower-casing and whitespace folding, `data.deduplication.*`);
2. exact: drop a document whose normalized text has the sha256 of an earlier one;
3. near: MinHash signatures of the survivors' shingle sets (lit_pretrain/data/preparation/minhash.py), candidate pairs
   from LSH banding (the pairs of datasketch's MinHashLSH), optionally verified by their estimated Jaccard, clusters by
   union-find (lit_pretrain/data/preparation/lsh.py); the first document of each cluster in corpus order is kept.

Every decision depends only on the texts, their order and the config, never on the number of processes.

`StreamingDeduplication` takes the documents one at a time (prepare's first pass) and keeps per document only its
size, the sha256 of its normalized text and its signature, spilled to a file; `deduplicate` runs it over a list.

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
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional

import numpy as np

from lit_pretrain.data.preparation.corpus import Document
from lit_pretrain.data.preparation.lsh import (
    REPORTED_SIMILARITIES,
    bands_rows,
    candidate_pairs,
    candidate_probability,
    check_redis,
    clusters,
    index_basename,
)
from lit_pretrain.data.preparation.minhash import SignatureSpill, estimated_jaccard, normalize
from lit_pretrain.data.shards import DEDUPLICATION_CONTENT_FIELDS
from lit_pretrain.schema import DeduplicationConfig

_LARGEST_CLUSTERS = 5
_EXAMPLES = 5
SIGNATURES_FILE = "minhash-signatures.bin"


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
    with tempfile.TemporaryDirectory(prefix="lit-pretrain-deduplication-") as spill:
        with StreamingDeduplication(cfg, Path(spill), progress) as stage:
            for doc in docs:
                stage.add(doc)
            decided = stage.finish()
    ids = [d.id for d in docs]
    kept = [d for d, gone in zip(docs, decided.removed) if not gone]
    removed = [d for d, gone in zip(docs, decided.removed) if gone]
    return DeduplicationResult(kept=kept, removed=removed, report=decided.report(ids), removals=decided.removals(ids))


class StreamingDeduplication:
    """Deduplication fed one document at a time in corpus order (prepare's first pass), holding per document only
    its size, the sha256 of its normalized text (exact) and its MinHash signature, which goes to a file in
    `spill_dir` (near); `finish()` runs LSH and clustering over the memory-mapped signatures. The LSH index lives
    in memory or Redis (data.deduplication.storage). Ids are not kept: the decisions name documents by index, and
    the report asks for the few ids it names (`Decisions.needed_ids`)."""

    def __init__(self, cfg: Optional[DeduplicationConfig], spill_dir: Path, progress: bool = True):
        cfg = cfg if cfg is not None else DeduplicationConfig()
        cfg.check()
        self.cfg, self.basename = cfg, index_basename(cfg)
        if cfg.near and cfg.storage == "redis":
            check_redis(cfg, self.basename)  # before any work: an unreachable server or a used prefix is a config error
        self.sizes = array("q")  # UTF-8 bytes of each document
        self.empty: List[int] = []
        self.exact_removed: Dict[int, int] = {}  # removed index -> the index of the document it repeats
        self._first: Dict[bytes, int] = {}
        self.candidates = array("q")  # indices of the documents left for the near stage
        self.seconds: Dict[str, float] = {"normalize": 0.0, "exact": 0.0}
        self._spill = (SignatureSpill(Path(spill_dir) / SIGNATURES_FILE, cfg.shingle, cfg.shingle_size, cfg.num_perm,
                                      cfg.seed, cfg.processes, progress) if cfg.near else None)
        self._signature_seconds = 0.0

    def __enter__(self) -> "StreamingDeduplication":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if self._spill is not None:
            self._spill.close(kill=exc_type is not None)

    def add(self, doc: Document) -> None:
        cfg, i = self.cfg, len(self.sizes)
        start = time.perf_counter()
        self.sizes.append(len(doc.text.encode("utf-8")))
        text = normalize(doc.text, cfg.lowercase, cfg.fold_whitespace)
        middle = time.perf_counter()
        self.seconds["normalize"] += middle - start
        if not text:
            self.empty.append(i)
            return
        if cfg.exact:
            digest = hashlib.sha256(text.encode("utf-8")).digest()
            first = self._first.setdefault(digest, i)
            self.seconds["exact"] += time.perf_counter() - middle
            if first != i:
                self.exact_removed[i] = first
                return
        self.candidates.append(i)
        if self._spill is not None:
            start = time.perf_counter()
            self._spill.add(text, doc.id)
            self._signature_seconds += time.perf_counter() - start

    def finish(self) -> "Decisions":
        self._first.clear()
        cfg, signatures = self.cfg, None
        if self._spill is not None:
            start = time.perf_counter()
            signatures = self._spill.finish()
            self.seconds["signatures"] = self._signature_seconds + time.perf_counter() - start
        processes = self._spill.processes if self._spill is not None else 1
        return decide(cfg, np.frombuffer(self.sizes, dtype=np.int64), self.empty, self.exact_removed,
                      np.frombuffer(self.candidates, dtype=np.int64), signatures, self.seconds, processes,
                      lambda rows, bands, r: candidate_pairs(rows, cfg, bands, r, self.basename))


def decide(cfg: DeduplicationConfig, sizes: np.ndarray, empty: List[int], exact_removed: Dict[int, int],
           candidates: np.ndarray, signatures: Optional[np.ndarray], seconds: Dict[str, float], processes: int,
           pairs: Callable) -> "Decisions":
    """The decisions from what the exact stage left (`candidates`, document indices in increasing order) and their
    signatures (None: near stage off); `pairs(signatures, bands, rows)` gives the LSH candidate pairs (sorted, each
    once) and how the index was kept. Both engines end here, so they decide alike from the same pairs."""
    near_removed: Dict[int, Dict] = {}
    near_report: Dict = {"enabled": cfg.near}
    if signatures is not None:
        if len(candidates) > 1:
            start = time.perf_counter()
            bands, rows = bands_rows(cfg)
            left, right, index = pairs(signatures, bands, rows)
            seconds["lsh"] = time.perf_counter() - start
            near_removed, near_report = near_decisions(signatures, candidates, left, right, index, cfg, seconds,
                                                       processes)
        else:
            near_report.update(shape_report(cfg))
            seconds.pop("signatures", None)
    removed = np.zeros(len(sizes), dtype=bool)
    for group in (empty, list(exact_removed), list(near_removed)):
        removed[np.asarray(group, dtype=np.int64)] = True
    return Decisions(removed, sizes, empty, exact_removed, near_removed, near_report, cfg, seconds)


@dataclass
class Decisions:
    """What deduplication decided, by document index; `report` and `removals` take the ids of `needed_ids`."""

    removed: np.ndarray
    """One bool per document in corpus order: True for removed."""
    sizes: np.ndarray
    empty: List[int]
    exact_removed: Dict[int, int]
    near_removed: Dict[int, Dict]
    """removed index -> {"kept": index, "jaccard", "linked_to": index, "link_jaccard"}"""
    near_report: Dict
    cfg: DeduplicationConfig
    seconds: Dict[str, float]

    def needed_ids(self) -> set:
        """Indices of the documents the report and the removal records name."""
        out = set(self.empty) | set(self.exact_removed) | set(self.exact_removed.values()) | set(self.near_removed)
        for record in self.near_removed.values():
            out.update((record["kept"], record["linked_to"]))
        return out

    def report(self, ids: Mapping[int, str]) -> Dict:
        cfg, sizes, exact, near = self.cfg, self.sizes, self.exact_removed, self.near_removed
        near_report = dict(self.near_report)
        if "largest_clusters" in near_report:
            near_report["largest_clusters"] = [
                {"size": g["size"], "kept": ids[g["kept"]], "removed_examples": [ids[m] for m in g["removed_examples"]]}
                for g in near_report["largest_clusters"]]
        return {
            "documents_in": len(sizes),
            "bytes_in": int(sizes.sum()),
            "documents_out": int((~self.removed).sum()),
            "bytes_out": int(sizes[~self.removed].sum()),
            "empty": {"documents": len(self.empty), "examples": [ids[i] for i in self.empty[:_EXAMPLES]]},
            "exact": {
                "enabled": cfg.exact,
                "normalization": {"unicode": "NFC", "lowercase": cfg.lowercase, "fold_whitespace": cfg.fold_whitespace},
                "hash": "sha256",
                "removed_documents": len(exact),
                "removed_bytes": int(sum(sizes[i] for i in exact)),
                "examples": [{"removed": ids[i], "repeats": ids[j]} for i, j in list(exact.items())[:_EXAMPLES]],
            },
            "near": {**near_report, "removed_documents": len(near),
                     "removed_bytes": int(sum(sizes[i] for i in near))},
            "config": {name: getattr(cfg, name) for name in DEDUPLICATION_CONTENT_FIELDS},
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }

    def removals(self, ids: Mapping[int, str]) -> List[Dict]:
        empty, exact, near = set(self.empty), self.exact_removed, self.near_removed
        out = []
        for i in sorted(empty | set(exact) | set(near)):
            if i in empty:
                out.append({"id": ids[i], "kind": "empty", "duplicates": None, "jaccard": None})
            elif i in exact:
                first = exact[i]
                row = {"id": ids[i], "kind": "exact", "duplicates": ids[first], "jaccard": 1.0}
                if first in near:  # its first copy went as a near duplicate: name the document that stands for both
                    row.update(duplicates=ids[near[first]["kept"]], jaccard=near[first]["jaccard"],
                               same_text_as=ids[first])
                out.append(row)
            else:
                n = near[i]
                out.append({"id": ids[i], "kind": "near", "duplicates": ids[n["kept"]], "jaccard": n["jaccard"],
                            "linked_to": ids[n["linked_to"]], "link_jaccard": n["link_jaccard"]})
        return out


def near_decisions(signatures: np.ndarray, candidates: np.ndarray, left: np.ndarray, right: np.ndarray, index: Dict,
                   cfg: DeduplicationConfig, seconds: Dict, processes: int):
    """Candidate pairs (sorted, each once, as positions among `candidates`) → (verified) edges → clusters:
    {removed index: its record} and a report naming documents by index. Shared by the local and the Ray engine
    (lit_pretrain/data/preparation/ray_engine.py), so that the two cannot decide differently from the same pairs."""
    bands, rows = bands_rows(cfg)
    start = time.perf_counter()
    estimates = estimated_jaccard(signatures, left, right)
    accepted = estimates >= cfg.threshold if cfg.verify else np.ones(len(left), dtype=bool)
    groups = clusters(len(candidates), left[accepted], right[accepted])
    candidates = candidates.tolist()
    removed = _near_records(signatures, candidates, groups, left[accepted], right[accepted], estimates[accepted])
    seconds["clusters"] = time.perf_counter() - start

    largest = sorted(groups.values(), key=lambda g: (-len(g), g[0]))[:_LARGEST_CLUSTERS]
    report = {
        "enabled": True,
        **shape_report(cfg, bands, rows),
        "processes": processes,
        "signature_bytes": int(signatures.nbytes),
        "index": index,
        "candidate_pairs": int(len(left)),
        "verify": cfg.verify,
        "verified_pairs": int(accepted.sum()),
        "false_positive_pairs": int(len(left) - accepted.sum()) if cfg.verify else None,
        "clusters": len(groups),
        "largest_clusters": [
            {"size": len(g), "kept": candidates[g[0]],
             "removed_examples": [candidates[m] for m in g[1 : 1 + _EXAMPLES]]}
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


def shape_report(cfg: DeduplicationConfig, bands: Optional[int] = None, rows: Optional[int] = None) -> Dict:
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

