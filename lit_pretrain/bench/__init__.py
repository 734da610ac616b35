"""Benchmarks (`make bench`): each case is measured against a reference run in the same process, as a ratio."""
