"""A run's learning-rate schedule across stages: what each resume continues, as plain data a checkpoint records.

A run's schedule is a list of pieces, each setting the rate from its `start` (the 0-based index of the first
optimizer update it sets, = the optimizer steps completed before it) on, as a factor of optim.lr_peak (LambdaLR's
multiplier; a changed optim.lr_peak scales every factor, resume/session.py NewLrPeak). A fresh run has one piece, its
`schedule` over trainer.max_steps (optim/schedule.py lr_at). A resume at step k keeps the checkpoint's pieces when
the config declares what the last one was made from, and otherwise adds one from k on:

- continued (schedule.stage null; trainer.max_steps or schedule.* changed): the schedule as now configured, if at
  the last step trained (k - 1) it gives the rate that step had, so that nothing before k changes meaning: a wsd
  run extended or shortened in its stable phase, any run in its warmup (the ladder's branched cooldowns). Otherwise
  the decay still ahead is re-planned: from the rate reached at k - 1 to schedule.lr_min at the new last step, in
  the schedule's shape (cosine, linear, wsd's decay_shape; constant holds the rate). Extending a finished cosine run
  holds its lr_min; nothing re-warms and nothing jumps.
- stage (schedule.stage set, other than the last piece's): the stage's decay from the rate reached at k - 1 to
  schedule.stage.lr_min at the stage's last step (optim/schedule.py decay_at).

Pure functions of plain data (JSON in the checkpoint's metadata); tests/optim/test_schedule.py tables them.
"""

import math
from dataclasses import asdict
from typing import Dict, List, Optional

from lit_pretrain.optim.schedule import decay_at, lr_at

BASE_KEYS = ("kind", "warmup_steps", "lr_min", "decay_fraction", "decay_shape")
# The shape of the decay a schedule kind re-plans with (wsd: its decay_shape).
DECAY_OF = {"cosine": "cosine", "linear": "linear", "constant": "constant"}


def declared(schedule, max_steps: int) -> Dict:
    """What a piece is made from: the schedule section (a ScheduleConfig) and trainer.max_steps."""
    stage = schedule.stage
    return {"schedule": {k: getattr(schedule, k) for k in BASE_KEYS},
            "stage": None if stage is None else asdict(stage), "max_steps": max_steps}


def _base_rule(d: Dict, lr_peak: float) -> Dict:
    return {"lr_at": {**d["schedule"], "lr_peak": lr_peak, "max_steps": d["max_steps"]}}


def factor_at(pieces: List[Dict], step: int) -> float:
    """The factor of lr_peak the schedule sets for update `step` (0-based)."""
    piece = next(p for p in reversed(pieces) if p["start"] <= step or p is pieces[0])
    rule = piece["rule"]
    if "lr_at" in rule:
        r = rule["lr_at"]
        # Divided by lr_peak as optim/schedule.py lr_lambda does: a run of one piece steps bit for bit as before.
        return lr_at(step, **r) / r["lr_peak"]
    return decay_at(step, **rule["decay"])


def start(schedule, lr_peak: float, max_steps: int) -> List[Dict]:
    """A fresh run's pieces: its schedule from step 0."""
    d = declared(schedule, max_steps)
    return [{"start": 0, "how": "schedule", "declared": d, "rule": _base_rule(d, lr_peak)}]


def from_config(flat: Dict) -> List[Dict]:
    """The pieces of a checkpoint written before they were recorded, from its flattened config: its schedule."""
    d = {"schedule": {k: flat.get(f"schedule.{k}") for k in BASE_KEYS}, "stage": None,
         "max_steps": flat["trainer.max_steps"]}
    if d["schedule"]["decay_shape"] is None:  # a checkpoint older than schedule.decay_shape: the linear decay
        d["schedule"]["decay_shape"] = "linear"
    if d["schedule"]["decay_fraction"] is None:
        d["schedule"]["decay_fraction"] = 0.2
    return [{"start": 0, "how": "schedule", "declared": d, "rule": _base_rule(d, flat["optim.lr_peak"])}]


def resume(previous: List[Dict], step: int, schedule, lr_peak: float, max_steps: int) -> List[Dict]:
    """The pieces of a run resumed at `step` (optimizer steps completed) from a checkpoint holding `previous`."""
    d = declared(schedule, max_steps)
    last = previous[-1]
    if last["declared"] == d:
        return previous  # a resume inside the stage (or an unchanged run): exactly what the checkpoint recorded
    trained = max(step - 1, 0)  # the last update trained
    reached = factor_at(previous, trained)
    stage: Optional[Dict] = d["stage"]
    if stage is not None and stage != last["declared"]["stage"]:
        decay = {"kind": stage["kind"], "from_step": trained, "rate_from": reached,
                 "rate_to": stage["lr_min"] / lr_peak, "last_step": max_steps - 1}
        return [*previous, {"start": step, "how": "stage", "declared": d, "rule": {"decay": decay}}]
    if stage is None:
        rule = _base_rule(d, lr_peak)
        if math.isclose(factor_at([{"start": 0, "rule": rule}], trained), reached, rel_tol=1e-9, abs_tol=0.0):
            return [*previous, {"start": step, "how": "continued", "declared": d, "rule": rule}]
        base = d["schedule"]
        kind = base["decay_shape"] if base["kind"] == "wsd" else DECAY_OF[base["kind"]]
        floor = base["lr_min"] / lr_peak
    else:  # the same stage over another trainer.max_steps: its decay re-planned from where it stands
        kind, floor = stage["kind"], stage["lr_min"] / lr_peak
    decay = {"kind": kind, "from_step": trained, "rate_from": reached, "rate_to": floor, "last_step": max_steps - 1}
    return [*previous, {"start": step, "how": "continued", "declared": d, "rule": {"decay": decay}}]


def describe(pieces: List[Dict], lr_peak: float, resumed_at: Optional[int] = None) -> str:
    """One console line: which schedule the coming steps follow, and from where (steps counted as completed)."""
    last = pieces[-1]
    rule = last["rule"]
    if "lr_at" in rule:
        r = rule["lr_at"]
        what = f"{r['kind']} over trainer.max_steps={r['max_steps']}"
    else:
        r = rule["decay"]
        held = r["kind"] == "constant" or math.isclose(r["rate_from"], r["rate_to"], rel_tol=1e-9)
        to = f" to {r['rate_to'] * lr_peak:.3g} at step {r['last_step'] + 1}"
        what = (f"{'held' if held else r['kind']} from lr {r['rate_from'] * lr_peak:.3g} (the rate of step "
                f"{r['from_step'] + 1}){'' if held else to}")
    if last["how"] == "schedule":
        return f"schedule: {what}"
    name = "a new stage" if last["how"] == "stage" else "continued"
    since = f" from step {last['start']}"
    if resumed_at is not None and resumed_at != last["start"]:
        since += f" (recorded in the checkpoint of step {resumed_at})"
    return f"schedule: {name}{since}: {what}"
