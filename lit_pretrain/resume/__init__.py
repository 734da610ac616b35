"""Exact resume and fault tolerance: atomic checkpoints with checksums, a `latest` pointer and retention, per-rank
RNG state, config/tokenizer/manifest compatibility checks, preemption by signal, and a metrics file that continues
without duplicate steps. Everything here wraps Lightning from outside; model/ knows nothing of it."""
