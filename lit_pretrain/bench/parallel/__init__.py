"""Bench cases of the parallel layouts on several processes (`--cases strategies,pipeline,compositions`) against one
process on the same global batch."""
