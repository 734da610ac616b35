"""`python -m tests.helpers.mesh_resume OUT DEVICES STRATEGY T P STEPS [CKPT|- [KEY=VALUE ...]]`: fit the tiny model
under one layout for STEPS optimizer steps (resuming from CKPT when given, which another layout may have written) and
save a checkpoint. KEY=VALUE: config overrides (e.g. optim.name=muon), and save_at=N: also save OUT.stepN after step N,
then fit a fresh module from that file to STEPS in this process (one process start for both) and save OUT.resumed.

Every batch is the same 4 windows, so a resumed run sees what an uninterrupted one would whatever position
Lightning restarts the dataloader at. Run by tests/strategy/test_mesh_strategy.py; Lightning's launcher re-runs it per
rank.
"""

import sys
import tempfile

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_pretrain import config
from lit_pretrain.module import PretrainModule
from lit_pretrain.strategy.build import build_strategy
from tests.conftest import EXPERIMENTS


class SaveAt(L.Callback):
    """Save a checkpoint after optimizer step `step` (the run goes on): a resume point inside an uninterrupted run."""

    def __init__(self, step: int, path: str):
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def main(out, devices, name, t, p, steps, ckpt=None, overrides=()):
    save_at = [int(o.split("=")[1]) for o in overrides if o.startswith("save_at=")]
    overrides = [o for o in overrides if not o.startswith("save_at=")]
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    c = config.to_object(config.load(EXPERIMENTS / "runs" / "tiny.yaml", [
        "model.vocab_size=64", "trainer.micro_batch_size=4", "optim.grad_clip_norm=0.1", "schedule.warmup_steps=1",
        f"trainer.devices={devices}", f"strategy={name}", f"strategy.tensor_parallel={t}",
        f"strategy.pipeline_parallel={p}", "strategy.timeout_seconds=60", "strategy.pipeline.micro_batches=2",
        "strategy.pipeline.schedule=gpipe", *overrides]))
    fit(c, out, devices, steps, ckpt, [SaveAt(n, f"{out}.step{n}") for n in save_at])
    for n in save_at:
        fit(c, f"{out}.resumed", devices, steps, f"{out}.step{n}", [])


def fit(c, out, devices, steps, ckpt, callbacks):
    strategy = c.strategy
    g = torch.Generator().manual_seed(5)
    w = torch.randint(0, 64, (4, c.model.seq_len + 1), generator=g).repeat(8, 1)
    data = DataLoader(TensorDataset(w[:, :-1], w[:, 1:]), batch_size=4)
    module = PretrainModule(c.model, c.optim, c.schedule, max_steps=3, tokens_per_step=4 * c.model.seq_len, seed=0,
                            strategy=strategy, plan=c.plan)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=build_strategy(strategy, c.trainer, c.plan),
                            max_steps=steps, limit_val_batches=0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                            default_root_dir=tmp, callbacks=callbacks)
        trainer.fit(module, data, ckpt_path=ckpt)
    trainer.save_checkpoint(out)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), a[2], int(a[3]), int(a[4]), int(a[5]), a[6] if len(a) > 6 and a[6] != "-" else None,
         a[7:])
