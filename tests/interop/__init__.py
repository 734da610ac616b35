"""Tests of lit_pretrain/interop/: each file tests one module or one behaviour of that package, with tiny models on
CPU and gloo for more than one process."""
