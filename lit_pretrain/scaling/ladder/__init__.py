"""The ladder: rungs of model sizes by token budgets trained one by one (each a normal training run in its own
folder), a law fitted to the rungs below a compute limit and checked against the rungs above it, and the report.
`lit-pretrain ladder` runs it (run.py); each rung runs in a worker process (worker.py)."""
