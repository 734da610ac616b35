"""StepCheckpoint: checkpoints at optimizer-step boundaries, every `every_n_steps` and on preemption.

A checkpoint is taken only where an optimizer step has just finished (at the start of the next batch, where step k's
metrics are logged and its validation has run, or at the end of training), so it never holds half an accumulation;
a run killed mid-accumulation resumes from the last boundary and redoes the partial step from the same data. Each
save: loggers are flushed first (so the metrics of every step up to the checkpoint are on disk), then the file is
written through the strategy's checkpoint_io (AtomicCheckpointIO), then rank 0 publishes it (`last.ckpt`,
`latest`) and applies retention.

With the sharded format (`sharded_layout` given: checkpoint.format) every rank writes its share into the folder
`step0000012/` (resume/sharded/save.py ShardedSaver: through a hidden staging folder renamed once complete); rank 0
publishes after the manifest, from the writer's thread when `async_save`, and the next save, the end of training
and a preemption wait for that write.

No checkpoint holds weights that are not finite: every save checks the parameters first (on every rank, agreed)
and writes nothing when one is NaN or infinite, so `latest` keeps naming the newest finite one. A stop asked for
by a callback (resume/stop.py) is recorded here (`stop`); a diverged run's (a stability callback's) sets aside
the checkpoints written after its last healthy step and writes none of the weights it stopped with, unless they
are that step's, so `latest` and `last.ckpt` name the last healthy checkpoint, or nothing.
"""

import shutil
import signal
from pathlib import Path
from typing import Dict, List, Optional

from lit_pretrain.errors import DiskFullError
from lit_pretrain.internals import batches_completed_in_epoch, saved_batch_progress, saved_epoch_loop_state
from lit_pretrain.resume import store
from lit_pretrain.resume.metrics_csv import ResumableCSVLogger, data_rows
from lit_pretrain.resume.preemption import PreemptionFlag, requeue_slurm_job
from lit_pretrain.resume.stop import StopRecorder, StopRequest, parameters_finite
from lit_pretrain.resume.verified import DISK_FULL, META_KEY
from lit_pretrain.runs.state import DIVERGED


