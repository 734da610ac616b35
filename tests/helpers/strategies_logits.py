"""A user callback for the strategy tests: at the end of training, the model as the strategy holds it (FSDP shards
and all) computes logits on a fixed input, and rank 0 saves them next to the run's checkpoints.

Named in the test's config as `tests.helpers.strategies_logits:SaveLogits`, the way a user adds their own callback.
"""

from pathlib import Path

import lightning as L
import torch


def probe_input(vocab_size: int, seq_len: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab_size, (2, seq_len), generator=g)


class SaveLogits(L.Callback):
    def __init__(self, out: str):
        self.out = Path(out)

    def on_train_end(self, trainer, pl_module):
        cfg = pl_module.model_cfg
        pl_module.eval()
        with torch.no_grad():  # every rank runs the forward: under FSDP it all-gathers each group's parameters
            logits = pl_module.model(probe_input(cfg.vocab_size, cfg.seq_len))
        pl_module.train()
        if trainer.is_global_zero:
            torch.save(logits, self.out)
