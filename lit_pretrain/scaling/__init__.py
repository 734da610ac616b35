"""Scaling laws and planning: fit laws from runs, compute-optimal plans, per-device memory plans, the CPU sweep.

Pure math lives in `laws.py`, `fit.py`, `memory.py` (the model's counts and shapes in `model/shapes.py`); `cli.py`
parses and prints; `sweep.py` trains.
"""
