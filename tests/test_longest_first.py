"""`make test`'s order for its 2 xdist workers (tests/helpers/longest_first.py): each worker's slice starts with its
share of the long tests, longest first, and the slices keep the sizes worksteal sends."""

from types import SimpleNamespace

from tests.helpers.longest_first import _slice_sizes, order


def items(*names):
    return [SimpleNamespace(nodeid=n) for n in names]


def test_long_tests_head_both_slices_balanced_and_short_ones_keep_their_order():
    tests = items("a1", "a2", "big", "b1", "mid1", "b2", "mid2", "c1", "c2")
    seconds = {"big": 100.0, "mid1": 60.0, "mid2": 45.0, "a1": 0.1, "b2": 4.9}
    got = [i.nodeid for i in order(tests, seconds, workers=2)]
    assert _slice_sizes(9, 2) == [4, 5]  # worksteal: 9 // 2 to the first worker, the rest to the second
    # 100 s alone on one worker; 60 + 45 s on the other; in file order, short tests fill both up to their sizes.
    assert got == ["big", "a1", "a2", "b1", "mid1", "mid2", "b2", "c1", "c2"]
    assert order(tests, seconds, workers=0) == tests  # one process (no xdist): file order


def test_more_long_tests_than_a_slice_holds():
    tests = items("x", "y", "z")
    got = [i.nodeid for i in order(tests, {"x": 10.0, "y": 20.0, "z": 30.0}, workers=2)]
    assert got == ["z", "y", "x"]  # sizes [1, 2]: z alone first; y then x (x, 10 s, as its slice's second)
