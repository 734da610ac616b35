"""Scaling laws fitted to runs, and the experiments that produce the runs: fits of L(N, D) (fit.py, fit_runs.py,
points.py, lbfgs.py, plots.py), the optimal step count (steps_optimum.py), GPU-hours, the `fit | plan | memory`
commands (cli.py), the CPU sweep (sweep.py), ablations (ablate.py) and the ladder (ladder/). The published laws, the
compute-optimal split and the memory planner they read are pure planning, in planning/."""