class StepCheckpoint(StopRecorder):
    def __init__(self, folder: Path, every_n_steps: int, keep_last: int, run_meta: Dict,
                 handle_signals: bool = True, sharded_layout: Optional[Dict] = None, async_save: bool = False):
        self.folder, self.every_n_steps, self.keep_last = Path(folder), every_n_steps, keep_last
        self.run_meta = run_meta
        self.flag = PreemptionFlag() if handle_signals else None
        self._checked_step: Optional[int] = None
        self._saved_step: Optional[int] = None
        self._at_boundary = True
        self.preempted = False
        """A signal stopped the run at a checkpoint (summary.json's status `preempted`: run_state.py)."""
        self.interrupted = False
        """The stop was a Ctrl-C (SIGINT) on any rank: train() then ends with the command that resumes, exit 130."""
        self.stop_signal: Optional[str] = None
        """The signal's name as this rank received it; None when another rank's signal stopped this one."""
        self.stop: Optional[StopRequest] = None
        """The stop a callback asked for (resume/stop.py; the first one counts), or the one this callback records
        when the weights at the end of training are not finite."""
        self.not_finite_steps: List[int] = []
        """Steps whose checkpoint was not written because a parameter was NaN or infinite."""
        self._metrics_rows = 0
        self._due = False  # a periodic checkpoint postponed from an epoch's first batch
        self._in_flight = 0
        self.sharded_layout = sharded_layout
        self.saver = None
        if sharded_layout is not None:
            from lit_pretrain.resume.sharded.save import ShardedSaver

            self.saver = ShardedSaver(async_save)

    def on_train_start(self, trainer, pl_module) -> None:
        self._checked_step = self._saved_step = trainer.global_step
        if self.flag is not None:
            self.flag.install()  # after Lightning registered its own handlers at the start of fit

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._at_boundary = trainer.global_step != self._checked_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # The first batch after an optimizer step: step k's metrics are logged, its validation has run, and the
        # batch about to be trained is not counted as trained (in_flight). Lightning's own loop state treats a
        # checkpoint taken here as "batch not started", so a resume starts with this very batch.
        step = trainer.global_step
        if step == self._checked_step:
            return  # mid-accumulation
        if batches_completed_in_epoch(trainer) == 0:
            return  # the first batch of an epoch: checked at the next boundary (see on_save_checkpoint)
        self._checked_step = step
        signalled = self.flag is not None and self.flag.signum is not None
        # Any rank's signal stops every rank (one all-reduce per optimizer step).
        preempt = trainer.strategy.reduce_boolean_decision(signalled, all=False)
        self._due = self._due or (self.every_n_steps > 0 and step % self.every_n_steps == 0)
        if preempt or self._due:
            self.save(trainer, step, in_flight=1)
            self._due = False
        if preempt:
            self.wait()  # the checkpoint is on disk before the process exits
            self.preempted = True
            # A terminal's Ctrl-C reaches every local rank, a `kill -INT` perhaps one: any rank's decides.
            ctrl_c = self.flag is not None and self.flag.signum == signal.SIGINT
            self.interrupted = trainer.strategy.reduce_boolean_decision(ctrl_c, all=False)
            self.stop_signal = (signal.Signals(self.flag.signum).name
                                if self.flag is not None and self.flag.signum is not None else None)
            trainer.should_stop = True
            if trainer.is_global_zero and not self.interrupted:  # after Ctrl-C, train() prints the way back
                written = "not written (not finite)" if step in self.not_finite_steps else "written"
                print(f"preemption: checkpoint at step {step} {written}, stopping", flush=True)
                requeue_slurm_job()

    def on_train_end(self, trainer, pl_module) -> None:
        if self.flag is not None:
            self.flag.uninstall()
        diverged = self.stop is not None and self.stop.outcome == DIVERGED
        if diverged:
            self.wait()  # a write under way is published before anything is set aside
            if self.stop.healthy_step is not None and trainer.is_global_zero:
                store.withdraw_after(self.folder, self.stop.healthy_step)
            trainer.strategy.barrier("withdraw_diverged")
        # The run's last step (max_steps, or a stop): saved unless the run stopped mid-accumulation, where the
        # partial step would not be resumable (the previous checkpoint stands then), or its weights diverged.
        healthy = not diverged or self.stop.healthy_step == trainer.global_step
        if self._at_boundary and trainer.global_step != self._saved_step and not self.preempted and healthy:
            self.save(trainer, trainer.global_step, in_flight=0)
            if trainer.global_step in self.not_finite_steps and self.stop is None:
                self.stop = StopRequest(DIVERGED, f"the parameters at step {trainer.global_step} are not finite "
                                                  "(callbacks.nan_guard would have stopped the run sooner)")
        self.wait()
        if self.stop is not None and self.stop.outcome == DIVERGED:
            self.stop.checkpoint_note = self.healthy_note()
            if trainer.is_global_zero:
                print(f"diverged: {self.stop.summary_reason()}", flush=True)

    def healthy_note(self) -> str:
        """Which checkpoint a diverged run continues from: the one `latest` names now (the last healthy one)."""
        latest = store.latest_path(self.folder)
        if latest is None or not latest.exists():
            return ("no checkpoint holds healthy weights: fix the cause, then start the run again with "
                    "run.overwrite=true")
        return (f"the last healthy checkpoint is {self.folder.name}/{latest.name} (step {store.step_of(latest)}), "
                "which `latest` names and run.resume=auto continues from")

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.wait()  # a write under way completes (its manifest last), so the run stops at a consistent point

    def wait(self) -> None:
        """Block until a background sharded write has written its manifest and been published."""
        if self.saver is not None:
            self.saver.wait()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: Dict) -> None:
        if self._in_flight:
            as_saved_at_previous_batch_end(checkpoint["loops"]["fit_loop"])
        loader = getattr(trainer.datamodule, "train_loader", None) if trainer.datamodule is not None else None
        if not self._in_flight and loader is not None and loader.mid_epoch():
            # The run's last checkpoint (max_steps): Lightning has counted the epoch as done, so a run continued from
            # it (more max_steps, a context-extension stage) would start the next epoch and skip the rest of this
            # one's data. Counted as not done, the continuation reads on from the next unseen window.
            as_mid_epoch(checkpoint)
        checkpoint[META_KEY] = {"step": trainer.global_step, "world_size": trainer.world_size,
                                "metrics_rows": self._metrics_rows, **self.run_meta}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: Dict) -> None:
        # Before Lightning restores its loops. Lightning counts micro-batches (the accumulation's phase, the
        # validation interval, the epoch's end), and a checkpoint holds them in the micro-batches of the layout that
        # wrote it; this run may split a step otherwise (other devices or micro_batch_size: another accumulation) or
        # cut other windows (a context-extension stage: model.seq_len). Counted again from what every layout shares,
        # the optimizer steps and the loader's global position, they are this run's.
        datamodule = trainer.datamodule
        fit_loop = checkpoint.get("loops", {}).get("fit_loop")
        states = (fit_loop or {}).get("state_dict", {}).get("combined_loader") or []
        if datamodule is None or len(states) != 1 or "trained_samples" not in states[0]:
            return
        from lit_pretrain.data.train_loader import remap_to_window

        _, world_size = datamodule.rank_and_world_size()
        samples = remap_to_window(states[0], datamodule.seq_len)["trained_samples"]
        steps = checkpoint.get(META_KEY, {}).get("step", checkpoint.get("global_step", 0))
        as_micro_batches_done(fit_loop, samples // (datamodule.micro_batch_size * world_size),
                              steps * trainer.accumulate_grad_batches)
        progress = saved_batch_progress(fit_loop)
        if META_KEY in checkpoint and progress["current"]["ready"] == progress["current"]["completed"] + 1:
            # One of ours taken at the start of a batch (as_saved_at_previous_batch_end's form): that batch follows,
            # so the batch before it was not the epoch's last. Checkpoints written before that function cleared the
            # flag hold it true at an epoch's last batch; cleared here, they resume that batch from its own epoch.
            progress["is_last_batch"] = False

    def save(self, trainer, step: int, in_flight: int) -> None:
        if not parameters_finite(trainer, trainer.lightning_module.parameters()):
            self.not_finite_steps.append(step)
            if trainer.is_global_zero:
                latest = store.latest_path(self.folder)
                print(f"checkpoint of step {step} not written: a parameter is NaN or infinite; `latest` stays at "
                      f"{f'step {store.step_of(latest)}' if latest is not None else 'none'}", flush=True)
            return
        path = self.folder / (store.step_dir(step) if self.saver is not None else store.step_file(step))
        try:
            self._save(trainer, step, path, in_flight)
        except OSError as err:
            if err.errno not in DISK_FULL:
                raise
            raise disk_full_error(err, path, self.folder) from None  # one line, no traceback (cli.py)

    def _save(self, trainer, step: int, path: Path, in_flight: int) -> None:
        for logger in trainer.loggers:
            logger.save()  # metrics up to here on disk before the checkpoint that a resume continues them from
        # Rank 0's count is the one written (Lightning saves rank 0's checkpoint dict).
        self._metrics_rows = sum(data_rows(lg.metrics_path()) for lg in trainer.loggers
                                 if isinstance(lg, ResumableCSVLogger) and trainer.is_global_zero)
        loader = getattr(trainer.datamodule, "train_loader", None) if trainer.datamodule is not None else None
        if loader is not None:
            loader.in_flight = in_flight
        self._in_flight = in_flight
        try:
            if self.saver is not None:
                publish = (lambda: self.publish(path)) if trainer.is_global_zero else None
                self.saver.save(trainer, path, step, self.sharded_layout, on_complete=publish)
            else:
                trainer.save_checkpoint(path, weights_only=False)  # a full checkpoint, said explicitly
        finally:
            self._in_flight = 0
            if loader is not None:
                loader.in_flight = 0
        self._saved_step = step
        if self.saver is None and trainer.is_global_zero:
            self.publish(path)
        trainer.strategy.barrier("step_checkpoint")

    def publish(self, path: Path) -> None:
        """On rank 0, once `path` is complete: `latest` (and last.ckpt for a file), then retention."""
        store.publish(self.folder, path)
        store.retain(self.folder, self.keep_last)


