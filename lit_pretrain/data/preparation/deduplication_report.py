"""The deduplication report: `deduplication.json` in the prepared folder, `removed.jsonl` beside it (one line per
removed document, fields in lit_pretrain/data/preparation/deduplicate.py), a printed table, and the one-line summary
that `train` shows (also when a prepared folder is reused)."""

import json
import os
from pathlib import Path
from typing import Dict, List

REPORT_FILE = "deduplication.json"
REMOVED_FILE = "removed.jsonl"


def write_report(folder: Path, report: Dict) -> None:
    with open(Path(folder) / REPORT_FILE, "w") as f:
        json.dump(report, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def write_removed(folder: Path, removals: List[Dict]) -> None:
    """`removed.jsonl`: every removed document, one JSON object a line, in corpus order (empty file: none)."""
    with open(Path(folder) / REMOVED_FILE, "w") as f:
        for row in removals:
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_removed(folder: Path) -> List[Dict]:
    with open(Path(folder) / REMOVED_FILE) as f:
        return [json.loads(line) for line in f if line.strip()]


def manifest_entry(report: Dict, tokens_before: int, tokens_after: int) -> Dict:
    """What the shard manifest records of the stage: counts, and tokens before and after (ids + one EOD each, as
    written into shards; the removed documents are encoded with the same tokenizer only to be counted)."""
    return {
        "documents_in": report["documents_in"],
        "documents_out": report["documents_out"],
        "bytes_in": report["bytes_in"],
        "bytes_out": report["bytes_out"],
        "removed_empty": report["empty"]["documents"],
        "removed_exact": report["exact"]["removed_documents"],
        "removed_near": report["near"]["removed_documents"],
        "tokens_before": tokens_before,
        "tokens_after": tokens_after,
        "report": REPORT_FILE,
        "removed_list": REMOVED_FILE,
    }


def dataset_summary(manifest: Dict, params: int, tokens_seen: int) -> Dict:
    """What a run's summary records of its data: the train tokens that survived deduplication (the shards are
    written after it, so every token count of a prepared folder is already deduplicated), tokens per parameter of
    that dataset, epochs seen, and the manifest's deduplication entry (None for folders prepared without one)."""
    train_tokens = manifest["splits"]["train"]["tokens"]
    return {
        "dataset_train_tokens": train_tokens,
        "dataset_tokens_per_param": train_tokens / params,
        "epochs": tokens_seen / train_tokens if train_tokens else None,
        "deduplication": manifest.get("deduplication"),
    }


def summary_line(entry: Dict) -> str:
    """One line from the manifest's entry (older manifests without token counts still print their counts)."""
    line = (f"deduplication: {entry['documents_in']:,} documents in, {entry['documents_out']:,} out "
            f"({entry.get('removed_exact', 0):,} exact, {entry.get('removed_near', 0):,} near duplicates, "
            f"{entry.get('removed_empty', 0):,} empty removed)")
    if entry.get("tokens_before"):
        kept = entry["tokens_after"] / entry["tokens_before"]
        line += f"; tokens {entry['tokens_before']:,} before, {entry['tokens_after']:,} after ({kept:.1%} kept)"
    return line


def format_report(report: Dict) -> str:
    """The report as a table for the terminal."""
    mb = 1e6
    ex, near = report["exact"], report["near"]
    rows: List[str] = [
        "deduplication",
        f"  {'':<24}{'documents':>12}{'MB':>10}",
        f"  {'in':<24}{report['documents_in']:>12,}{report['bytes_in'] / mb:>10.2f}",
        f"  {'empty, dropped':<24}{report['empty']['documents']:>12,}{'':>10}",
    ]
    if "corpus" in report:  # what reading the corpus dropped before this stage saw the documents
        c = report["corpus"]
        rows.append(f"  (reading the corpus replaced {c['invalid_utf8_sequences']:,} invalid UTF-8 sequences in "
                    f"{c['invalid_utf8_documents']:,} documents and dropped {c['dropped_empty']:,} empty ones)")
    rows += [
        f"  {'exact duplicates':<24}{ex['removed_documents']:>12,}{ex['removed_bytes'] / mb:>10.2f}"
        + ("" if ex["enabled"] else "  (off)"),
        f"  {'near duplicates':<24}{near['removed_documents']:>12,}{near['removed_bytes'] / mb:>10.2f}"
        + ("" if near["enabled"] else "  (off)"),
        f"  {'out':<24}{report['documents_out']:>12,}{report['bytes_out'] / mb:>10.2f}",
    ]
    if "tokens_before" in report:
        rows.append(f"  tokens: {report['tokens_before']:,} before, {report['tokens_after']:,} after")
    norm = ex["normalization"]
    rows.append(f"  normalization: NFC, lowercase {norm['lowercase']}, fold_whitespace {norm['fold_whitespace']}")
    if near["enabled"]:
        rows.append(
            f"  MinHash: {near['shingle_size']}-{near['shingle']} shingles, num_perm {near['num_perm']}, seed "
            f"{near['seed']}; LSH {near['bands']} bands × {near['rows']} rows ({near['bands_rows_source']}), "
            f"threshold {near['threshold']}"
        )
        probs = near["candidate_probability"]
        rows.append("  P(candidate | s) = 1-(1-s^r)^b:  " + "  ".join(f"{s} {p:.3f}" for s, p in probs.items()))
        if "candidate_pairs" in near:
            fp = near["false_positive_pairs"]
            rows.append(
                f"  LSH candidate pairs {near['candidate_pairs']:,}, verified {near['verified_pairs']:,}"
                + (f", false positives {fp:,}" if fp is not None else " (not verified)")
                + f"; {near['clusters']:,} clusters; signatures by {near['processes']} process(es), "
                f"{near['signature_bytes'] / mb:.2f} MB; index in {near['index']['storage']}"
            )
            for c in near["largest_clusters"]:
                rows.append(f"    cluster of {c['size']}: keeps {c['kept']}, removes {', '.join(c['removed_examples'])}"
                            + (" ..." if c["size"] - 1 > len(c["removed_examples"]) else ""))
    engine = report.get("engine")  # absent from reports of deduplicate() alone, outside prepare
    where = f" ({engine['name']} engine, {engine['workers']} workers)" if engine else ""
    rows.append(f"  seconds{where}: " + ", ".join(f"{k} {v:.2f}" for k, v in report["seconds"].items()))
    return "\n".join(rows)
