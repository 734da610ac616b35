"""The resume side of `train()`: choose and check the run folder (new, or the one being resumed) and the checkpoint,
make the folder once every check has passed, and build the callbacks, logger and plugin that make checkpoints
complete, atomic and exactly resumable."""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from lightning.pytorch.callbacks import Callback

from lit_pretrain.errors import ConfigError, DataError, RunFolderError
from lit_pretrain.optim import stages
from lit_pretrain.resume import compat, store
from lit_pretrain.resume.checkpoint_io import AtomicCheckpointIO
from lit_pretrain.resume.checkpointing import StepCheckpoint
from lit_pretrain.resume.metrics_csv import ResumableCSVLogger, keep_first_rows
from lit_pretrain.resume.rank_state import RankState
from lit_pretrain.runs.folder import (
    ATTEMPTS,
    Claim,
    check_run_dir,
    claim_run_dir,
    holds_results,
    is_empty,
    is_primary_process,
    is_reusable,
    made_by_this_project,
    refuse_in_use,
    run_dir_path,
)

# Rank 0 resolves run.resume once; the ranks Lightning's ddp launcher starts later inherit its answer, so every
# rank resumes from the same file even if another checkpoint appeared in between.
RESOLVED_ENV = "LIT_PRETRAIN_RESUME_FROM"


@dataclass
class Plan:
    run_dir: Path
    checkpoint: Optional[Path]
    changed: List[str]
    created: bool = False
    """This process made run_dir (so a failed start may remove it again: runs.remove_failed_start)."""
    claim: Optional[Claim] = None
    """This process's hold on run_dir (runs.Claim), from make_run_dir to release."""
    restart: bool = False
    """run.resume=auto in a run folder of ours without a checkpoint: its files go to attempts/<n>/, the run starts
    again there."""


def open_run(run) -> Plan:
    """The run folder and the checkpoint to resume from (None: a fresh run), checked but not yet made: train() makes
    the folder (make_run_dir) only after everything that can be checked without it has passed."""
    run_dir = run_dir_path(run.root_dir, run.name)
    if not is_primary_process():
        resolved = os.environ.get(RESOLVED_ENV)
        return Plan(run_dir, Path(resolved) if resolved else None, [])
    os.environ.pop(RESOLVED_ENV, None)
    refuse_in_use(run_dir)  # a run training there now: refused before resume.auto sets checkpoints aside
    checkpoint = store.resolve(run.resume, run_dir)
    if checkpoint is None:
        if run.resume == "auto" and run_dir.is_dir() and not is_empty(run_dir) and not is_reusable(run_dir) \
                and not run.overwrite:
            if not made_by_this_project(run_dir):
                raise RunFolderError(f"run.resume=auto: run folder {run_dir} holds no checkpoint to resume from and "
                                     "was not made by lit-pretrain: move it away or choose another run.name")
            # Killed before its first checkpoint (a requeued job after a node failure): start again, the earlier
            # attempt's files kept in attempts/<n>/ (make_run_dir moves them, once every check has passed).
            return Plan(run_dir, None, [], restart=True)
        if run.resume is None and not run.overwrite and run_dir.is_dir():
            refuse_existing(run_dir)
        check_run_dir(run.root_dir, run.name, run.overwrite)  # refused now, before any data is prepared
        return Plan(run_dir, None, [])
    if run.overwrite:
        if run_dir.is_dir() and not is_empty(run_dir):
            raise RunFolderError(f"run.resume={run.resume} and run.overwrite=true contradict each other (overwrite "
                                 f"would delete {run_dir}, which the resume continues in): drop one")
        # Nothing there to delete: say so, rather than name a deletion that would not happen.
        state = "is empty" if run_dir.is_dir() else "does not exist yet"
        raise RunFolderError(f"run.overwrite=true has nothing to delete: run folder {run_dir} {state}, and "
                             f"run.resume={run.resume} starts it from that checkpoint: drop run.overwrite")
    if not (run_dir.is_dir() and holds_results(run_dir)):
        check_run_dir(run.root_dir, run.name, overwrite=False)  # a resume into a new run folder (make_run_dir)
    os.environ[RESOLVED_ENV] = str(checkpoint.resolve())
    return Plan(run_dir, checkpoint, [])


def refuse_existing(run_dir: Path) -> None:
    """A fresh start into a run folder that run.resume=auto can go on with: the refusal leads with run.resume=auto and
    what it does there (continue from a checkpoint's step, or start a killed run again: open_run)."""
    folder = run_dir / "checkpoints"
    step = store.resumable_step(folder) if folder.is_dir() else None
    if step is not None:
        raise RunFolderError(f"run.resume=auto continues run folder {run_dir} from its checkpoint at step {step}; "
                             "it already exists: choose another run.name, or set run.overwrite=true to delete it "
                             "and start again")
    if not is_empty(run_dir) and not is_reusable(run_dir) and made_by_this_project(run_dir):
        raise RunFolderError(f"run.resume=auto starts run folder {run_dir} again (it holds no checkpoint: its run was "
                             f"killed or failed before the first one), keeping its files in {run_dir.name}/"
                             f"{ATTEMPTS}/<n>/; it already exists: choose another run.name, or set run.overwrite=true "
                             "to delete it and start again")


def make_run_dir(plan: Plan, run) -> None:
    """On rank 0: a new run folder, or the resumed one as it is, held by this start until release (runs.claim_run_dir:
    of starts at the same moment exactly one gets it). A resume from a file into a run folder holding no results yet
    (a new run.name) makes it like a new run's."""
    if not is_primary_process():
        return
    resume = plan.checkpoint is not None and plan.run_dir.is_dir() and holds_results(plan.run_dir)
    plan.claim = claim_run_dir(run.root_dir, run.name, run.overwrite and plan.checkpoint is None, resume=resume,
                               restart=plan.restart)
    plan.created = not (resume or plan.restart)  # never remove a folder holding an earlier attempt's files
    if plan.restart:
        print(f"run.resume=auto: run folder {plan.run_dir} holds no checkpoint yet (a start killed before its first "
              f"one): starting it again; the earlier attempt's files are kept in {plan.claim.aside}", flush=True)


