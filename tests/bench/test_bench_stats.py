"""bench/stats.py: the median and spread every bench case reports, from tables worked by hand; no benchmark runs."""

import pytest

from lit_pretrain.bench import stats


@pytest.mark.parametrize("values, median, spread", [
    ([3.0], 3.0, 0.0),
    ([1.0, 9.0, 2.0], 2.0, 8.0),  # one disturbed run (9.0) moves the spread, not the median
    ([4.0, 1.0, 3.0, 2.0], 2.5, 3.0),  # even count: the mean of the middle two
    ([1.0, 1.0, 1.0, 1.0, 100.0], 1.0, 99.0),
])
def test_median_and_spread(values, median, spread):
    assert stats.median(values) == median and stats.spread(values) == spread


def test_empty_series_are_refused():
    for f in (stats.median, stats.spread):
        with pytest.raises(ValueError, match="no measurement"):
            f([])


def test_alternate_calls_reference_then_candidate_in_turn():
    calls = []
    refs, cands = stats.alternate(lambda: calls.append("r") or len(calls), lambda: calls.append("c") or len(calls),
                                  3)
    assert calls == ["r", "c", "r", "c", "r", "c"] and refs == [1, 3, 5] and cands == [2, 4, 6]
    with pytest.raises(ValueError, match="alternations must be >= 1"):
        stats.alternate(lambda: 1.0, lambda: 1.0, 0)


def test_summary_pairs_each_candidate_with_its_own_alternation():
    # Alternation 2 ran on a disturbed machine: both sides halved, its ratio is still 1.2. Ratios 1.2, 1.2, 1.0:
    # median 1.2, spread 0.2 (a ratio of medians would read 12/10 = 1.2 here too, but pairs cancel drift).
    refs, cands = [10.0, 5.0, 10.0], [12.0, 6.0, 10.0]
    assert stats.summary(refs, cands) == pytest.approx(
        {"value": 10.0, "reference": 10.0, "ratio": 1.2, "spread": 0.2, "alternations": 3})
    # A time's ratio is reference / candidate when the case reports a speed-up.
    assert stats.summary([2.0, 4.0], [1.0, 1.0], ratio_of=lambda c, r: r / c)["ratio"] == 3.0
    with pytest.raises(ValueError, match="alternations come in pairs"):
        stats.summary([1.0], [1.0, 2.0])


def test_single_takes_the_median_and_range_of_each_runs_ratio():
    out = stats.single([100.0, 300.0, 200.0], lambda v: v / 100)
    assert out == {"value": 200.0, "ratio": 2.0, "spread": 2.0, "alternations": 3}


def test_one_run_reports_no_spread():
    assert stats.summary([2.0], [3.0]) == {"value": 3.0, "reference": 2.0, "ratio": 1.5, "alternations": 1}
