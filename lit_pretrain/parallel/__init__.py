"""How work is split across devices: the plan (plan.py, pure, read when the config loads) and its application to
the plain GPT from outside (apply.py `apply_plan`). Nothing is imported here, so the fast commands (`show`) can
check a plan without importing torch."""
