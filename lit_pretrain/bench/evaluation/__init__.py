"""Bench cases of using the model (`--cases evaluation,generation`): in-training evaluation's share, KV-cached
generation."""
