"""`make bench`'s history: runs/bench/history.jsonl, one JSON line per case per run, appended and never rewritten.

A ratio means little alone (single configurations vary by up to 5% between runs here); against the previous run
of the same case on the same machine it shows a change, and against the spread of the alternations (bench/stats.py)
whether that change is larger than the noise both runs saw. "Same machine" is a fingerprint of what sets the speed:
platform, processor, cores, torch threads, Python and torch versions. The functions here are pure (no timing,
no globals) so tests can drive them with small tables.
"""

import datetime
import hashlib
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

# The case groups of `python -m lit_pretrain.bench --cases ...`, in the order a full run measures them.
CASE_GROUPS = ("step", "compile", "precision", "datamodule", "tokenize", "evaluation", "deduplication",
               "strategies", "pipeline", "compositions", "stability", "checkpoint", "generation", "prepare_memory",
               "mixture", "masking", "data_engines", "moe", "long_context", "shuffle_memory", "loss",
               "variants")


def parse_cases(text: Optional[str], valid: Sequence[str] = CASE_GROUPS) -> List[str]:
    """The chosen case groups in `valid`'s order (all when `text` is empty); ValueError naming the valid ones."""
    if not text:
        return list(valid)
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in valid]
    if unknown or not chosen:
        raise ValueError(f"--cases {','.join(unknown) or repr(text)}: unknown case; expected a comma-separated "
                         f"list of {', '.join(valid)}")
    return [name for name in valid if name in chosen]


def machine_fields(torch_threads: int, torch_version: str) -> Dict:
    """What sets the speed of a CPU run, as recorded in the history."""
    import os

    return {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "torch_threads": torch_threads, "python": platform.python_version(), "torch": torch_version}


def fingerprint(fields: Dict) -> str:
    """A short sha256 of the machine fields (key order does not matter)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def git_commit(cwd: Optional[Path] = None) -> Optional[str]:
    """`git rev-parse HEAD`, or None outside a git checkout or without git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def records(cases: Iterable[Dict], commit: Optional[str], machine: str, date: Optional[str] = None) -> List[Dict]:
    """One history line per measured case."""
    date = date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return [{"date": date, "commit": commit, "machine": machine, "case": case["case"], "value": case["value"],
             "reference": case["reference"], "ratio": case["ratio"],
             **{k: case[k] for k in ("spread", "alternations") if k in case}} for case in cases]


def read(path: Path) -> Tuple[List[Dict], List[str]]:
    """(the parseable lines, one warning per line that is not) of a history file; missing file: nothing."""
    if not path.exists():
        return [], []
    rows, warnings = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("case"), str) or \
                    not isinstance(row.get("ratio"), (int, float)):
                raise ValueError("not a case record")
        except ValueError:
            warnings.append(f"warning: {path}:{number}: not a bench history line, skipped")
            continue
        rows.append(row)
    return rows, warnings


def append(path: Path, new: Iterable[Dict]) -> None:
    """Append lines; the file is opened in "a" mode only, so earlier lines are never rewritten."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in new:
            f.write(json.dumps(row) + "\n")


def previous(rows: Sequence[Dict], case: str, machine: str) -> Optional[Dict]:
    """The last line of `case` measured on `machine`."""
    for row in reversed(rows):
        if row.get("case") == case and row.get("machine") == machine:
            return row
    return None


def moved(ratio: float, spread: Optional[float], prev: Dict) -> Optional[bool]:
    """Whether the ratio moved further than the larger of the two runs' spreads (a change both runs' noise cannot
    explain); None when neither run recorded a spread (lines written before spreads were kept)."""
    spreads = [x for x in (spread, prev.get("spread")) if isinstance(x, (int, float))]
    if not spreads:
        return None
    return abs(ratio - prev["ratio"]) > max(spreads)


def change_line(case: str, ratio: float, prev: Optional[Dict], spread: Optional[float] = None) -> str:
    """`case  ratio 0.970 spread 0.012 (previous 1.020, -4.9%: moved more than its spread)`, `...: within the
    spread)`, or `(no previous run on this machine)`."""
    head = f"{case:<32} ratio {ratio:.3f}" + (f" spread {spread:.3f}" if spread is not None else "")
    if prev is None:
        return f"{head} (no previous run on this machine)"
    before = prev["ratio"]
    change = f"{(ratio - before) / before * 100:+.1f}%" if before else "n/a"
    verdict = {True: ": moved more than its spread", False: ": within the spread", None: ""}[moved(ratio, spread, prev)]
    return f"{head} (previous {before:.3f}, {change}{verdict})"


def record_and_compare(path: Path, cases: Sequence[Dict], commit: Optional[str], machine: str,
                       out=None) -> None:
    """Compare each case with its previous line on this machine, print that, then append this run's lines."""
    out = out or sys.stdout
    rows, warnings = read(path)
    for warning in warnings:
        print(warning, file=sys.stderr)
    for case in cases:
        print(change_line(case["case"], case["ratio"], previous(rows, case["case"], machine), case.get("spread")),
              file=out)
    append(path, records(cases, commit, machine))
    print(f"appended {len(cases)} lines to {path}", file=out)
