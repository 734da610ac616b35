"""config → datamodule, module, callbacks, loggers, Trainer → fit → run folder with summary and plots."""

import dataclasses
import importlib.util
import os
import time
import warnings
from pathlib import Path
from typing import Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, Timer
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import DictConfig

from lit_pretrain import config as config_lib
from lit_pretrain.callbacks import build_callbacks, console
from lit_pretrain.callbacks.memory_log import MemoryAccounting, layout_record
from lit_pretrain.callbacks.profile import ProfileSteps
from lit_pretrain.callbacks.stability_report import StabilityReport, format_report
from lit_pretrain.data.datamodule import TokenShardDataModule
from lit_pretrain.data.mixture import MixtureMetrics
from lit_pretrain.data.preparation.deduplication_report import dataset_summary, summary_line
from lit_pretrain.errors import ConfigError
from lit_pretrain.launch.watchdog import WatchdogCallback
from lit_pretrain.launch.world import check_launcher_world
from lit_pretrain.model import shapes
from lit_pretrain.module import PretrainModule, perplexity
from lit_pretrain.optim.stages import describe as describe_schedule
from lit_pretrain.planning.batch import global_batch, plan_line
from lit_pretrain.planning.batch_schedule import schedule_line, step_windows
from lit_pretrain.planning.plan import DEGREE_KEYS, check_vocab, compile_decision, sized_model
from lit_pretrain.resume import session as resume_session
from lit_pretrain.resume import store as checkpoint_store
from lit_pretrain.resume.checkpointing import StepCheckpoint
from lit_pretrain.resume.compat import run_meta as resume_meta
from lit_pretrain.resume.preemption import Interrupted, resume_command
from lit_pretrain.resume.stop import StopRequest
from lit_pretrain.runs import state as run_state
from lit_pretrain.runs.folder import (
    is_primary_process,
    plot_loss_curve,
    read_metrics,
    remove_failed_start,
    series,
    write_summary,
)
from lit_pretrain.schema import Config, TrainerConfig
from lit_pretrain.strategy.build import build_strategy


def setup_process(trainer: TrainerConfig) -> None:
    # Denormal floats made CPU steps 5x slower in measurements here (docs/cpu.md, pitfall 1).
    torch.set_flush_denormal(True)
    threads = trainer.num_threads or max(1, (os.cpu_count() or 1) // trainer.devices)
    torch.set_num_threads(threads)


def checkpoint_layout(c: Config, plan) -> Optional[dict]:
    """The plan as a dict when checkpoints are sharded folders (checkpoint.format; null: sharded on more than one
    process), None for one-file checkpoints (config.check refuses checkpoint.async_save without sharded ones)."""
    fmt = c.checkpoint.format or ("sharded" if plan.world_size > 1 else "single")
    return dataclasses.asdict(plan) if fmt == "sharded" else None


def resolve_vocab(c: Config, tokenizer_vocab: int) -> Config:
    if c.model.vocab_size is None:
        return dataclasses.replace(c, model=dataclasses.replace(c.model, vocab_size=tokenizer_vocab))
    if c.model.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={c.model.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} tokens: "
            "set model.vocab_size=null to take the tokenizer's size"
        )
    return c


def loggers(run_dir: Path, c: Config) -> list:
    """trainer.loggers: csv always (first, and resume reads it), then TensorBoard and Weights & Biases if listed."""
    out = [resume_session.csv_logger(run_dir)]
    names = c.trainer.loggers
    if "tensorboard" in names:
        if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
            out.append(TensorBoardLogger(save_dir=str(run_dir), name="", version="tensorboard",
                                         default_hp_metric=False))
        elif is_primary_process():
            # Listed by default: a plain install has no tensorboard, and `make train` must run without the extras.
            print("trainer.loggers: tensorboard is not installed, so only metrics.csv is written "
                  "(pip install 'lit-pretrain[logging]')", flush=True)
    if "wandb" in names:
        config_lib.check_loggers(names)  # config.load has checked it: here for a caller of loggers() alone
        from lightning.pytorch.loggers import WandbLogger

        # Files under the run folder (wandb/); WANDB_MODE=offline keeps them there, uploaded later by `wandb sync`.
        out.append(WandbLogger(save_dir=str(run_dir), name=c.run.name,
                               project=os.environ.get("WANDB_PROJECT", "lit-pretrain")))
    return out


