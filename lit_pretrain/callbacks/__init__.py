"""Callbacks built from the `callbacks` config section, one job each.

The stability callbacks (loss spike, non-finite guard, gradient-norm and throughput monitors, stability report) come
from their typed sections; a user's own callbacks from `callbacks.extra` as an explicit `module:Class`.
"""

import dataclasses

from lightning.pytorch.callbacks import Callback

from lit_pretrain.callbacks.user import user_callbacks
from lit_pretrain.schema import Config


def build_callbacks(c: Config) -> list[Callback]:
    """Every callback the config asks for: the stability ones (in the order their hooks must run), then the user's."""
    return stability_callbacks(c) + ema_callbacks(c) + evaluation_callbacks(c) + user_callbacks(c.callbacks)


def ema_callbacks(c: Config) -> list[Callback]:
    """The weights' EMA (callbacks.ema): before the evaluation callbacks, so val/ema_loss is logged with val/loss."""
    e = c.callbacks.ema
    if not e.enabled:
        return []
    from lit_pretrain.callbacks.ema import WeightEma

    return [WeightEma(e.decay, e.start_step, e.every_n_steps)]


def evaluation_callbacks(c: Config) -> list[Callback]:
    d = c.callbacks.downstream_eval
    if not d.enabled:
        return []
    from lit_pretrain.callbacks.downstream_eval import DownstreamEval  # imports lm-eval: only when enabled

    return [DownstreamEval(d.tasks, c.trainer.val_every_n_steps, every_n_steps=d.every_n_steps, limit=d.limit,
                           max_tokens=d.max_tokens, include_path=d.include_path, batch_size=d.batch_size,
                           num_fewshot=d.num_fewshot)]


def stability_callbacks(c: Config) -> list[Callback]:
    # Imported here: each pulls in torch and Lightning, which loading a config never needs.
    from lit_pretrain.callbacks.gradient_norm import GradientNormMonitor
    from lit_pretrain.callbacks.loss_spike import LossSpike
    from lit_pretrain.callbacks.nan_guard import NanGuard
    from lit_pretrain.callbacks.stability_report import StabilityReport
    from lit_pretrain.callbacks.throughput import ThroughputMonitor

    cb, out = c.callbacks, []
    # Order matters within a step: the guard drops a non-finite update before the spike detector looks at the step,
    # and both decide before the monitors read what was applied.
    if cb.nan_guard.enabled:
        out.append(NanGuard(cb.nan_guard.max_consecutive, cb.nan_guard.check_gradients))
    if cb.loss_spike.enabled:
        spike = cb.loss_spike
        args = {f.name: getattr(spike, f.name) for f in dataclasses.fields(spike) if f.name != "enabled"}
        out.append(LossSpike(**args))
    if cb.gradient_norm.enabled:
        s = c.schedule
        out.append(GradientNormMonitor(
            clip_norm=c.optim.grad_clip_norm,
            log_every_n_steps=cb.gradient_norm.log_every_n_steps or c.trainer.log_every_n_steps,
            per_layer_every_n_steps=cb.gradient_norm.per_layer_every_n_steps,
            schedule=(s.kind, s.warmup_steps, c.trainer.max_steps, s.decay_fraction)))
    if cb.throughput.enabled:
        out.append(ThroughputMonitor(cb.throughput.log_every_n_steps or c.trainer.log_every_n_steps,
                                     peak_flops_per_s=cb.throughput.peak_flops_per_s))
    if cb.moe.enabled and c.model.moe is not None:
        from lit_pretrain.callbacks.moe_monitor import MoEMonitor

        out.append(MoEMonitor(cb.moe.log_every_n_steps or c.trainer.log_every_n_steps, cb.moe.collapse_share,
                              cb.moe.collapse_window))
    if cb.stability_report.enabled:
        out.append(StabilityReport())
    return out