def release(plan: Plan) -> None:
    """The run folder is free for the next start (this process's hold on it dropped; a process's end drops it too)."""
    if plan.claim is not None:
        plan.claim.release()


def check(plan: Plan, run_meta: Dict, allow: List[str], tokenizer_file: Path) -> None:
    """Refuse a resume that changes the experiment (before the run folder is made or touched)."""
    if plan.checkpoint is None:
        return
    saved = store.meta_of(plan.checkpoint)
    if not all(k in saved for k in ("config", "step", "metrics_rows", "tokenizer_sha256")):
        raise DataError(f"checkpoint {plan.checkpoint} carries no run metadata (it was not written by "
                        "`lit-pretrain train`): resume from a run's checkpoints/step*.ckpt")
    plan.changed = compat.check_resume(saved, run_meta, allow, str(plan.checkpoint), str(tokenizer_file))


def schedule_pieces(plan: Plan, schedule, lr_peak: float, max_steps: int) -> List[Dict]:
    """The learning-rate schedule the run follows (optim/stages.py): its own from step 0, or what the checkpoint
    recorded, continued or with the stage that schedule.stage declares from the checkpoint's step on."""
    if plan.checkpoint is None:
        if schedule.stage is not None:
            raise ConfigError("schedule.stage declares a stage's schedule, which starts from the rate of the "
                              "checkpoint it resumes, but this run starts at step 0 (no checkpoint to resume): set "
                              "run.resume to the previous stage's checkpoint, or drop schedule.stage")
        return stages.start(schedule, lr_peak, max_steps)
    saved = store.meta_of(plan.checkpoint)
    # A checkpoint written before the pieces were recorded: its schedule, from the config it trained with.
    previous = saved.get("schedule") or stages.from_config(saved["config"])
    return stages.resume(previous, saved["step"], schedule, lr_peak, max_steps)


def continue_metrics(plan: Plan) -> None:
    """On rank 0 of a resume, once the run folder is there: cut metrics logged after the checkpoint."""
    if plan.checkpoint is None or not is_primary_process():
        return
    saved = store.meta_of(plan.checkpoint)
    keep_first_rows(plan.run_dir / "metrics.csv", saved["metrics_rows"])
    defaults = [k for k in plan.changed if k in compat.CHANGED_DEFAULTS]  # said apart: not chosen here
    purposed = [k for k in plan.changed if k not in defaults]
    print(f"resuming from {store.describe(plan.checkpoint)}"
          + (f", changed on purpose: {', '.join(purposed)}" if purposed else ""), flush=True)
    for key in defaults:
        old, new = compat.CHANGED_DEFAULTS[key]
        print(f"{key}: the checkpoint trained under the old default {old}, this run goes on under the new one, {new} "
              f"(set {key}={old} to train on as it did)", flush=True)


def callbacks(plan: Plan, every_n_steps: int, keep_last: int, run_meta: Dict, lr_peak: float,
              sharded_layout: Optional[Dict] = None, async_save: bool = False) -> List[Callback]:
    """`sharded_layout`: the parallel plan as a dict when checkpoints are sharded folders (None: one file)."""
    out: List[Callback] = [RankState(), StepCheckpoint(plan.run_dir / "checkpoints", every_n_steps, keep_last,
                                                       run_meta, sharded_layout=sharded_layout,
                                                       async_save=async_save)]
    if "optim.lr_peak" in plan.changed:
        out.append(NewLrPeak(lr_peak))
    elif any(key == "trainer.max_steps" or key.startswith("schedule.") for key in plan.changed):
        out.append(NewSchedule())
    return out


def csv_logger(run_dir: Path) -> ResumableCSVLogger:
    # name="" and version="" put metrics.csv directly in the run folder, not in lightning_logs/version_N.
    return ResumableCSVLogger(save_dir=str(run_dir), name="", version="")


def plugins(run_dir: Path) -> list:
    return [AtomicCheckpointIO(root=run_dir)]


class NewSchedule(Callback):
    """An allowed change of the schedule's shape (trainer.max_steps, schedule.*): the restored optimizer holds the
    rate the old schedule set for the coming step; set the new schedule's (LambdaLR's rate is base rate × the
    factor at its step, and the factor is rebuilt from the config). Without it the first step of a resume runs at
    the old schedule's rate (a ladder's branched cooldown would start one step late)."""

    def on_train_start(self, trainer, pl_module) -> None:
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs,
                                           scheduler.lr_lambdas):
                group["lr"] = base * factor(scheduler.last_epoch)


class NewLrPeak(Callback):
    """An allowed optim.lr_peak change: the restored scheduler holds the old peak as its base rate, so set the new
    one and the rate of the coming step (LambdaLR's rate is base rate × the schedule's factor at its step)."""

    def __init__(self, lr_peak: float):
        self.lr_peak = lr_peak

    def on_train_start(self, trainer, pl_module) -> None:
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            groups = scheduler.optimizer.param_groups
            # A group's own factor (optim.lr_multipliers, μP: optim.param_groups) scales the new peak as the old.
            scheduler.base_lrs = [self.lr_peak * g.get("lr_multiplier", 1.0) for g in groups]
            for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
                group["initial_lr"] = base
                group["lr"] = base * factor(scheduler.last_epoch)