def disk_full_error(err: OSError, path: Path, folder: Path) -> DiskFullError:
    """The one line of a checkpoint write that ran out of space: the file, the bytes it needs (its tensors; else the
    newest checkpoint's size) and those free, the newest complete checkpoint (`latest`: the write was atomic, so it
    is untouched) and the fix."""
    latest = store.latest_path(folder)
    needed = getattr(err, "needed_bytes", None) or (store.size_of(latest) if latest is not None else None)
    free = shutil.disk_usage(folder).free
    newest = f"{latest} (step {store.step_of(latest)})" if latest is not None else "none yet"
    return DiskFullError(
        err.errno, f"disk full while writing {err.filename or path}: it needs about "
        f"{f'{needed:,} bytes' if needed else 'more space'}, {free:,} bytes are free; the newest complete checkpoint "
        f"is {newest}: free space, keep fewer checkpoints (run.keep_last_checkpoints), or set another run.root_dir, "
        "then resume with run.resume=auto")


def as_saved_at_previous_batch_end(fit_loop: Dict) -> None:
    """Rewrite Lightning's loop counters, taken at the start of batch j (ready = j + 1, completed = j), to those of a
    checkpoint taken at the end of batch j - 1 (ready = started = processed = j, completed = j - 1, one fewer
    batch that stepped), the point Lightning's restart logic is written for (ModelCheckpoint saves there): it then
    completes batch j - 1, counts the step once, and does not run again a validation that already ran.
    Needs j >= 1 within the epoch, hence no checkpoint at an epoch's first batch.

    `is_last_batch` too: Lightning set it when it fetched batch j, so it is true at the start of an epoch's last batch,
    but batch j - 1 was not the last; left true, the restart would count epoch e as finished after batch j - 1
    (FitLoop.reset), give the sampler epoch e + 1 and train batch j from that epoch's order, then start epoch e + 2."""
    progress = saved_batch_progress(fit_loop)
    for part in ("total", "current"):
        counts = progress[part]
        done = counts["completed"]
        counts.update(ready=done, started=done, processed=done, completed=done - 1)
    progress["is_last_batch"] = False  # batch j follows
    saved_epoch_loop_state(fit_loop)["_batches_that_stepped"] -= 1


