"""What every bench case reports: the median and the spread of its alternations, so runs can be compared.

A case alternates a reference run and a candidate run (reference, candidate, reference, candidate, ...), so a slow
drift of the machine (another process, the page cache, the clock) falls on both sides alike, and each alternation
gives one ratio. The case reports the median of those ratios, which one disturbed run cannot move (the best-of-n
it replaces moved with the single luckiest run), and their spread, max - min: how far runs scatter on this machine,
the size a change must exceed before history.py calls it a change. Pure functions, so tests drive them with tables.
"""

import statistics
from typing import Callable, Dict, List, Sequence, Tuple

# Five alternations: the median then ignores up to two disturbed runs on either side, and the spread of five is a
# usable yardstick for the next run (the bench's rule: median and spread of >= 5 alternations).
ALTERNATIONS = 5


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("no measurement to take the median of")
    return float(statistics.median(values))


def spread(values: Sequence[float]) -> float:
    """max - min (0.0 for one value): the range the measurements covered."""
    if not values:
        raise ValueError("no measurement to take the spread of")
    return float(max(values) - min(values))


def alternate(reference: Callable[[], float], candidate: Callable[[], float],
              alternations: int) -> Tuple[List[float], List[float]]:
    """Call reference() then candidate(), `alternations` times; return both series in call order."""
    if alternations < 1:
        raise ValueError(f"alternations must be >= 1, got {alternations}")
    refs, cands = [], []
    for _ in range(alternations):
        refs.append(reference())
        cands.append(candidate())
    return refs, cands


def summary(refs: Sequence[float], cands: Sequence[float],
            ratio_of: Callable[[float, float], float] = lambda cand, ref: cand / ref) -> Dict:
    """value, reference (medians of each series), ratio and spread (median and range of the per-alternation
    ratio_of(candidate, reference)), and the number of alternations. Pair i's ratio uses the runs of alternation i
    only, so a disturbance that slowed both sides of one alternation cancels in its ratio."""
    if len(refs) != len(cands):
        raise ValueError(f"{len(refs)} reference runs but {len(cands)} candidate runs: alternations come in pairs")
    ratios = [ratio_of(c, r) for c, r in zip(cands, refs)]
    return {"value": median(cands), "reference": median(refs), **_median_spread(ratios)}


def single(values: Sequence[float], ratio_of: Callable[[float], float]) -> Dict:
    """The same fields for a case whose every run yields its own (value, ratio) (e.g. a candidate timed against a
    fixed figure such as the step's tokens/s): medians of the values and of ratio_of(value), the ratios' range."""
    return {"value": median(values), **_median_spread([ratio_of(v) for v in values])}


def _median_spread(ratios: Sequence[float]) -> Dict:
    # One run has no spread to report (0.0 would claim a noiseless machine): the field is left out.
    out = {"ratio": median(ratios), "alternations": len(ratios)}
    return {**out, "spread": spread(ratios)} if len(ratios) > 1 else out
