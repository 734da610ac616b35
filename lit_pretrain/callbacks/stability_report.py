"""StabilityReport: at the end of training, one summary of what the other stability callbacks saw.

`stability.json` in the run folder, and a table `format_report` prints: spikes by outcome, updates skipped and why,
steps rewound, batches and tokens skipped, clip rate and mean gradient norm by schedule phase (warmup / stable /
decay), the gradient-norm trend, throughput and MFU, and why the run stopped early if it did.
"""

import math
from typing import Dict, Optional

from lightning.pytorch.callbacks import Callback

from lit_pretrain.callbacks.gradient_norm import GradientNormMonitor
from lit_pretrain.callbacks.loss_spike import LossSpike
from lit_pretrain.callbacks.moe_monitor import MoEMonitor
from lit_pretrain.callbacks.nan_guard import NanGuard
from lit_pretrain.callbacks.records import write_json
from lit_pretrain.callbacks.throughput import ThroughputMonitor


class StabilityReport(Callback):
    def __init__(self, filename: str = "stability.json"):
        self.filename = filename
        self.report: Optional[Dict] = None

    def on_train_end(self, trainer, pl_module) -> None:
        self.report = build_report(trainer, pl_module)
        write_json(trainer, self.filename, self.report)


def _find(trainer, cls):
    return next((cb for cb in trainer.callbacks if isinstance(cb, cls)), None)


def build_report(trainer, pl_module) -> Dict:
    spikes, guard = _find(trainer, LossSpike), _find(trainer, NanGuard)
    grads, speed = _find(trainer, GradientNormMonitor), _find(trainer, ThroughputMonitor)
    routing = _find(trainer, MoEMonitor)
    tokens_per_step = getattr(pl_module, "tokens_per_step", None)
    spike = spikes.summary() if spikes else None
    nonfinite = guard.summary() if guard else None
    skipped = (spike["steps_skipped"] if spike else 0) + (nonfinite["steps_skipped"] if nonfinite else 0)
    batches = spike["batches_skipped"] if spike else 0
    rewound = spike["steps_rewound"] if spike else 0
    stops = [s for s in ((spike or {}).get("stop_reason"), (nonfinite or {}).get("stop_reason")) if s]
    return {
        "steps": trainer.global_step,
        "tokens_per_step": tokens_per_step,
        "loss_spikes": spike,
        "non_finite": nonfinite,
        "updates_skipped": skipped,
        "steps_rewound": rewound,
        "batches_skipped": batches,
        # Tokens the final model never learned from: dropped updates, updates a rewind threw away, skipped data.
        "tokens_skipped": (skipped + rewound + batches) * tokens_per_step if tokens_per_step else None,
        "gradient_norm": grads.summary() if grads else None,
        "throughput": speed.summary() if speed else None,
        "router_collapse": routing.summary() if routing else None,
        "stopped_early": stops[0] if stops else None,
    }


def _fmt(x, spec=".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def format_report(report: Dict) -> str:
    """The report as a short text table."""
    lines = ["", "stability report"]
    spike = report.get("loss_spikes")
    if spike is not None:
        outcomes = ", ".join(f"{k} {v}" for k, v in spike["by_outcome"].items()) or "none"
        lines.append(f"  loss spikes          {spike['events']} ({outcomes}); {spike['rewinds']} rewinds")
    collapse = report.get("router_collapse")
    if collapse is not None:
        layers = ", ".join(f"layer {e['layer']} expert {e['expert']} at step {e['step']}" for e in collapse["list"])
        lines.append(f"  router collapse      {collapse['events']} ({layers or 'none'}); {collapse['open']} open")
    if report.get("non_finite") is not None:
        lines.append(f"  non-finite steps     {report['non_finite']['steps_skipped']} (updates dropped)")
    lines.append(f"  updates skipped      {report['updates_skipped']}; steps rewound {report['steps_rewound']}; "
                 f"batches skipped {report['batches_skipped']}; tokens skipped {_fmt(report['tokens_skipped'], ',')}")
    grads = report.get("gradient_norm")
    if grads:
        lines.append(f"  {'phase':<10} {'steps':>7} {'mean grad norm':>15} {'clip rate':>10}")
        for phase, s in grads["by_phase"].items():
            rate = _fmt(s["clip_rate"] * 100, ".1f") + "%" if s["clip_rate"] is not None else "-"
            lines.append(f"  {phase:<10} {s['steps']:>7} {_fmt(s['mean_norm']):>15} {rate:>10}")
        t = grads["trend"]
        lines.append(f"  grad norm trend      first {_fmt(t['first'])} → last {_fmt(t['last'])}; "
                     f"log-slope {_fmt(t['log_slope_per_1k_steps'])} per 1k steps (second half)")
    speed = report.get("throughput")
    if speed and "tokens_per_s" in speed:
        mfu = f"{speed['mfu'] * 100:.1f}%" if speed.get("mfu") is not None else "-"
        lines.append(f"  throughput           {speed['tokens_per_s']:,.0f} tokens/s, "
                     f"{_fmt(speed.get('flops_per_s'))} FLOP/s, MFU {mfu}")
    if report.get("stopped_early"):
        lines.append(f"  STOPPED EARLY: {report['stopped_early']}")
    return "\n".join(lines)
