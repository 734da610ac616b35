"""Bench cases of the mixture-of-experts model (`--cases moe`): its layer and step, and expert parallelism."""
