"""How work is split across devices: the parallel plan (planning/plan.py, pure, read when the config loads) applied
to the plain GPT from outside (apply.py `apply_plan`), as torch transforms: tensor, sequence, context, pipeline and
expert parallelism, FSDP2, activation checkpointing, compile and FP8. The Lightning strategies that run them are in
strategy/. Nothing is imported here."""