def train(cfg: "config_lib.Loaded | DictConfig", extra_callbacks: Sequence[Callback] = (),
          started: Optional[float] = None) -> dict:
    """Run one experiment; return its summary (also written to runs/<name>/summary.json). `cfg`: what config.load
    returns (the checked config and its plan); a DictConfig from an older caller is converted and checked the same
    way. `extra_callbacks`: a caller's own (the ladder's, scaling/ladder/rung.py), run before the checkpointing
    ones. `started`: the time.perf_counter() the invocation began, which wall_seconds counts from (the CLI: the
    command's start, lit_pretrain.STARTED); None: now.

    The phases, in order: start the process (what only the launched processes can check), open the run (name,
    folder, checkpoint to resume), prepare the data (and with it the vocabulary and the run's metadata), build the
    module, the callbacks and the Trainer, fit, then the summary."""
    started = time.perf_counter() if started is None else started
    console.quiet()
    c = config_lib.loaded(cfg)
    plan = c.plan
    batch, strategy, compiling = start_process(c, plan)
    # Everything that can be checked is checked before the run folder is made, so a refused start leaves nothing
    # behind that would block its retry: the run name and folder, the checkpoint to resume from, the data (prepared
    # or verified), the batch against the data, the experiment a resume continues, the model and the callbacks.
    session = resume_session.open_run(c.run)
    datamodule, c, run_meta = prepare_data(c, plan, batch, session)
    module = build_module(c, plan, batch.tokens_per_step, datamodule, run_meta, session)
    callbacks = run_callbacks(c, plan, session, run_meta, extra_callbacks, batch.accumulation)
    trainer = build_trainer(c, strategy, callbacks, session.run_dir, batch.accumulation)
    fit(c, (plan, batch, compiling), session, run_meta, module, datamodule, trainer)
    summary = finish(c, session, batch, run_meta, datamodule, module, trainer, callbacks, started)
    resume_session.release(session)
    _leave_agent_process_group()
    if _stepper(callbacks).interrupted:  # Ctrl-C: checkpoint and summary written; the last line says how to go on
        raise Interrupted(trainer.global_step, f"interrupted: checkpoint at step {trainer.global_step} written; "
                          f"resume with: {resume_command()}" if trainer.is_global_zero else "")
    return summary


def start_process(c: Config, plan) -> tuple:
    """This process's settings, and what the plan gives the Trainer: the global batch (the layout only sets the
    accumulation), the Lightning strategy, and why the run compiles or not (the decision the plan's `compile` was
    made with, at load: "auto" weighs the run and the toolchain), to be printed once every check has passed."""
    # Before anything is prepared or made: a launcher that started another world than the config asks for.
    check_launcher_world(c.trainer.devices, c.trainer.num_nodes)
    setup_process(c.trainer)
    compiling = compile_decision(c.trainer, sized_model(c), {k: getattr(plan, k) for k in DEGREE_KEYS})
    return global_batch(c.trainer, c.model.seq_len, plan), build_strategy(c.strategy, c.trainer, plan), compiling


