"""UpdateRatio: how large each optimizer update is relative to the weights, ‖Δw‖ / ‖w‖, every n steps.

An example of the pattern in README "Writing a callback": one job; constructor arguments checked; work on the
device with the host reading values only when they are logged; `state_dict`/`load_state_dict` so a resumed run
carries on; nothing any rank decides alone. A ratio far above ~1e-3 per step is a classic sign that the learning
rate is too high for that layer (Karpathy, "A Recipe for Training Neural Networks", 2019).

Load it from a run file (see experiments/runs/update_ratio.yaml):

    callbacks:
      extra:
        - class_path: experiments.callbacks.update_ratio:UpdateRatio
          init_args: {every_n_steps: 10}
"""

import lightning as L
import torch


class UpdateRatio(L.Callback):
    def __init__(self, every_n_steps: int = 10):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps}: expected a value >= 1")
        self.every_n_steps = every_n_steps
        self.history: list = []  # [step, ratio] of every measured step
        self._before = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # Steps are optimizer steps completed, as on every other metrics row (lit_pretrain/runs/step_axis.py): the
        # update about to run completes step global_step + 1, so steps n, 2n, ... are measured, as the loss is logged.
        step = trainer.global_step + 1
        if step % self.every_n_steps == 0:
            self._before = (step, [p.detach().clone() for p in pl_module.parameters()])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._before is None or trainer.global_step != self._before[0]:
            return  # not measured, or mid-accumulation: the update has not happened yet
        step, before = self._before
        self._before = None
        delta = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.detach() - b)
                                                      for p, b in zip(pl_module.parameters(), before)]))
        weight = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b) for b in before]))
        ratio = (delta / weight).item()  # read once per measured step, not every step
        self.history.append([step, ratio])
        if trainer.is_global_zero:  # every rank holds the same weights under data parallelism: log once
            for logger in trainer.loggers:
                logger.log_metrics({"update_ratio": ratio}, step=step)

    def state_dict(self):
        return {"history": [list(h) for h in self.history]}

    def load_state_dict(self, state):
        self.history = [list(h) for h in state["history"]]
