"""lit-pretrain: a Lightning codebase for pretraining language models from random initialization."""

import time as _time

STARTED = _time.perf_counter()
"""When this process first imported the package (time.perf_counter): a command's start, before it imports torch and
Lightning (`python -m lit_pretrain.cli` imports the package first); `train`'s wall_seconds counts from it."""

__version__ = "0.1.0"

from lit_pretrain import moved as _moved  # noqa: E402  (after STARTED: the start time is taken first)

_moved.install()  # old module names answer with their new ones (moved.py)
