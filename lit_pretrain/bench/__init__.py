"""Benchmarks (`make bench`): each case is measured against a reference run in the same process, as a ratio.

A subpackage per kind of case, following `--cases`' groups: step/ (one process's training step, its MFU, profile
and the CUDA run), data/, parallel/, moe/, checkpoint/, evaluation/. Here: the runner (__main__), what every case
reports (stats), the history of runs (history) and the torch-free child process some data cases time in (child)."""
