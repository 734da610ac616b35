"""ProfileSteps: a PyTorch profiler trace of a few optimizer steps (`trainer.profile: {start_step, steps}`).

Every rank writes its own trace, `<run>/profile/trace-rank<global rank>.json` (Chrome trace format: open it in
chrome://tracing or https://ui.perfetto.dev): under tensor or pipeline parallelism the ranks run different work,
and one rank's trace would hide the others' waits.

The window is whole optimizer steps: it opens when `start_step` steps are completed (trainer.global_step) and closes
when `start_step + steps` are, so it holds the steps metrics.csv numbers start_step + 1 .. start_step + steps (every
step is numbered by the optimizer steps completed with it: lit_pretrain/runs/step_axis.py), all their micro-batches and
anything the Trainer runs between them (validation included). A resumed run that starts inside the window profiles
the rest of it; one that starts after it profiles nothing. The trace is written atomically (a temporary file
renamed over it).
"""

import os
from pathlib import Path
from typing import Optional

import torch
from lightning.pytorch.callbacks import Callback


class ProfileSteps(Callback):
    def __init__(self, run_dir: Path, start_step: int, steps: int):
        if start_step < 0 or steps < 1:
            raise ValueError(f"ProfileSteps: start_step={start_step} must be >= 0 and steps={steps} >= 1")
        self.folder = Path(run_dir) / "profile"
        self.start_step, self.end_step = start_step, start_step + steps
        self._profiler: Optional[torch.profiler.profile] = None
        self.path: Optional[Path] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._profiler is None and self.path is None and self.start_step <= trainer.global_step < self.end_step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._profiler is not None and trainer.global_step >= self.end_step:
            self._write(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._profiler is not None:  # training ended inside the window (max_steps, a stop)
            self._write(trainer)

    def _write(self, trainer) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / f"trace-rank{trainer.global_rank}.json"
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        profiler.export_chrome_trace(str(tmp))
        os.replace(tmp, self.path)
