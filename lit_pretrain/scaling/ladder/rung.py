"""How one rung runs inside the ladder's process: `lit-pretrain train`'s entry point with the rung's overrides, its
output in its own folder's log, and a ladder signal turned into the run's own checkpoint-and-stop.

Signals. The ladder holds SIGINT and SIGTERM (LadderSignals) from its start to its end: a signal only records that
the ladder must stop, never interrupts a write. Inside a rung's training loop the run's own handler
(resume/preemption.py) takes SIGTERM and checkpoints at the next optimizer-step boundary; a signal the ladder
received instead (SIGINT, or any signal while the rung was starting) is handed to the run as SIGTERM at the next
batch (StopRung), so it ends the same way. The ladder then trains no further rung. A second SIGINT stops at once.

Output. A rung's lines (data, compile decision, memory, progress, report, warnings, and what C++ and child
processes write) go to <root_dir>/<rung>/train.log, appended on each session: file descriptors 1 and 2 point at it
while the rung runs. Its folder is made by train() only after its checks pass, so the lines before that wait in
<root_dir>/.<rung>.train.log and move into the folder's log once it is there (RungOutput); a start refused before
making its folder leaves them to the ladder, which shows them on the console.
"""

import os
import signal
import sys
from pathlib import Path
from typing import Dict, List, Optional

