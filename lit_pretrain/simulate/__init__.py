"""`lit-pretrain simulate`: a run file's training step at its real world size on this machine, on torch's fake
process group with tensors that hold no memory (engine.py), its collectives counted (collectives.py), its memory
and collectives set beside the planners' (report.py), and the check that the run would start (start_check.py).
docs/large-runs.md."""
