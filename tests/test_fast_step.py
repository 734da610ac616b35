"""The fast step's module settings: metrics logged only at logging steps (no per-step host synchronization) and
the last one; fused AdamW where the parameters are plain tensors."""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.module import PretrainModule
from lit_pretrain.optim.optimizers import adamw_kernel, build_adamw
from lit_pretrain.schema import OptimConfig, ScheduleConfig

TINY = dict(vocab_size=97, n_layers=1, d_model=32, n_heads=4, seq_len=16)


class Recording(PretrainModule):
    """Records the optimizer step (1-based) of every `self.log` call by name."""

    def log(self, name, value, *args, **kwargs):
        self.logged.setdefault(name, []).append(self.global_step + (name in ("train/grad_norm", "train/clipped")))
        super().log(name, value, *args, **kwargs)


def test_metrics_are_logged_at_logging_steps_and_the_last_one(tmp_path):
    torch.manual_seed(0)
    module = Recording(GPTConfig(**TINY), OptimConfig(), ScheduleConfig(warmup_steps=1), max_steps=7,
                       tokens_per_step=4 * 16)
    module.logged = {}
    data = torch.randint(0, 97, (28, 17))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=7, log_every_n_steps=3, limit_val_batches=0,
                        logger=L.pytorch.loggers.CSVLogger(tmp_path, name="", version=""), enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4))
    for name in ("train/loss", "train/tokens_seen", "train/lr", "train/grad_norm", "train/clipped"):
        assert module.logged[name] == [3, 6, 7], name
    # The last step's values are what the run's summary reads (train.py: trainer.callback_metrics).
    assert float(trainer.callback_metrics["train/tokens_seen"]) == 7 * 4 * 16


def test_adamw_is_fused_on_plain_tensors_and_foreach_on_fsdp_shards():
    plain = [torch.nn.Parameter(torch.ones(2))]
    assert adamw_kernel(plain) == adamw_kernel(plain, zero_stage=1) == "fused"  # single, ddp, ZeRO-1: plain tensors
    assert adamw_kernel(plain, zero_stage=2) == adamw_kernel(plain, zero_stage=3) == "foreach"
    opt = build_adamw(torch.nn.Linear(2, 2), OptimConfig())
    assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
    opt.step()  # runs on CPU