from lightning.pytorch.callbacks import Callback

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class LadderSignals:
    """SIGINT and SIGTERM record a stop (signum) while installed; a second SIGINT raises KeyboardInterrupt."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: Dict[int, object] = {}

    def install(self) -> "LadderSignals":
        try:
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread (an embedding program): its own handlers stay
            self.uninstall()
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.signum = self.signum or signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal"


class StopRung(Callback):
    """Between the ladder and the run's own signal handling, inside the training loop:
    - a stop the ladder recorded is handed to the run as SIGTERM at a batch start, where the run's handler
      (StepCheckpoint's PreemptionFlag, installed at on_train_start) checkpoints at the boundary;
    - a signal the run's handlers take is recorded for the ladder too (each handler then chained after ours, as
      Lightning chains the handler it finds), so a rung that a signal reached stops the ladder even where its last
      step was done before the stop took effect. The run restores its handlers at its end, dropping the chain."""

    def __init__(self, signals: LadderSignals, output: Optional["RungOutput"] = None):
        self.signals, self.output = signals, output
        self.forwarded = self.chained = False

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.output is not None and trainer.is_global_zero:
            self.output.into_folder()  # train() has made (or reopened) the run folder by now

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.chained:
            self.chained = True
            for signum in (*STOP_SIGNALS, signal.SIGUSR1):
                handler = signal.getsignal(signum)
                if callable(handler) and handler != self.signals._handle:
                    signal.signal(signum, self._chain(handler))
        if self.signals.signum is not None and not self.forwarded:
            self.forwarded = True
            signal.raise_signal(signal.SIGTERM)

    def _chain(self, handler):
        def record_then_handle(signum, frame):
            self.signals.signum = self.signals.signum or signum
            self.forwarded = True  # the run's handler has it already
            handler(signum, frame)

        return record_then_handle


class RungOutput:
    """File descriptors 1 and 2 (and sys.stdout/sys.stderr) into the rung's log while in this context."""

    def __init__(self, root: Path, folder: Path):
        self.staging = root / f".{folder.name}.train.log"
        self.log = folder / "train.log"
        self._saved_fds: List[int] = []
        self._saved_streams = None
        self.unplaced = ""
        """The lines of a start refused before its folder was made (no log to hold them)."""

    def __enter__(self) -> "RungOutput":
        self.staging.parent.mkdir(parents=True, exist_ok=True)
        self._flush()
        self._saved_fds = [os.dup(1), os.dup(2)]
        self._saved_streams = (sys.stdout, sys.stderr)
        self._point(self.staging)
        # Writers on the descriptors: where sys.stdout is not fd 1 (pytest's capture), print would miss the log.
        sys.stdout = open(1, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")
        sys.stderr = open(2, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")
        return self

    def into_folder(self) -> None:
        """The staged lines into <folder>/train.log, which receives the rest of the rung's output."""
        if not self.staging.is_file() or not self.log.parent.is_dir():
            return
        self._flush()
        with open(self.log, "ab") as out:
            out.write(self.staging.read_bytes())
        self._point(self.log)
        self.staging.unlink()

    def __exit__(self, *exc) -> None:
        self._flush()
        for fd, saved in zip((1, 2), self._saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
        sys.stdout, sys.stderr = self._saved_streams
        if self.staging.is_file():  # the start ended before its training loop
            if self.log.parent.is_dir():
                with open(self.log, "ab") as out:
                    out.write(self.staging.read_bytes())
            else:  # refused before making its folder: its lines tell why, for the ladder to show
                self.unplaced = self.staging.read_text(errors="replace")
            self.staging.unlink()

    @staticmethod
    def _point(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    @staticmethod
    def _flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


def train_rung(grid, rung: dict, signals: LadderSignals, output: Optional[RungOutput] = None) -> dict:
    """Train one rung through `lit-pretrain train`'s entry point, its output into its folder's log; return its
    summary (of fewer steps than planned when a signal stopped it at a checkpoint)."""
    from lit_pretrain import config as config_lib
    from lit_pretrain.resume.preemption import Interrupted
    from lit_pretrain.scaling.ladder.state import read_summary
    from lit_pretrain.train import train

    root = Path(grid.root_dir)
    folder = root / rung["name"]
    cfg = config_lib.load(grid.run_file, [*grid.overrides, *rung_overrides(grid, rung)])
    with output or RungOutput(root, folder) as out:
        try:
            return train(cfg, extra_callbacks=[StopRung(signals, out)])
        except Interrupted:  # a Ctrl-C the run took: its checkpoint and summary are written, the ladder stops
            return read_summary(folder)


def rung_overrides(grid, rung: dict) -> List[str]:
    """The rung's keys over the grid's: shape, the rules' recipe (ladder_grid.rung_recipe), a WSD schedule with its
    1-sqrt cooldown, checkpoints, seed, the held-out rung's threads; a branch not started yet resumes from its run's
    checkpoint at its branch step."""
    from lit_pretrain.resume.store import step_file
    from lit_pretrain.scaling.ladder.state import checkpointed_step

    shape, folder = rung["shape"], Path(grid.root_dir) / rung["name"]
    out = [
        f"run.name={rung['name']}", f"run.root_dir={grid.root_dir}", f"trainer.precision={grid.precision}",
        f"trainer.max_steps={rung['steps']}", f"model.n_layers={shape['n_layers']}",
        f"model.d_model={shape['d_model']}", f"model.n_heads={shape['n_heads']}",
        f"trainer.micro_batch_size={grid.micro_batch_size or rung['sequences']}",
        f"trainer.tokens_per_step={rung['tokens_per_step']}",
        *(f"model.{k}={shape[k]}" for k in ("n_kv_heads", "d_ff") if k in shape),
        f"optim.lr_peak={rung['lr']!r}", f"optim.beta2={rung['beta2']}", "schedule.kind=wsd",
        "schedule.decay_shape=1-sqrt", f"schedule.decay_fraction={grid.cooldown_fraction}", "schedule.lr_min=0.0",
        f"schedule.warmup_steps={rung['warmup_steps']}",
        f"trainer.checkpoint_every_n_steps={rung['checkpoint_every']}",
        f"run.keep_last_checkpoints={rung['keep_checkpoints']}"]
    if rung.get("seed") is not None:
        out.append(f"run.seed={rung['seed']}")
    if rung["role"] == "held_out" and grid.held_out_threads:
        out.append(f"trainer.num_threads={grid.held_out_threads}")  # it trains alone: ladder_pool.ready
    if rung.get("branch_of") and checkpointed_step(folder) is None:
        # the cooldown of this budget from the longer run's checkpoint at its branch step: only max_steps differs,
        # and the rate up to that step is the constant one either way (optim/schedule.py)
        stem = Path(grid.root_dir) / rung["branch_of"] / "checkpoints" / step_file(rung["branch_step"])
        out += [f"run.resume={stem}", "run.resume_allow_changes=[trainer.max_steps]"]
    else:
        # a folder killed before its first checkpoint holds nothing to resume: run.resume=auto starts it again and
        # keeps the killed attempt's files in its attempts/ folder
        out += ["run.resume=auto", *(["run.resume_allow_changes=[trainer.max_steps]"] if rung.get("branch_of")
                                     else [])]
    return out
