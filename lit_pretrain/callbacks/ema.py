"""WeightEma: an exponential moving average of the weights, in fp32, beside the weights the optimizer trains.

Polyak averaging as timm's ModelEmaV3 and OLMo-core keep it: after optimizer step s (s >= start_step), every
parameter's average moves towards the weights, ema <- ema + (1 - decay^n) (weights - ema) every n steps (`torch.lerp`,
one fused op per parameter list), starting at start_step as a copy of the weights. An average of the late weights
reaches the loss a learning-rate decay would, at no cost to the trajectory (Izmailov et al. 2018, "Averaging Weights
Leads to Wider Optima and Better Generalization", SWA, section 3; Morales-Brotons et al. 2024, "Exponential Moving
Average of Weights in Deep Learning: Dynamics and Benefits", section 4: evaluating the EMA beside the raw weights).

Layout: each rank averages what it holds. The EMA of a parameter is a tensor laid out as that parameter (an FSDP2
shard a DTensor with its placements, a tensor-parallel slice, a pipeline stage's own blocks), and the average is
elementwise, so the EMA of a shard is the shard of the EMA: the same numbers as on one process, from the same weights.

Validation: after each validation batch the weights are swapped for the EMA, the batch's totals taken again by the
module's own `validation_totals` (the same windows, the same loss path and precision), and the weights put back;
val/ema_loss is logged beside val/loss (FSDP2's gathered weights are dropped around the swap: `_reshard`).

Checkpoints: a one-file checkpoint holds the whole EMA by single-process parameter name under EMA_KEY (gathered onto
rank 0 as the weights are: ParallelModel.full_like_parameters), a sharded folder `ema.<name>` beside `model.<name>`
(each rank writes its share: `checkpoint_chunks`, which resume/sharded/save.py ShardedSaver calls). Either is read
back into any layout, bitwise. Buffers (a MoE layer's routing bias) are not averaged: the EMA model's are the trained
ones (load_gpt(weights="ema")). Memory: 4 bytes per parameter on each rank's share, and during validation one copy of
the weights more.
"""

import math
from typing import Dict, List, Optional, Tuple

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lit_pretrain.errors import ConfigError
from lit_pretrain.parallel.mesh import local
from lit_pretrain.planning.sharding import plain_name
from lit_pretrain.resume.gathered import GatheredOneFile
from lit_pretrain.resume.sharded import save as sharded

START, UPDATE = "start", "update"


def action_at(step: int, start_step: int, every_n_steps: int, started: bool) -> Optional[str]:
    """What the average does after optimizer step `step` (the steps completed): start (a copy of the weights) at
    the first step >= start_step it sees, then update at start_step + k * every_n_steps, else nothing."""
    if step < start_step:
        return None
    if not started:
        return START
    return UPDATE if (step - start_step) % every_n_steps == 0 else None


def update_weight(decay: float, every_n_steps: int) -> float:
    """The lerp weight of one update, 1 - decay^n: n steps of decay d shrink the old average by d^n (the per-step
    decay kept when updating every n steps)."""
    return 1.0 - decay ** every_n_steps


