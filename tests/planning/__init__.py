"""Tests of lit_pretrain/planning/: the pure planning functions, each against a table of values that states its
convention and source, and against measured runs."""
