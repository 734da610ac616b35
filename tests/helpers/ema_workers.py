"""`python -m tests.helpers.ema_workers OUT`: the weights' EMA (callbacks/ema.py) under several layouts in one launch
of 2 processes, each case a fit of the tiny model whose checkpoint lands in the folder OUT:

1. zero3.ckpt: ZeRO-3, 4 steps; after step 2 a one-file checkpoint (zero3.step2.ckpt) and a sharded folder
   (zero3.step2/, written as a run's sharded saves write it: each rank its share);
2. zero3_resumed.ckpt: ZeRO-3 again, from zero3.step2.ckpt to step 4 (the same layout);
3. ddp_from_zero3.ckpt: DDP, from zero3.step2.ckpt (another layout, a one-file checkpoint);
4. tp_from_sharded.ckpt: tensor parallelism 2, from the sharded folder zero3.step2/ (another layout, a folder).

Cases 1 and 4 validate on 2 batches at steps 2 and 4: their last val/loss and val/ema_loss go to val_losses.json.

`fit` is also the one-process reference the test runs in its own process. Run by tests/callbacks/test_ema.py;
Lightning's launcher re-runs it per rank.
"""

import json
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_pretrain import config
from lit_pretrain.callbacks.ema import WeightEma
from lit_pretrain.module import PretrainModule
from lit_pretrain.resume.sharded.save import ShardedSaver
from lit_pretrain.strategy.build import build_strategy
from tests.conftest import EXPERIMENTS

STEPS, DECAY, START = 4, 0.5, 1  # a decay far from 1, so every step's weights weigh in the average after 4 steps


class SaveAt(L.Callback):
    """After optimizer step `step`: a one-file checkpoint, and with `folder` a sharded one (the run goes on)."""

    def __init__(self, step: int, path: str, folder: str = ""):
        self.step, self.path, self.folder = step, path, folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        trainer.save_checkpoint(self.path)
        if self.folder:
            ema = next(cb for cb in trainer.callbacks if isinstance(cb, WeightEma))
            ema._sharded_saves = True  # as under a run's sharded StepCheckpoint: the EMA goes into the shards
            try:
                ShardedSaver().save(trainer, Path(self.folder), self.step, {})
            finally:
                ema._sharded_saves = False


def load(name: str, devices: int, t: int = 1):
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    return config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", [
        "model.vocab_size=64", "model.n_layers=2", "model.seq_len=16", "trainer.micro_batch_size=4",
        "optim.grad_clip_norm=0.1", "schedule.warmup_steps=1", f"trainer.devices={devices}", f"strategy={name}",
        f"strategy.tensor_parallel={t}", "strategy.timeout_seconds=60"]))


def windows(seq_len: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 64, (4, seq_len + 1), generator=g).repeat(8, 1)


def fit(c, out, devices, ckpt=None, callbacks=(), val_batches=0):
    """STEPS steps of the same 4 windows (a resume sees what the uninterrupted run saw), with the EMA; saves `out`."""
    w = windows(c.model.seq_len)
    data = DataLoader(TensorDataset(w[:, :-1], w[:, 1:]), batch_size=4)
    module = PretrainModule(c.model, c.optim, c.schedule, max_steps=STEPS, tokens_per_step=4 * c.model.seq_len,
                            seed=0, strategy=c.strategy, plan=c.plan)
    ema = WeightEma(DECAY, START)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=build_strategy(c.strategy, c.trainer, c.plan),
                            max_steps=STEPS, limit_val_batches=val_batches, val_check_interval=2 if val_batches else
                            None, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                            default_root_dir=tmp, callbacks=[ema, *callbacks])
        trainer.fit(module, data, data if val_batches else None, ckpt_path=ckpt)
    if out is not None:
        trainer.save_checkpoint(out)
    return trainer, module, ema


def val_losses(trainer) -> dict:
    return {k: float(trainer.callback_metrics[k]) for k in ("val/loss", "val/ema_loss")}


def main(out):
    out = Path(out)
    losses = {}
    trainer, _, _ = fit(load("zero", 2), out / "zero3.ckpt", 2, val_batches=2,
                        callbacks=[SaveAt(2, str(out / "zero3.step2.ckpt"), str(out / "zero3.step2"))])
    losses["zero3"] = val_losses(trainer)
    fit(load("zero", 2), out / "zero3_resumed.ckpt", 2, ckpt=out / "zero3.step2.ckpt")
    fit(load("ddp", 2), out / "ddp_from_zero3.ckpt", 2, ckpt=out / "zero3.step2.ckpt")
    trainer, _, _ = fit(load("tensor", 2, t=2), out / "tp_from_sharded.ckpt", 2, ckpt=out / "zero3.step2",
                        val_batches=2)
    losses["tp_from_sharded"] = val_losses(trainer)
    if trainer.is_global_zero:
        (out / "val_losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main(sys.argv[1])
