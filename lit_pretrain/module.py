"""PretrainModule: the GPT, its loss (and optim.z_loss), the optimizer with a warmup schedule, and gradient clipping by
global norm."""

import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import lightning as L
import torch

from lit_pretrain.errors import ConfigError
from lit_pretrain.model import losses
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.model.moe import end_step
from lit_pretrain.optim import stages
from lit_pretrain.optim.named_state import is_named, read_named, single_process_names, to_named, to_positions
from lit_pretrain.optim.optimizers import build_optimizer
from lit_pretrain.optim.step_guard import StepGuard
from lit_pretrain.parallel.apply import apply_plan, one_process
from lit_pretrain.parallel.batch_losses import StepLosses
from lit_pretrain.planning.batch_schedule import entries, lr_factor, step_windows
from lit_pretrain.planning.plan import ParallelPlan
from lit_pretrain.resume.sharded.save import SHARDED_KEY
from lit_pretrain.resume.verified import sidecar_path, verify
from lit_pretrain.resume.weights import from_plain, route_moved
from lit_pretrain.runs.step_axis import log_at_steps_completed
from lit_pretrain.schema import OptimConfig, ScheduleConfig, StrategyConfig


class PretrainModule(L.LightningModule):
    """Next-token prediction on token windows. `tokens_per_step` is the global count per optimizer step.

    The configs may be given as dataclasses or as their plain dicts: the hyperparameters saved in a checkpoint are
    plain data (dataclasses.asdict), which `torch.load(weights_only=True)` reads and `load_from_checkpoint` passes
    back here.
    """

    def __init__(self, model_cfg: GPTConfig | dict, optim: OptimConfig | dict, schedule: ScheduleConfig | dict,
                 max_steps: int, tokens_per_step: int, seed: Optional[int] = None,
                 strategy: Optional[StrategyConfig | dict] = None, compile: bool = False,
                 plan: Optional[ParallelPlan] = None, eod_id: Optional[int] = None,
                 schedule_pieces: Optional[list] = None, batch_schedule: Optional[list] = None,
                 batch_schedule_lr: str = "none"):
        super().__init__()
        model_cfg, strategy = route_moved(model_cfg, strategy)  # a checkpoint's, written before they moved
        model_cfg, optim = from_plain(GPTConfig, model_cfg), from_plain(OptimConfig, optim)
        schedule, strategy = from_plain(ScheduleConfig, schedule), from_plain(StrategyConfig, strategy or {})
        batch_schedule_plain = [{"at_step": at, "tokens_per_step": n} for at, n in entries(batch_schedule or [])]
        # logger=False: the run's config.yaml already records them; loggers would get a second, partial copy.
        self.save_hyperparameters({
            "model_cfg": asdict(model_cfg), "optim": asdict(optim), "schedule": asdict(schedule),
            "max_steps": max_steps, "tokens_per_step": tokens_per_step, "seed": seed, "strategy": asdict(strategy),
            "compile": compile, "eod_id": eod_id, "schedule_pieces": schedule_pieces,
            "batch_schedule": batch_schedule_plain, "batch_schedule_lr": batch_schedule_lr}, logger=False)
        self.model_cfg, self.optim_cfg, self.schedule_cfg = model_cfg, optim, schedule
        self.strategy_cfg = strategy
        self.max_steps, self.tokens_per_step, self.compile_blocks = max_steps, tokens_per_step, compile
        # trainer.batch_schedule (planning/batch_schedule.py): the tokens of each step, and the rate's factor for it.
        self.batch_schedule, self.batch_schedule_lr = batch_schedule_plain, batch_schedule_lr
        self.step_tokens = step_windows(batch_schedule_plain, 1, tokens_per_step)
        # data.document_masking: the end-of-document id the documents of a window are told apart by; None keeps
        # attention across the whole window (the default, and what checkpoints written before it meant).
        self.eod_id = eod_id
        # The schedule across stages (optim/stages.py: train.py builds it from the config and the checkpoint resumed);
        # None: `schedule` over max_steps from step 0.
        self.schedule_pieces = schedule_pieces or stages.start(schedule, optim.lr_peak, max_steps)
        if seed is not None:
            torch.manual_seed(seed)  # the initial weights depend on the run seed alone, not on what ran before
        self.model = GPT(model_cfg)
        self.step_guard = StepGuard()
        """This optimizer step's pre-clip norm, dropped update and clipping, read by the stability callbacks."""
        # The config's plan (config.load builds it, train.py hands it here); none given (a module built by hand, or
        # loaded from a checkpoint with no Trainer): one process.
        self._plan = plan if plan is not None else ParallelPlan()
        self.parallel = one_process(self.model)  # until configure_model applies the plan (parallel/apply.py)

    @property
    def plan(self) -> ParallelPlan:
        """How this module is split: the plan given, else one process. Compile comes from this module's own setting
        (trainer.compile), which train.py gives the plan as well; activation checkpointing and FP8 are the plan's own
        (strategy.activation_checkpointing*, trainer.float8)."""
        return replace(self._plan, compile=self.compile_blocks)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None,
                             weights_only=None, **kwargs):
        """Lightning's load, weights-only always, after the file is checked against its sha256 sidecar when it has
        one (a plain Lightning Trainer writes none: pass `plugins=[AtomicCheckpointIO()]` to it for one), or a
        sharded checkpoint folder, verified and read whole (resume/sharded/save.py). The module comes
        back unwrapped, on one process, whatever strategy wrote the checkpoint."""
        if weights_only is False:
            raise ValueError("PretrainModule.load_from_checkpoint reads checkpoints weights-only (they hold plain "
                             "data); drop weights_only=False")
        if isinstance(checkpoint_path, (str, Path)) and Path(checkpoint_path).is_dir():
            import io

            from lit_pretrain.resume.sharded.save import as_single_checkpoint

            buffer = io.BytesIO()  # Lightning's load reads a file or a buffer: the folder as one file, in memory
            torch.save(as_single_checkpoint(Path(checkpoint_path)), buffer)
            buffer.seek(0)
            checkpoint_path = buffer
        elif isinstance(checkpoint_path, (str, Path)) and sidecar_path(checkpoint_path).exists():
            verify(checkpoint_path)
        return super().load_from_checkpoint(checkpoint_path, map_location=map_location, hparams_file=hparams_file,
                                            strict=strict, weights_only=True, **kwargs)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def configure_model(self):
        if self._trainer is None:
            return  # load_from_checkpoint calls this hook with no Trainer (no mesh): the plain GPT holds every weight
        # The one place the plan is applied (parallel.apply.apply_plan: pipeline split, tensor/sequence parallelism,
        # activation checkpointing, compile, FSDP), on the strategy's mesh: our 4-D one (MeshStrategy) or Lightning's
        # data-parallel one (plain ZeRO 2/3).
        plan, mesh = self.plan, self.device_mesh
        device_type = self._trainer.strategy.root_device.type  # trainer.float8: fp8 matmuls on CUDA, else emulated
        if plan.uses_mesh:
            self.parallel = apply_plan(self.model, plan, mesh, device_type=device_type)
        else:
            fsdp_mesh = mesh["data_parallel"] if mesh is not None and plan.uses_fsdp else None
            self.parallel = apply_plan(self.model, plan, fsdp_mesh=fsdp_mesh, device_type=device_type)

    def setup(self, stage: str) -> None:
        if self._trainer is not None:
            # Every row this module and the callbacks log is tagged with the optimizer steps completed, the step of
            # checkpoint names and summary.json (Lightning's own tag is one less during fit).
            log_at_steps_completed(self._trainer)
        # Refused rather than honoured: this module clips by the global norm of the whole (under FSDP, sharded)
        # gradient in configure_gradient_clipping, and the gradient-norm monitor reports clipping against
        # optim.grad_clip_norm. Honouring Lightning's argument as well would give one threshold two sources that
        # can disagree, and its gradient_clip_algorithm="value" clamps each value, which this module never does.
        clip = self._trainer.gradient_clip_val if self._trainer is not None else None
        if stage == "fit" and clip is not None:
            raise ConfigError(
                f"lightning.Trainer(gradient_clip_val={clip}) is not used by PretrainModule, which clips by the "
                f"global gradient norm in optim.grad_clip_norm (now {self.optim_cfg.grad_clip_norm}): set "
                f"optim.grad_clip_norm={clip} (0 turns clipping off) and leave gradient_clip_val unset"
            )

    def loss(self, batch) -> torch.Tensor:
        """The task loss of `batch` (mean next-token cross-entropy over the predicted targets)."""
        return self.losses(batch)[0]

    def losses(self, batch):
        """(task loss, z-loss) of `batch`; the z-loss is None with optim.z_loss = 0."""
        out = self.step_losses(batch)
        return out.task, out.z

    def step_losses(self, batch) -> StepLosses:
        """The one loss path, whatever the layout: the parallel model's (parallel/batch_losses.py). Under pipeline
        parallelism, when training, the schedule has already run the backward of `trained` (`backward` below)."""
        return self.parallel.losses(batch, self.optim_cfg.z_loss, self.eod_id, training=self.training)

    def on_fit_start(self):
        # The one place the guard's norm is chosen: the plan's (ParallelModel.grad_norm counts each parameter once
        # over tensor-parallel shards, pipeline stages and FSDP shards; on one process, optim.grad_norm).
        self.step_guard.norm_fn = self.parallel.grad_norm

    def on_train_batch_start(self, batch, batch_idx):
        # The step boundary of the guard: Lightning calls this before every micro-batch, after the callbacks' own
        # on_train_batch_start and before any backward, so every callback that reads the guard sees this step's.
        self.step_guard.begin(self.global_step)
        if self._trainer is not None and self._trainer.should_stop:
            # A stop decided at this step boundary (a preemption's checkpoint was just written by StepCheckpoint's
            # on_train_batch_start, which runs before this hook): end the epoch before the batch trains, so the run
            # ends at the step of its checkpoint. Lightning would otherwise train this batch before checking.
            return -1
        trainer = self._trainer
        if trainer is not None and batch_idx % trainer.accumulate_grad_batches == 0:
            # An accumulation's first micro-batch, by Lightning's own rule (loops/optimization/automatic.py), but
            # zeroed before its forward, not after its training step (optimizer_zero_grad below): the pipeline
            # schedule's backward runs inside the training step. Gradients still live from the backward until the
            # next step begins, so every callback (the step's hooks, on_train_batch_end's memory accounting) sees
            # them as before, on every layout.
            for optimizer in trainer.optimizers:
                optimizer.zero_grad()

    def on_train_start(self):
        self._loss_sum = torch.zeros((), device=self.device)
        self._z_loss_sum = torch.zeros((), device=self.device)
        self._mtp_loss_sum = torch.zeros((), device=self.device)  # model.mtp_depth's loss (batch_losses.StepLosses)
        self._micro_batches = 0
        self._step_seen = self.global_step

    def training_step(self, batch, batch_idx):
        out = self.step_losses(batch)
        self._loss_sum += out.task.detach()
        self._micro_batches += 1
        if out.z is not None:
            self._z_loss_sum += out.z.detach()
        if out.mtp is not None:
            self._mtp_loss_sum += out.mtp.detach()
        for key, value in out.metrics.items():
            self.log(key, value)
        return out.trained

    def backward(self, loss, *args, **kwargs):
        # The pipeline schedule ran this micro-batch's backward inside the training step (parallel/pipeline.py);
        # Lightning's callbacks around backward (on_before_backward: the loss-spike and non-finite guards) still see
        # the loss it was of.
        if not self.parallel.runs_backward:
            super().backward(loss, *args, **kwargs)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        """Nothing: the gradients are zeroed in on_train_batch_start. Lightning calls this hook after the first
        micro-batch's training step, where it would wipe what a pipeline schedule has just accumulated."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step == self._step_seen:
            return  # mid-accumulation: the optimizer has not stepped yet
        self._step_seen = self.global_step
        if self.logs_at(self.global_step):
            # The step's loss is the mean over its micro-batches and (sync_dist) over data-parallel ranks, not rank
            # 0's last micro-batch.
            self.log("train/loss", self._loss_sum / self._micro_batches, prog_bar=True, sync_dist=True)
            self.log("train/tokens_seen", float(self.tokens_before(self.global_step)))
            self.log("train/lr", self._lr_used)
            if self.optim_cfg.z_loss > 0:
                self.log("train/z_loss", self._z_loss_sum / self._micro_batches, sync_dist=True)
            if self.model_cfg.mtp_depth:  # as train/loss: the micro-batches' mean, then the data-parallel ranks'
                self.log("train/mtp_loss", self._mtp_loss_sum / self._micro_batches, sync_dist=True)
        self._loss_sum.zero_()
        self._z_loss_sum.zero_()
        self._mtp_loss_sum.zero_()
        self._micro_batches = 0

    def tokens_before(self, step: int) -> int:
        """Global tokens of the optimizer steps before `step` (all of them: tokens_seen once `step` steps are done)."""
        return self.step_tokens.before(step)

    def logs_at(self, step: int) -> bool:
        """Whether optimizer step `step` (1-based) is logged: every trainer.log_every_n_steps, and the last one (of
        max_steps, or where a callback stopped the run: Lightning writes a row there, which would otherwise repeat
        the values last logged under this step's number).

        Logging only then keeps the hot path free of host synchronization: a logged tensor is reduced across ranks
        (sync_dist) and read on the host (progress bar, loggers) on every step it is logged, not only when written.
        """
        trainer = self._trainer
        if trainer is None:
            return True
        last = trainer.max_steps if trainer.max_steps > 0 else self.max_steps  # Lightning's -1: no limit set
        return step % trainer.log_every_n_steps == 0 or step >= last or trainer.should_stop

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        # model.moe, after the update and before any callback's on_train_batch_end reads the step: the routing
        # counts summed over the data-parallel ranks, DeepSeek-V3's bias update (model/moe.py end_step). On our
        # mesh over those ranks alone (MeshStrategy.data_parallel_sum); elsewhere every rank is a data-parallel one.
        trainer = self._trainer
        strategy = None if trainer is None else trainer.strategy
        reduce = getattr(strategy, "data_parallel_sum", None) or (
            None if strategy is None else lambda t: strategy.reduce(t, reduce_op="sum"))
        end_step(self.model, reduce)

    def on_before_optimizer_step(self, optimizer):
        # Read here, not after the step: by then the scheduler has moved on to the next step's rate. The schedule's
        # own rate: a group with a learning-rate factor (optim.lr_multipliers, μP) carries it as lr_multiplier.
        group = optimizer.param_groups[0]
        self._lr_used = group["lr"] / group.get("lr_multiplier", 1.0)

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self._val_started = time.perf_counter()
        batch_totals = self.validation_totals(batch)
        if getattr(self, "_val_totals", None) is None:
            self._val_totals = torch.zeros(3, dtype=torch.float64, device=batch_totals.device)
        self._val_totals += batch_totals
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        sources = getattr(datamodule, "val_batch_sources", None)
        if sources:
            # A mixture: every validation batch holds one source's windows (data/validation.py val_batches).
            if getattr(self, "_val_by_source", None) is None:
                self._val_by_source = torch.zeros(len(datamodule.source_names), 3, dtype=torch.float64,
                                                  device=batch_totals.device)
            self._val_by_source[sources[batch_idx]] += batch_totals

    def validation_totals(self, batch) -> torch.Tensor:
        """(nats, predicted tokens, their UTF-8 bytes) of a validation batch under the weights the model holds now,
        float64 on the device: what val/loss sums (and the weights' EMA, callbacks/ema.py, on the same batches)."""
        x, y = batch
        if self.eod_id is not None:
            # Under document masking the targets after an EOD are not predicted: neither their nats nor their bytes
            # count.
            y = loss_targets(x, y, self.eod_id)
        # A padding window's targets (data/validation.py) are not predicted either. Counted on the device.
        kept = y != IGNORE_INDEX  # (B, T)
        predicted = kept.sum()
        loss = self.loss(batch)  # the mean over this batch's predicted targets; NaN for a batch of padding alone
        # Totals, not a mean of batch means: nats and predicted tokens (and their UTF-8 bytes), in float64 on the
        # device (token counts stay exact), summed over the batches here and over the ranks at the epoch's end.
        nats = torch.where(predicted > 0, loss.detach().double() * predicted, 0.0)
        table = token_bytes_table(self)
        n_bytes = table[y[kept]].sum().double() if table is not None else torch.full((), -1.0, dtype=torch.float64)
        return torch.stack([nats, predicted.double(), n_bytes.to(nats.device)])

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self._val_batches_done = time.perf_counter()

    def on_validation_epoch_end(self):
        hook_started = time.perf_counter()
        totals, self._val_totals = getattr(self, "_val_totals", None), None
        if totals is None:
            return
        # Summed over every rank: tensor/pipeline ranks of one replica count its batches t·p times, in nats, tokens
        # and bytes alike, so the ratios are unchanged.
        nats, tokens, n_bytes = self.trainer.strategy.reduce(totals, reduce_op="sum").tolist()
        val_loss = nats / tokens if tokens > 0 else math.nan
        values = {"val/loss": val_loss, "val/perplexity": perplexity(val_loss)}
        if n_bytes > 0:  # negative without a byte-level tokenizer (-1 per batch): no bits per byte
            values["val/bits_per_byte"] = bits_per_byte(nats, n_bytes)
        by_source, self._val_by_source = getattr(self, "_val_by_source", None), None
        if by_source is not None:
            by_source = self.trainer.strategy.reduce(by_source, reduce_op="sum").tolist()
            for name, (nats, tokens, n_bytes) in zip(self.trainer.datamodule.source_names, by_source):
                if tokens > 0:
                    values[f"val/{name}/loss"] = nats / tokens
                if n_bytes > 0:
                    values[f"val/{name}/bits_per_byte"] = bits_per_byte(nats, n_bytes)
        started, self._val_started = getattr(self, "_val_started", None), None
        if started is not None:  # validation's own time, kept apart from the training step's (throughput monitor):
            # its batches and this hook's reductions. Lightning runs the callbacks' on_validation_epoch_end before
            # this one: the downstream evaluation's time (eval/seconds) came between and is not counted twice.
            values["val/seconds"] = (self._val_batches_done - started) + (time.perf_counter() - hook_started)
        for key, value in values.items():
            # Every rank holds the same reduced value (val/seconds: its own clock; the slowest rank's is the time
            # validation took). sync_dist with max returns it bit for bit, and tells Lightning it is not one rank's
            # value alone (else it warns "use sync_dist=True" for each key).
            self.log(key, value, prog_bar=key == "val/loss", sync_dist=True, reduce_fx="max")

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # The stability callbacks may already have taken this step's pre-clip norm: one reduction per step, not two.
        norm = self.step_guard.clip(self.parameters(), self.optim_cfg.grad_clip_norm)
        if norm is None:
            # The update was dropped (the stability callbacks agree on that across ranks, so every rank returns
            # here): logging a norm of 0 would read as a real, tiny gradient.
            return
        if not self.logs_at(self.global_step + 1):  # global_step counts the steps done; this is the next one
            return
        self.log("train/grad_norm", norm)
        if self.optim_cfg.grad_clip_norm > 0:
            self.log("train/clipped", (norm > self.optim_cfg.grad_clip_norm).float())

    def on_save_checkpoint(self, checkpoint) -> None:
        # Lightning's own strategies (one device, DDP, ZeRO-1's consolidation) save the optimizer state numbered by
        # position in its groups; every one-file checkpoint keys it by parameter name (optim/named_state.py). ZeRO-2/3
        # and the mesh save by name already (resume/gathered.py); a sharded save's state is in its shards.
        states = checkpoint.get("optimizer_states") or []
        if any(s and not is_named(s) for s in states):
            groups = single_process_names(self.model_cfg, self.optim_cfg).groups
            checkpoint["optimizer_states"] = [to_named(s, groups) if s else s for s in states]

    def on_load_checkpoint(self, checkpoint) -> None:
        # Lightning's own strategies load the optimizer state next, by position (Optimizer.load_state_dict): the
        # file's state, by name or by either older numbering, numbered for this run's groups. ZeRO-2/3 and the mesh
        # have loaded it by name already (lightning_restore_optimizer is False there), a sharded folder from its
        # shards (resume/sharded/load.py).
        trainer = self._trainer
        states = checkpoint.get("optimizer_states") or []
        if (trainer is None or trainer.state.fn != "fit" or not trainer.strategy.lightning_restore_optimizer
                or SHARDED_KEY in checkpoint or not states):
            return
        names, source = single_process_names(self.model_cfg, self.optim_cfg), trainer.ckpt_path
        checkpoint["optimizer_states"] = [to_positions(read_named(s, names, source), names.groups, source)
                                          for s in states]

    def configure_optimizers(self):
        o = self.optim_cfg
        optimizer = build_optimizer(self.model, o, self.plan.zero_stage, layout=self.parallel)
        pieces, batches, rule = self.schedule_pieces, self.batch_schedule, self.batch_schedule_lr

        def schedule(step: int) -> float:  # a closure, not an object: LambdaLR's state_dict would save its fields
            return stages.factor_at(pieces, step) * lr_factor(batches, rule, step)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


IGNORE_INDEX = losses.IGNORE_INDEX  # re-exported: where targets are masked (loss_targets)
lm_losses = losses.lm_losses  # re-exported
loss_targets = losses.loss_targets  # re-exported


def bits_per_byte(nats: float, n_bytes: int) -> float:
    """Total nats over the UTF-8 bytes of the same text, in bits: a tokenizer-independent loss (The Pile, Gao et al.
    2020, section 5.1: bits per UTF-8 encoded byte). The end-of-document token's nats count, its bytes are 0."""
    return nats / n_bytes / math.log(2)


def token_bytes_table(module: L.LightningModule) -> Optional[torch.Tensor]:
    """The datamodule's UTF-8 bytes per token id (data/tokenizer.py token_byte_lengths) on the module's device,
    copied there once; None without a datamodule that has it (then no bits per byte are logged)."""
    from lit_pretrain.internals import attached_trainer

    table = getattr(module, "_token_bytes", None)
    if table is None:
        trainer = attached_trainer(module)
        host = getattr(getattr(trainer, "datamodule", None), "token_bytes", None) if trainer is not None else None
        if host is None:
            return None
        table = module._token_bytes = torch.as_tensor(host, device=module.device)
    return table


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf
