"""Failures on many nodes: a dead, stopped or hung rank ends the job in seconds with one line (watchdog.py), the
local ranks' launcher leaves no process behind (launcher.py), and `run.max_restarts` restarts the job from its
newest verified checkpoint (supervisor.py)."""