def prepare_data(c: Config, plan, batch, session) -> tuple:
    """The datamodule, prepared (or verified), the config with the tokenizer's vocabulary, and the run metadata
    every checkpoint records; the checks that need the prepared data or the resumed checkpoint run here."""
    datamodule = TokenShardDataModule(c.data, seq_len=c.model.seq_len, micro_batch_size=c.trainer.micro_batch_size,
                                      seed=c.run.seed, val_windows=c.trainer.val_windows,
                                      accumulate_grad_batches=batch.accumulation,
                                      new_mixture="data.sources" in c.run.resume_allow_changes,
                                      batch_schedule=c.trainer.batch_schedule)
    # Prepared here, before the Trainer, because the model's vocabulary size comes from the tokenizer. Under the
    # ddp launcher the other ranks re-run this after rank 0 has prepared, so they only verify and reuse.
    datamodule.prepare_data()
    manifest = datamodule.manifest
    train_windows, _ = datamodule.windows(manifest, plan.data_parallel)
    datamodule.check_mixture(train_windows, c.trainer.max_steps, batch.tokens_per_step // c.model.seq_len)
    datamodule.check_schedule(train_windows, c.trainer.max_steps)
    from_tokenizer = c.model.vocab_size is None
    c = resolve_vocab(c, manifest["tokenizer"]["vocab_size"])
    check_vocab(c.model.vocab_size, plan.tensor_parallel, "tokenizer" if from_tokenizer else None)
    run_meta = resume_meta(dataclasses.asdict(c), manifest, batch.tokens_per_step)
    resume_session.check(session, run_meta, c.run.resume_allow_changes, datamodule.tokenizer_path)
    # Recorded in every checkpoint (run_meta), so a resume inside a stage continues its schedule exactly.
    run_meta["schedule"] = resume_session.schedule_pieces(session, c.schedule, c.optim.lr_peak, c.trainer.max_steps)
    return datamodule, c, run_meta


def build_module(c: Config, plan, tokens_per_step: int, datamodule: TokenShardDataModule, run_meta: dict,
                 session) -> PretrainModule:
    module = PretrainModule(c.model, c.optim, c.schedule, max_steps=c.trainer.max_steps,
                            tokens_per_step=tokens_per_step, seed=c.run.seed, strategy=c.strategy,
                            compile=plan.compile, plan=plan,
                            eod_id=datamodule.eod_id if c.data.document_masking else None,
                            schedule_pieces=run_meta["schedule"], batch_schedule=c.trainer.batch_schedule,
                            batch_schedule_lr=c.trainer.batch_schedule_lr)
    if c.run.init_from is not None and session.checkpoint is None:  # a resumed run's weights are in its checkpoint
        from lit_pretrain.interop.hf import load_init  # needs safetensors (the hf extra): only when asked for

        load_init(module.model, c.run.init_from, datamodule.tokenizer_path)
    return module


def run_callbacks(c: Config, plan, session, run_meta: dict, extra: Sequence[Callback], accumulate: int) -> list:
    """Every callback of the run, in the order their hooks must run: the one place they are built."""
    run_dir = session.run_dir
    callbacks = [
        # First: its on_exception holds a failed collective's error until the watchdog has named the failed rank.
        *([WatchdogCallback(run_dir, c.strategy.peer_failure_timeout_seconds, c.strategy.hang_timeout_seconds)]
          if c.strategy.peer_failure_timeout_seconds > 0 else []),
        Timer(),
        *extra,
        *resume_session.callbacks(session, c.trainer.checkpoint_every_n_steps, c.run.keep_last_checkpoints, run_meta,
                                  c.optim.lr_peak, sharded_layout=checkpoint_layout(c, plan),
                                  async_save=c.checkpoint.async_save),
        # Bytes each rank holds (parameters, gradients, optimizer state, saved activations) → memory.json.
        MemoryAccounting(run_dir, {**layout_record(plan, c.strategy.name),
                                   "activation_checkpointing": c.strategy.activation_checkpointing,
                                   "micro_batch_size": c.trainer.micro_batch_size, "seq_len": c.model.seq_len}),
        *build_callbacks(c),  # the `callbacks` section's: stability, downstream evaluation, the user's own
        *([ProfileSteps(run_dir, c.trainer.profile.start_step, c.trainer.profile.steps)] if c.trainer.profile else []),
        *([MixtureMetrics()] if c.data.sources else []),  # data/<source>/tokens_seen and epochs
    ]
    return callbacks + console.progress_callbacks(c.trainer.progress_bar, refresh_rate=max(1, accumulate),
                                                  log_every_n_steps=c.trainer.log_every_n_steps)


def build_trainer(c: Config, strategy, callbacks: list, run_dir: Path, accumulate: int) -> L.Trainer:
    return L.Trainer(
        accelerator=c.trainer.accelerator, devices=c.trainer.devices, num_nodes=c.trainer.num_nodes,
        strategy=strategy, precision=c.trainer.precision, max_steps=c.trainer.max_steps,
        accumulate_grad_batches=accumulate,
        # Lightning counts validation intervals in micro-batches; ours are optimizer steps.
        val_check_interval=c.trainer.val_every_n_steps * accumulate, check_val_every_n_epoch=None,
        # limit_val_batches left unset: the validation loader is the fixed set (data/validation.py), all of it.
        num_sanity_val_steps=0,
        log_every_n_steps=c.trainer.log_every_n_steps, logger=loggers(run_dir, c), callbacks=callbacks,
        enable_progress_bar=console.has_bar(callbacks), enable_model_summary=False,
        enable_checkpointing=False,  # resume.checkpointing.StepCheckpoint writes the checkpoints
        # Our sampler defines one global order for any number of ranks; Lightning's would replace it.
        use_distributed_sampler=False, default_root_dir=str(run_dir), plugins=resume_session.plugins(run_dir),
    )


def fit(c: Config, layout: tuple, session, run_meta: dict, module: PretrainModule,
        datamodule: TokenShardDataModule, trainer: L.Trainer) -> None:
    """Make the run folder, record the config and a `running` summary, and train; a start that fails is cleaned up
    (its folder removed, or its summary marked failed) before the error goes on. `layout`: (plan, global batch,
    compile decision), printed before the first step."""
    (plan, batch, compiling), run_dir = layout, session.run_dir
    resume_session.make_run_dir(session, c.run)  # on rank 0: new (with its marker), or the resumed one as it is
    start = None
    try:
        resume_session.continue_metrics(session)
        if is_primary_process():
            config_lib.save(c, run_dir / "config.yaml")  # on resume: the config it continues under
            # summary.json says `running` until the run ends (runs/state.py); on resume it replaces the last end's.
            first = checkpoint_store.meta_of(session.checkpoint).get("step", 0) if session.checkpoint else 0
            start = run_state.start_record(c.run.name, first, c.trainer.max_steps)
            write_summary(run_dir, start)
            print(plan_line(plan, batch), flush=True)  # after every check: what the steps will run
            if c.trainer.batch_schedule:
                print(schedule_line(c.trainer.batch_schedule, batch, c.trainer.batch_schedule_lr), flush=True)
            print(describe_schedule(run_meta["schedule"], c.optim.lr_peak, first or None), flush=True)
        with warnings.catch_warnings():
            # CSVLogger warns that the run folder is not empty: it holds our config.yaml, and create_run_dir has
            # already refused to reuse a folder from another run.
            warnings.filterwarnings("ignore", message=".*exists and is not empty.*")
            if is_primary_process():
                print(compiling.note(), flush=True)
            trainer.fit(module, datamodule=datamodule, ckpt_path=session.checkpoint)
    except BaseException as err:
        # A start that failed before any checkpoint or metric was written: remove the folder it made (rank 0 only,
        # confined to run.root_dir, marker checked), so the retry after fixing the cause is not refused.
        if session.created and remove_failed_start(c.run.root_dir, run_dir):
            print(f"removed {run_dir} again: the run failed before writing a checkpoint or a metric", flush=True)
        elif start is not None:  # rank 0, folder kept: its summary says failed, with the error and where to resume
            try:
                write_summary(run_dir, run_state.failed_record(start, trainer.global_step, err, run_dir))
            except OSError:
                pass  # the error that ended the run is the one to report, not this one
        resume_session.release(session)  # after the removal: no other start can have claimed the folder in between
        raise


def _stepper(callbacks: list) -> StepCheckpoint:
    return next(cb for cb in callbacks if isinstance(cb, StepCheckpoint))


def finish(c: Config, session, batch, run_meta: dict, datamodule: TokenShardDataModule, module: PretrainModule,
           trainer: L.Trainer, callbacks: list, started: float) -> dict:
    """How the run ended, its final validation, and the summary: written, plotted and printed on rank 0."""
    # Read before the extra validation below: trainer.validate resets callback_metrics to its own.
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    stepper = _stepper(callbacks)
    stop = stop_request(stepper, trainer, c.trainer.max_steps)
    status = run_state.end_status(trainer.global_step, c.trainer.max_steps, stepper.preempted,
                                  stop.outcome if stop is not None else None)
    if status == run_state.FINISHED and c.trainer.max_steps % c.trainer.val_every_n_steps:
        trainer.validate(module, datamodule=datamodule, verbose=False)  # the final validation loss is always measured
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    timer = next(cb for cb in callbacks if isinstance(cb, Timer))
    summary = run_summary(c, session.run_dir, batch, run_meta["schedule"], datamodule, trainer, timer, metrics,
                          (status, stepper, stop), started)
    if trainer.is_global_zero:
        write_outputs(summary, session.run_dir, trainer, callbacks)
    return summary


def run_summary(c: Config, run_dir: Path, batch, pieces: list, datamodule: TokenShardDataModule, trainer: L.Trainer,
                timer: Timer, metrics: dict, ending: tuple, started: float) -> dict:
    """summary.json's record of the run. `pieces`: the schedule across stages (run_meta["schedule"]); `ending`:
    (status, the StepCheckpoint callback, the stop asked for)."""
    status, stepper, stop = ending
    tokens_per_step, steps, max_steps = batch.tokens_per_step, trainer.global_step, c.trainer.max_steps
    # trainer.batch_schedule: the steps' own batches (tokens_per_step is then the largest, the planned one).
    tokens_seen = step_windows(c.trainer.batch_schedule, 1, tokens_per_step).before(steps)
    # On resume Lightning's Timer restores the training time of earlier sessions: time_elapsed counts all of them,
    # start/end times this session's alone (none when a finished run is resumed and no step runs).
    train_seconds = timer.time_elapsed("train")
    session_start, session_end = timer.start_time("train"), timer.end_time("train")
    session_train_seconds = session_end - session_start if None not in (session_start, session_end) else 0.0
    manifest = datamodule.manifest
    # The whole model's sizes from the architecture table, never one rank's part (tensor, pipeline and expert
    # parallelism and ZeRO-3 each leave a rank a part of the model).
    sizes = shapes.sizes(c.model)
    params = sizes["params"]
    summary = {
        "run": c.run.name,
        **sizes,  # params, non_embedding_params, active_params (model.moe: what one token uses), flops_per_token
        "tokens_seen": tokens_seen,
        "tokens_per_param": tokens_seen / params,
        "tokens_per_step": tokens_per_step,
        "accumulate_grad_batches": batch.accumulation,
        "world_size": trainer.world_size,
        "status": status,  # runs/state.py: running / preempted / failed / finished
        "steps": steps,  # optimizer steps completed (a preempted run: its checkpoint's step)
        "max_steps": max_steps,
        "resume_step": (run_state.resume_step(run_dir)
                        if status != run_state.FINISHED or steps < max_steps else None),
        # optim/stages.py: which schedule the last steps followed (schedule, continued, stage) and from which step
        "schedule": {"how": pieces[-1]["how"], "from_step": pieces[-1]["start"], "pieces": pieces},
        **({"stop_signal": stepper.stop_signal} if status == run_state.PREEMPTED else {}),
        **({"stop_reason": stop.summary_reason()} if stop is not None and not stepper.preempted else {}),
        **({"error": f"training ended at step {steps} of trainer.max_steps={max_steps} "
                     "with no stop asked for"} if status == run_state.FAILED else {}),
        "final_train_loss": metrics.get("train/loss"),
        **({"final_train_mtp_loss": metrics.get("train/mtp_loss")} if c.model.mtp_depth else {}),
        "final_val_loss": metrics.get("val/loss"),
        "val_perplexity": perplexity(metrics["val/loss"]) if "val/loss" in metrics else None,
        "val_bits_per_byte": metrics.get("val/bits_per_byte"),
        # callbacks.ema: the weights' EMA on the same validation windows (callbacks/ema.py)
        **({"final_val_ema_loss": metrics["val/ema_loss"]} if "val/ema_loss" in metrics else {}),
        "unigram_entropy_nats": manifest.get("unigram_entropy_nats"),
        "wall_seconds": time.perf_counter() - started,  # this invocation, start (imports included) to end
        "train_seconds": train_seconds,  # all sessions of the run; tokens_per_second divides tokens_seen by it
        "session_train_seconds": session_train_seconds,  # this invocation's training alone
        "tokens_per_second": tokens_seen / train_seconds if train_seconds > 0 else None,
        **dataset_summary(manifest, params, tokens_seen),
    }
    if c.data.sources:
        summary["sources"] = mixture_summary(c, datamodule, metrics)
    if c.data.packing != "concat":  # data.packing=best_fit: documents, share cut, padding (data/packing.py)
        summary["packing"] = datamodule.packing_stats()
    return summary


def write_outputs(summary: dict, run_dir: Path, trainer: L.Trainer, callbacks: list) -> None:
    """Rank 0: the evaluation time and last logged loss from metrics.csv into the summary, then summary.json, the
    loss curve, the printed report and the stability reports."""
    rows = read_metrics(run_dir / "metrics.csv")
    # Validation and downstream evaluation, summed over the whole run (resumed sessions included): the
    # in-training evaluation's cost, which the throughput figures leave out.
    summary["evaluation_seconds"] = sum(r.get("val/seconds", 0.0) + r.get("eval/seconds", 0.0) for r in rows)
    # train/loss is logged every trainer.log_every_n_steps and at max_steps: a run stopped between those (a
    # signal, a callback) holds a checkpoint of a later step than its last loss, so the summary says whose it is.
    logged = series(rows, "train/loss")
    if logged:
        summary["final_train_loss_step"], summary["final_train_loss"] = logged[-1]
    mtp_logged = series(rows, "train/mtp_loss")  # model.mtp_depth: logged on the same steps as train/loss
    if mtp_logged:
        summary["final_train_mtp_loss"] = mtp_logged[-1][1]
    write_summary(run_dir, summary)
    plot_loss_curve(rows, run_dir / "loss_curve.png", summary["unigram_entropy_nats"])
    report(summary, run_dir)
    for cb in (cb for cb in callbacks if isinstance(cb, StabilityReport) and cb.report is not None):
        print(format_report(cb.report))
    for logger in trainer.loggers:
        if type(logger).__name__ == "WandbLogger":
            logger.experiment.finish()  # else a second train() in this process would log into this run


def _leave_agent_process_group() -> None:
    """Under torchrun (its agent holds the store, not rank 0) each rank destroys its process group once the run has
    ended: a gloo group left to the interpreter's own teardown aborted a torchrun rank after a finished run
    ("terminate called without an active exception", exit -6, so torchrun failed the job), seen once in the suite.
    Not under Lightning's launcher, whose store lives in rank 0's process while the other ranks may still end."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def stop_request(stepper: StepCheckpoint, trainer: L.Trainer, max_steps: int) -> Optional[StopRequest]:
    """The stop a callback asked for (resume/stop.py), or, where one set trainer.should_stop without asking, a
    `stopped` one saying so; None for a run no callback stopped."""
    if stepper.stop is not None or stepper.preempted or not trainer.should_stop or trainer.global_step >= max_steps:
        return stepper.stop
    return StopRequest(run_state.STOPPED, f"a callback set trainer.should_stop at step {trainer.global_step} of "
                                          f"trainer.max_steps={max_steps} without giving a reason (a callback "
                                          "gives one with lit_pretrain.resume.stop.stop_run)")


def mixture_summary(c: Config, datamodule: TokenShardDataModule, metrics: dict) -> dict:
    """Per source: its weights, what training was handed of it, and its validation loss and bits per byte."""
    progress = datamodule.source_progress()
    return {src.name: {"weight": src.weight,
                       "schedule": {p.step: p.weights[src.name] for p in c.data.mixture_schedule
                                    if src.name in p.weights},
                       **progress[src.name],
                       "val_loss": metrics.get(f"val/{src.name}/loss"),
                       "val_bits_per_byte": metrics.get(f"val/{src.name}/bits_per_byte")}
            for src in c.data.sources} | {  # sources an earlier stage named: their position, kept for a later one
        name: {"weight": 0.0, "carried": True, **entry} for name, entry in progress.items()
        if name not in {src.name for src in c.data.sources}}


def timing_line(steps: int, train_seconds: float, tokens_per_second: Optional[float], session_train_seconds: float,
                wall_seconds: float) -> str:
    """The run's time, labelled by scope: training time over all sessions (Lightning's Timer carries it across a
    resume) against this invocation's own training and wall time, so a resumed run never reads as more training
    than time spent."""
    rate = f" ({tokens_per_second:,.0f} tokens/s)" if tokens_per_second else ""
    return (f"{steps} steps, {train_seconds:.1f} s of training in all sessions{rate}; this session "
            f"{session_train_seconds:.1f} s of training, {wall_seconds:.1f} s wall time")


def loss_against_entropy(val_loss: float, entropy: float) -> str:
    """Where the validation loss lies relative to the corpus's unigram entropy, in words that follow the sign.

    Below the entropy (val_loss < entropy) the model uses context beyond token frequencies; above it, it has not yet
    learned even the frequencies. Both are nats/token; equal to 3 decimals reads "level with".
    """
    gap = round(val_loss - entropy, 3)
    where = "level with" if gap == 0 else f"{abs(gap):.3f} nats/token {'above' if gap > 0 else 'below'}"
    return f"the model is {where} it"


def report(summary: dict, run_dir: Path) -> None:
    val, entropy = summary["final_val_loss"], summary["unigram_entropy_nats"]
    print(f"\nrun folder: {run_dir}")
    active = summary.get("active_params", summary["params"])
    print(f"params {summary['params']:,} ({summary['non_embedding_params']:,} non-embedding"
          f"{f'; {active:,} active per token' if active != summary['params'] else ''}), "
          f"{summary['tokens_seen']:,} tokens seen, tokens_per_param {summary['tokens_per_param']:.2f}")
    print(timing_line(summary["steps"], summary["train_seconds"], summary["tokens_per_second"],
                      summary["session_train_seconds"], summary["wall_seconds"]))
    if summary.get("deduplication"):
        print(summary_line(summary["deduplication"]))
    print(f"dataset: {summary['dataset_train_tokens']:,} train tokens after deduplication, dataset_tokens_per_param "
          f"{summary['dataset_tokens_per_param']:.2f}, {summary['epochs']:.2f} epochs of it seen")
    if val is not None and entropy is not None:
        print(f"validation loss {val:.3f} nats/token (perplexity {summary['val_perplexity']:.1f}); unigram entropy "
              f"of the corpus {entropy:.3f} nats/token; {loss_against_entropy(val, entropy)}")
