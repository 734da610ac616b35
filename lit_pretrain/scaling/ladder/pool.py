"""The ladder with `workers` > 1: up to that many rungs train at once, each in its own process
(`python -m lit_pretrain.scaling.ladder.worker GRID RUNG`, the same train_rung as the one-worker ladder runs in its own
process, its output in the rung's train.log).

A rung starts when what it needs is there: a branched budget once the run it branches from is complete; a held-out
rung once every other rung is complete and prediction.json is written (ladder_report.write_prediction), so the
prediction still comes before any held-out rung trains. Among the ready rungs the one of most training FLOPs starts
first (the longest job first keeps both workers busy to the end).

Signals. The workers share the ladder's process group, so Ctrl-C at the terminal reaches each of them, and each
stops at its next checkpoint (ladder_rung.LadderSignals, as in the ladder's own process); a signal sent to the ladder
alone is passed to each worker as SIGTERM, which does the same. No rung starts after a signal; the ladder waits for
its workers, then stops with the command that continues it (LadderStopped).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from lit_pretrain.scaling.ladder.state import (
    LadderStopped,
    checkpointed_step,
    duration,
    read_summary,
    rung_complete,
    rung_state,
)

POLL_SECONDS = 0.5


def train_parallel(grid, grid_path: Path, rungs: List[dict], max_rungs: Optional[int], log: Callable, signals,
                   command: str):
    """As ladder._train_rungs, with grid.workers rungs at a time: the fit write_prediction made (or None), False
    where --max-rungs stopped it; LadderStopped where a signal stopped it; RuntimeError where a rung failed."""
    root = Path(grid.root_dir)
    index = {r["name"]: k for k, r in enumerate(rungs, start=1)}
    pending: List[dict] = []
    for rung in rungs:
        if rung_state(root / rung["name"], rung) == "finished":
            log(f"{_head(rung, index, rungs)}: finished earlier, val loss "
                f"{read_summary(root / rung['name'])['final_val_loss']:.4f}, not trained again")
        else:
            pending.append(rung)
    running: Dict[str, tuple] = {}  # name -> (process, rung, started, resumed-from step)
    started, launched, done_flops, fitted, failed, forwarded = time.perf_counter(), 0, 0.0, None, [], False

    def complete(name: str) -> bool:
        rung = next(r for r in rungs if r["name"] == name)
        return rung_complete(read_summary(root / name), rung)

    def ready(rung: dict) -> bool:
        if rung["branch_of"]:
            return complete(rung["branch_of"])
        if rung["role"] == "held_out":
            return not running and all(complete(r["name"]) for r in rungs if r["role"] != "held_out")
        return True

    while pending or running:
        may_start = signals.signum is None and not failed and (max_rungs is None or launched < max_rungs)
        for rung in sorted(pending, key=lambda r: -r["train_flops_own"]):
            if not may_start or len(running) >= grid.workers or not ready(rung):
                continue
            if rung["role"] == "held_out" and fitted is None:
                from lit_pretrain.scaling.ladder.report import write_prediction

                fitted = write_prediction(grid, rungs, log)  # every other rung is complete: predict first
            step = checkpointed_step(root / rung["name"])
            log(f"{_head(rung, index, rungs)}: started" + (f", resumes from step {step}" if step else "")
                + f" (log {root / rung['name'] / 'train.log'})")
            process = subprocess.Popen([sys.executable, "-m", "lit_pretrain.scaling.ladder.worker", str(grid_path),
                                        rung["name"]], stdin=subprocess.DEVNULL)
            running[rung["name"]] = (process, rung, time.perf_counter())
            pending.remove(rung)
            launched += 1
        if signals.signum is not None and not forwarded:
            forwarded = True
            for process, _, _ in running.values():
                _terminate(process)
        time.sleep(POLL_SECONDS)
        for name, (process, rung, rung_started) in list(running.items()):
            if process.poll() is None:
                continue
            del running[name]
            summary = read_summary(root / name)
            head = _head(rung, index, rungs)
            if rung_complete(summary, rung):
                share = summary["session_train_seconds"] / summary["train_seconds"] \
                    if summary.get("train_seconds") else 1.0
                done_flops += rung["train_flops_own"] * min(1.0, share)
                elapsed = time.perf_counter() - started
                rate = done_flops / elapsed if done_flops > 0 else grid.flops_per_second * grid.workers
                left = [r for r in pending + [x[1] for x in running.values()]]
                log(f"{head}: val loss {summary['final_val_loss']:.4f} in "
                    f"{duration(time.perf_counter() - rung_started)}; elapsed {duration(elapsed)}, "
                    f"estimated time left {duration(sum(r['train_flops_own'] for r in left) / rate)} "
                    f"({rate:.3g} FLOP/s so far)")
            elif signals.signum is not None or process.returncode == 0:
                signals.signum = signals.signum or signal.SIGTERM  # the worker's own handler took a signal
                log(f"{head}: stopped with its checkpoint of step {checkpointed_step(root / name)} of "
                    f"{rung['steps']}; not fitted or reported until it is complete")
            else:
                failed.append(name)
                log(f"{head}: failed (exit {process.returncode}; its output: {root / name / 'train.log'})")
        if not running and pending and not any(ready(r) for r in pending) and not failed \
                and signals.signum is None:
            raise RuntimeError(f"ladder: rungs {[r['name'] for r in pending]} wait for rungs that are not complete")
        if not running and (failed or signals.signum is not None or
                            (max_rungs is not None and launched >= max_rungs and pending)):
            break
    if failed:
        raise RuntimeError(f"ladder: rungs {failed} failed; their output is in their train.log; run the same command "
                           "again to continue")
    if signals.signum is not None:
        log(f"ladder stopped by {signals.name}; continue with: {command}")
        raise LadderStopped(signals.signum)
    if pending:
        log(f"stopping after {launched} rungs (--max-rungs {max_rungs}): run the same command again to continue")
        return False
    return fitted


def _head(rung: dict, index: Dict[str, int], rungs: List[dict]) -> str:
    return f"rung {index[rung['name']]} of {len(rungs)} {rung['name']} ({rung['role']}, C {rung['flops']:.3g})"


def _terminate(process: subprocess.Popen) -> None:
    try:
        os.kill(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
