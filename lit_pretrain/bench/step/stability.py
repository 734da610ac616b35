"""Case: the stability callbacks' cost on the training step, as tokens/s with them over tokens/s without them.

Both sides run the same `PretrainModule` under the same `L.Trainer` on the same in-memory windows (bench/step/step.py's
data and clock); the candidate adds the callbacks the experiment's config turns on (non-finite guard, loss-spike
detector, gradient-norm and throughput monitors, report). The guard and the detector share one host read per step
(their decisions need it: StepGuard.host); the monitors read only at logging intervals. Their hooks measured 0.8%
of the timed steps on this CPU (most of it the gradient norm, which clipping shares, and the rewind points' copies).
"""

import dataclasses
import tempfile

import lightning as L

from lit_pretrain.bench.step.step import _data, _StepClock, paired_case
from lit_pretrain.callbacks import stability_callbacks
from lit_pretrain.module import PretrainModule


def _tokens_per_s(c, steps: int, skip: int, with_callbacks: bool) -> float:
    tokens_per_step = c.trainer.micro_batch_size * c.model.seq_len
    module = PretrainModule(c.model, c.optim, c.schedule, max_steps=steps, tokens_per_step=tokens_per_step,
                            seed=c.run.seed)
    clock = _StepClock(skip)
    # Rewinds need the token-shard datamodule; the in-memory windows here do not skip, and no spike is expected.
    spike = dataclasses.replace(c.callbacks.loss_spike, skip_batches=0)
    c = dataclasses.replace(c, callbacks=dataclasses.replace(c.callbacks, loss_spike=spike))
    extra = stability_callbacks(c) if with_callbacks else []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0,
                            logger=L.pytorch.loggers.CSVLogger(tmp, name="", version=""),
                            log_every_n_steps=c.trainer.log_every_n_steps, callbacks=[clock, *extra],
                            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                            default_root_dir=tmp)
        trainer.fit(module, _data(c, steps))
    return (steps - skip) * tokens_per_step / (clock.end - clock.start)


def run(c, steps: int, skip: int, repeats: int) -> dict:
    return paired_case("stability_callbacks_tokens_per_s", lambda: _tokens_per_s(c, steps, skip, False),
                       lambda: _tokens_per_s(c, steps, skip, True), repeats, ">= 0.97", "tokens/s",
                       ("without", "with_callbacks"),
                       {"steps": steps, "timed_steps": steps - skip,
                        "callbacks": [type(cb).__name__ for cb in stability_callbacks(c)]})
