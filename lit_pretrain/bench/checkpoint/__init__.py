"""Bench cases of checkpoints (`--cases checkpoint`): atomic one-file writes and sharded (DCP) saves."""
