"""Injected faults and recorders for the stability tests (loaded by class_path in subprocess runs too)."""

import hashlib
import json
from pathlib import Path

import lightning as L
import torch


def _steps(steps):
    return set(int(s) for s in steps)


class PoisonBatch(L.Callback):
    """Replace every target of the micro-batches of `steps` by the last token id (on `ranks` only, if given): the
    last BPE merge is among the rarest tokens, so the loss of a poisoned batch is far above the level of the run."""

    def __init__(self, steps, ranks=None):
        self.steps, self.ranks = _steps(steps), ranks

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.steps and (self.ranks is None or trainer.global_rank in self.ranks):
            batch[1].fill_(pl_module.model.cfg.vocab_size - 1)


class LrJump(L.Callback):
    """Multiply the learning rate of the updates of `steps` by `factor` (the schedule resets it the step after)."""

    def __init__(self, steps, factor):
        self.steps, self.factor = _steps(steps), factor

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step in self.steps:
            for group in optimizer.param_groups:
                group["lr"] *= self.factor


class NonFinite(L.Callback):
    """Make the loss (`what="loss"`) or one gradient element (`what="grad"`) NaN at `steps`."""

    def __init__(self, steps, what="grad"):
        self.steps, self.what, self._hook = _steps(steps), what, None

    def on_train_start(self, trainer, pl_module):
        if self.what == "loss":
            def poison(module, inputs, output):
                return output * float("nan") if trainer.global_step in self.steps else None
            self._hook = pl_module.model.norm.register_forward_hook(poison)

    def on_after_backward(self, trainer, pl_module):
        if self.what == "grad" and trainer.global_step in self.steps:
            p = next(p for p in pl_module.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = float("inf")

    def on_train_end(self, trainer, pl_module):
        if self._hook is not None:
            self._hook.remove()


def optimizer_state(optimizer):
    sd = optimizer.state_dict()
    return {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()} for k, s in sd["state"].items()}


class Recorder(L.Callback):
    """Per step (at its first micro-batch): the step's trained window indices and, for `snapshot_steps`, copies of the
    parameters and the optimizer state the step starts from; per step the step loss."""

    def __init__(self, snapshot_steps=()):
        self.snapshot_steps = _steps(snapshot_steps)
        self.indices, self.params, self.opt_state, self.losses, self.finite = {}, {}, {}, {}, True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        dm = getattr(trainer, "datamodule", None)
        if dm is not None and dm.batch_indices is not None:
            self.indices.setdefault(step, []).extend(dm.batch_indices)
        if step in self.snapshot_steps and step not in self.params:
            self.params[step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            self.opt_state[step] = optimizer_state(trainer.optimizers[0])
        self.finite = self.finite and all(torch.isfinite(p).all() for p in pl_module.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step - 1] = float(outputs["loss"])


class RankDigest(L.Callback):
    """Write, per rank, a digest of the final parameters and the window indices each step trained on."""

    def __init__(self, folder):
        self.folder, self.indices = Path(folder), {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.indices.setdefault(trainer.global_step, []).extend(trainer.datamodule.batch_indices)

    def on_train_end(self, trainer, pl_module):
        h = hashlib.sha256()
        for v in pl_module.state_dict().values():
            if hasattr(v, "full_tensor"):  # an FSDP2 shard: digest the whole tensor (a collective on every rank)
                v = v.full_tensor()
            h.update(v.detach().cpu().contiguous().numpy().tobytes())
        out = {"params_sha256": h.hexdigest(), "indices": {str(k): v for k, v in self.indices.items()}}
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"digest-rank{trainer.global_rank}.json").write_text(json.dumps(out))


class StopAt(L.Callback):
    """End the run after optimizer step `step`: through lit_pretrain.resume.stop.stop_run (`done`: the run is
    finished), or, `bare`, by setting trainer.should_stop alone. One process: no decision to agree across ranks."""

    def __init__(self, step: int, done: bool = False, bare: bool = False):
        self.step, self.done, self.bare = step, done, bare

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or trainer.should_stop:
            return
        if self.bare:
            trainer.should_stop = True
        else:
            from lit_pretrain.resume.stop import stop_run

            stop_run(trainer, f"stop_at: step {self.step} reached", done=self.done)