def as_mid_epoch(checkpoint: Dict) -> None:
    """Rewrite Lightning's epoch counters of a checkpoint taken after max_steps ended the epoch loop (epoch ready =
    started = processed = completed = e + 1) to those of one taken inside epoch e (processed = completed = e), as a
    ModelCheckpoint at a batch's end has them: a restart then continues epoch e after its last completed batch."""
    progress = checkpoint["loops"]["fit_loop"]["epoch_progress"]
    for part in ("total", "current"):
        counts = progress[part]
        if counts["completed"] == counts["ready"] and counts["completed"] > 0:
            counts.update(processed=counts["completed"] - 1, completed=counts["completed"] - 1)
    checkpoint["epoch"] = progress["current"]["completed"]


def as_micro_batches_done(fit_loop: Dict, micro_batches: int, total_micro_batches: int) -> None:
    """Shift Lightning's counts of micro-batches (ready, started, processed, completed, in the form the checkpoint
    has them) so that `ready` is `micro_batches` in this epoch and `total_micro_batches` in the run: the position of
    the checkpoint in this run's micro-batches. Lightning steps the optimizer when this epoch's `ready` is a multiple
    of the accumulation, validates when the run's `ready` is a multiple of the validation interval (counted in
    micro-batches, train.py) and ends an epoch when this epoch's `ready` reaches the loader's length; counts carried
    over in the micro-batches of another layout would step mid-accumulation, validate at other steps, or end the
    epoch early or late."""
    progress = saved_batch_progress(fit_loop)
    for part, target in (("current", micro_batches), ("total", total_micro_batches)):
        counts = progress[part]
        shift = target - counts["ready"]
        for key in ("ready", "started", "processed", "completed"):
            counts[key] += shift
