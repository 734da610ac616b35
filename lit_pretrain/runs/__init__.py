"""Run folders: making one (folder.py), its state in summary.json (state.py), the one meaning of "step" in its
metrics rows (step_axis.py), and reading folders back without torch or Lightning: `lit-pretrain runs` (table.py)
and `compare` (compare.py)."""