class WeightEma(Callback):
    def __init__(self, decay: float = 0.999, start_step: int = 0, every_n_steps: int = 1):
        if not 0.0 < decay < 1.0:
            raise ConfigError(f"callbacks.ema.decay={decay}: expected a value in (0, 1)")
        if start_step < 0 or every_n_steps < 1:
            raise ConfigError(f"callbacks.ema: start_step={start_step} (>= 0), every_n_steps={every_n_steps} (>= 1)")
        self.decay, self.start_step, self.every_n_steps = decay, start_step, every_n_steps
        self.names: List[str] = []
        self.ema: Optional[List[torch.Tensor]] = None
        """Per parameter (single-process names `names`), its average laid out as the parameter, fp32."""
        self.started_at: Optional[int] = None
        self._params: List[torch.Tensor] = []
        self._pending: Tuple[str, object] = ("none", None)
        self._sharded_saves = False
        self._step_seen = -1
        self._raw: Optional[List[torch.Tensor]] = None
        self._totals: Optional[torch.Tensor] = None

    # Training.

    def setup(self, trainer, pl_module, stage: str) -> None:
        from lit_pretrain.resume.checkpointing import StepCheckpoint

        # Sharded saves take the EMA's chunks (checkpoint_chunks); a one-file save gathers it (on_save_checkpoint).
        self._sharded_saves = any(isinstance(cb, StepCheckpoint) and cb.saver is not None for cb in trainer.callbacks)

    def on_train_start(self, trainer, pl_module) -> None:
        # After configure_model (the parameters are this rank's share) and after any checkpoint was restored.
        named = [(plain_name(n), p) for n, p in pl_module.model.named_parameters()]
        self.names, self._params = [n for n, _ in named], [p for _, p in named]
        self._step_seen = step = trainer.global_step
        kind, value = self._pending
        self._pending = ("none", None)
        if kind == "full":
            self._from_full(trainer, pl_module, value)
        elif kind == "folder":
            self._from_folder(pl_module, value)
        if self.ema is None and action_at(step, self.start_step, self.every_n_steps, False) == START:
            if step > self.start_step:  # resumed from a checkpoint written without the average
                rank_zero_warn(f"callbacks.ema: the checkpoint of step {step} holds no EMA of the weights; it starts "
                               f"now, at step {step}, not at callbacks.ema.start_step={self.start_step}")
            self._start(step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._step_seen:
            return  # mid-accumulation: the optimizer has not stepped yet
        self._step_seen = step
        action = action_at(step, self.start_step, self.every_n_steps, self.ema is not None)
        if action == START:
            self._start(step)
        elif action == UPDATE:
            self._update()

    @torch.no_grad()
    def _start(self, step: int) -> None:
        self.ema = [p.detach().float().clone() for p in self._params]
        self.started_at = step

    @torch.no_grad()
    def _update(self) -> None:
        weights = [local(p.detach()).float() for p in self._params]  # float(): no copy of fp32 weights
        torch._foreach_lerp_([local(e) for e in self.ema], weights, update_weight(self.decay, self.every_n_steps))

    # Validation: the same batches under the EMA.

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.ema is None or trainer.sanity_checking:
            return
        with torch.no_grad():
            if self._raw is None:  # the weights do not change during validation: one copy for all its batches
                self._raw = [local(p.detach()).clone() for p in self._params]
            self._swap_in([local(e) for e in self.ema], pl_module)
            try:
                with trainer.precision_plugin.val_step_context():
                    totals = pl_module.validation_totals(batch)
            finally:
                self._swap_in(self._raw, pl_module)
        self._totals = totals if self._totals is None else self._totals + totals

    def _swap_in(self, values: List[torch.Tensor], pl_module) -> None:
        _reshard(pl_module.model)  # FSDP2 would otherwise reuse weights it gathered before the swap
        for p, v in zip(self._params, values):
            local(p.detach()).copy_(v)
        _reshard(pl_module.model)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        totals, self._totals, self._raw = self._totals, None, None
        if totals is None:
            return
        nats, tokens, _ = trainer.strategy.reduce(totals, reduce_op="sum").tolist()  # as module.py sums val/loss
        # The same value on every rank: sync_dist with max returns it bit for bit (module.py's val/loss).
        pl_module.log("val/ema_loss", nats / tokens if tokens > 0 else math.nan, sync_dist=True, reduce_fx="max")

    # Checkpoints.

    def state_dict(self) -> Dict:
        return {"started_at": self.started_at, "decay": self.decay, "every_n_steps": self.every_n_steps}

    def load_state_dict(self, state: Dict) -> None:
        self.started_at = state.get("started_at")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: Dict) -> None:
        if self._sharded_saves or self.ema is None:
            return
        named = dict(zip(self.names, self.ema))
        if isinstance(trainer.strategy, GatheredOneFile):
            full = pl_module.parallel.full_like_parameters(named)  # a collective; None except on rank 0
        else:  # one process, DDP or ZeRO-1: every rank holds the whole average
            full = {k: v.detach().cpu() for k, v in named.items()}
        if full is not None:
            checkpoint[sharded.EMA_KEY] = full

    def checkpoint_chunks(self, trainer) -> Dict[str, sharded.Chunk]:
        """This rank's share of the EMA as chunks of single-process tensors, `ema.<name>` (the sharded save)."""
        if self.ema is None:
            return {}
        par = trainer.lightning_module.parallel
        return {sharded.EMA + n: sharded.chunk_of(n, e, par) for n, e in zip(self.names, self.ema)}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: Dict) -> None:
        # Read once the model is laid out (on_train_start): DDP restores before its setup, the mesh after.
        if sharded.SHARDED_KEY in checkpoint:
            self._pending = ("folder", checkpoint[sharded.SHARDED_KEY])
        elif sharded.EMA_KEY in checkpoint:
            self._pending = ("full", checkpoint[sharded.EMA_KEY])

    @torch.no_grad()
    def _from_full(self, trainer, pl_module, full: Dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in full]
        if missing:
            raise ConfigError(f"callbacks.ema: the checkpoint's EMA lacks {missing[:3]}: it is another model's; "
                              "resume from a checkpoint of this model")
        gathered = isinstance(trainer.strategy, GatheredOneFile)
        self.ema = []
        for name, p in zip(self.names, self._params):
            value = full[name].to(device=p.device, dtype=torch.float32)
            share = pl_module.parallel.share_like(name, value, p) if gathered else value
            self.ema.append(share.clone())

    @torch.no_grad()
    def _from_folder(self, pl_module, folder: str) -> None:
        from pathlib import Path

        storage = sharded.reader(Path(folder), check_sha256=False)  # verified when the checkpoint was loaded
        if not any(k.startswith(sharded.EMA) for k in sharded.saved_shapes(storage)):
            return  # written without the average (or before it started)
        self.ema = [p.detach().float().clone() for p in self._params]
        par = pl_module.parallel
        sharded.load(storage, {sharded.EMA + n: sharded.chunk_of(n, e, par) for n, e in zip(self.names, self.ema)})


def _reshard(model) -> None:
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
