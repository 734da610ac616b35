"""Bench cases of one process's training step (`--cases step,compile,precision,stability,masking`), its MFU, the
step's profile (`python -m lit_pretrain.bench.step.profile_step`) and the step on CUDA (`make bench-gpu`)."""
