"""Pure planning: the global batch, the parallel plan and its compile and FP8 policies, the pipeline layout, the
dims tensor parallelism splits weights along, per-device memory and recomputation, communication volume, the
compute-optimal split and the run plan, as pure functions of the config. Nothing here imports torch or Lightning:
the config load builds and checks a plan with it before any of them is imported, and every package above reads the
same figures."""
