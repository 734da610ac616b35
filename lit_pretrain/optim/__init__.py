"""The optimizer side of a step: the optimizers and their parameter groups (optimizers.py), the learning-rate
schedules (schedule.py) and StepGuard (step_guard.py), what one step knows between its backward pass and its
update: the gradient norm, whether the update was dropped and why, the clipping."""
