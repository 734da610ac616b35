"""`lit-pretrain ladder [GRID.yaml] [--small]` / `make ladder`: train a ladder of rungs (model sizes × token budgets),
fit L(N, D) = E + A/N^alpha + B/D^beta to the rungs below a compute limit, predict the rungs above it, and report.

A grid file is data (yaml.safe_load). Each rung is a normal `lit-pretrain train` run in <root_dir>/<rung name>,
trained in order of compute, in this process, its output in <root_dir>/<rung name>/train.log; the console shows one
line a rung (scaling/ladder/rung.py). The ladder resumes rung by rung: a rung whose summary.json records all its
planned steps and its parameter count is complete (ladder_state.rung_complete) and never trained again; a rung folder
with a checkpoint continues from it (run.resume=auto); a rung folder without one (killed before its first checkpoint)
starts again. SIGINT or SIGTERM stops the whole ladder at the running rung's next checkpoint and prints the command that
continues it; a rung short of its planned steps is never fitted, predicted from or reported as measured. Before the
first held-out rung trains, the law is fitted and its predictions written to prediction.json; the file is kept while
the fitted rungs it came from are unchanged, and written again when they change. The fit, the predictions and the
picture are lit_pretrain/scaling/ladder/report.py.

Compute is C = 6·N·D throughout (N all parameters, D training tokens: Hoffmann et al. 2022 §3.3), so the compute
limit and the law's compute-optimal allocation (eq. 4) count alike; the time estimate uses each rung's
flops_per_token (6N + 12LHQT, PaLM appendix B), closer to what a step costs. The grid file and the planned rungs are
grid.py.
"""

import argparse
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

from lit_pretrain.errors import ConfigError, DataError, RunFolderError
from lit_pretrain.scaling.ladder.grid import (
    DEFAULT_GRID,
    SMALL_GRID,
    LadderGrid,
    estimate_seconds,
    load_grid,
    plan_rungs,
)
from lit_pretrain.scaling.ladder.state import (
    LadderStopped,
    checkpointed_step,
    duration,
    read_summary,
    rung_complete,
    rung_state,
)


def run_ladder(grid_file: str | Path, max_rungs: Optional[int] = None, plan_only: bool = False,
               log: Callable = print, command: Optional[str] = None, mfu: Optional[float] = None) -> Optional[dict]:
    """Train every unfinished rung (at most `max_rungs` in this call), then fit, predict and write the report.
    `log(text, end="\n")` prints like print (a rung's line is begun before it trains and ended after). `command`:
    the command line that continues the ladder, printed when a signal stops it (LadderStopped is raised then)."""
    path = Path(grid_file)
    command = command or f"lit-pretrain ladder {shlex.quote(str(path))}"
    grid = load_grid(path)
    rungs = plan_rungs(grid, path)
    fitted = [r for r in rungs if r["role"] == "fit"]
    held = [r for r in rungs if r["role"] == "held_out"]
    largest = max(r["flops"] for r in fitted)
    own = sum(r["train_flops_own"] for r in rungs)
    estimate = estimate_seconds(rungs, grid.flops_per_second, grid.workers, grid.held_out_threads or 1)
    log(f"ladder {path}: {len(rungs)} rungs ({len(fitted)} fitted at C <= {grid.compute_limit_flops:.3g} FLOPs, "
        f"{sum(r['role'] == 'dev' for r in rungs)} development, {len(held)} held out, the largest at "
        f"{max(r['flops'] for r in held) / largest:.1f}x the largest fitted compute), {own:.3g} training FLOPs "
        f"(branched cooldowns train only their own steps); estimated {duration(estimate)} at "
        f"{grid.flops_per_second:.3g} FLOP/s a worker, {grid.workers} worker(s)")
    for r in rungs:
        branch = f"  from {r['branch_of']} at step {r['branch_step']}" if r["branch_of"] else ""
        log(f"  {r['name']:<18} {r['role']:<8} N {r['params']:>11,} (non-embedding {r['non_embedding_params']:,})  "
            f"steps {r['steps']:>6}  D {r['tokens']:>13,}  tokens_per_param {r['tokens_per_param']:>6.3g}  "
            f"C {r['flops']:.3g}  lr {r['lr']:.3g}  batch {r['sequences']}x{r['tokens_per_step'] // r['sequences']}"
            f"  beta2 {r['beta2']}  warmup {r['warmup_steps']}{branch}")
    if mfu is not None:
        log(gpu_hours_line(own, mfu, grid.gpu))
    if plan_only:
        return None
    from lit_pretrain.scaling.ladder.rung import LadderSignals  # imports Lightning: not for --plan

    log(f"each rung's output: {Path(grid.root_dir) / '<rung>' / 'train.log'}")
    signals = LadderSignals().install()
    try:
        if grid.workers > 1:
            from lit_pretrain.scaling.ladder.pool import train_parallel

            fitted = train_parallel(grid, path, rungs, max_rungs, log, signals, command)
        else:
            fitted = _train_rungs(grid, rungs, max_rungs, log, signals, command)
        if fitted is False:
            return None
        from lit_pretrain.scaling.ladder.report import report, write_prediction

        # every rung is complete now: a prediction.json from other fitted losses is written again before reporting
        fitted = write_prediction(grid, rungs, log, fitted)
        return report(grid, path, rungs, log=log, fitted=fitted)
    finally:
        signals.uninstall()


def _train_rungs(grid: LadderGrid, rungs: List[dict], max_rungs: Optional[int], log: Callable, signals,
                 command: str):
    """The loop of run_ladder: the fit write_prediction made in this call (or None), or False where --max-rungs
    stopped it; LadderStopped where a signal did."""
    from lit_pretrain.scaling.ladder.rung import RungOutput, train_rung

    root = Path(grid.root_dir)
    started, trained, done_flops, fitted = time.perf_counter(), 0, 0.0, None

    def stop(where: str):
        log(f"ladder stopped by {signals.name} {where}; continue with: {command}")
        raise LadderStopped(signals.signum)

    for k, rung in enumerate(rungs, start=1):
        folder = root / rung["name"]
        state = rung_state(folder, rung)
        head = f"rung {k} of {len(rungs)} {rung['name']} ({rung['role']}, C {rung['flops']:.3g})"
        if state == "finished":
            log(f"{head}: finished earlier, val loss {read_summary(folder)['final_val_loss']:.4f}, not trained again")
            continue
        if signals.signum is not None:
            stop(f"before rung {k} of {len(rungs)} {rung['name']}")
        if max_rungs is not None and trained >= max_rungs:
            log(f"stopping after {trained} rungs (--max-rungs {max_rungs}): run the same command again to continue")
            return False
        if rung["role"] == "held_out":
            from lit_pretrain.scaling.ladder.report import write_prediction

            # every fitted rung is complete (rungs run in order of compute): predict before training this one
            fitted = write_prediction(grid, rungs, log, fitted)
        resumed = f"resumed from step {checkpointed_step(folder)}, " if state == "partial" else ""
        log(f"{head}: ", end="")
        rung_started = time.perf_counter()
        output = RungOutput(root, folder)
        try:
            summary = train_rung(grid, rung, signals, output)
        except BaseException as err:
            # A signal during the rung's start or final validation (Lightning's own SIGTERM handling raises
            # SIGTERMException there): the rung's checkpoints stand, the next call continues from them.
            if signals.signum is not None and not isinstance(err, KeyboardInterrupt):
                log(f"stopped by {signals.name} before its next checkpoint (log {folder / 'train.log'})")
                stop(f"in rung {k} of {len(rungs)} {rung['name']}")
            log(f"failed: {type(err).__name__} (its output: {'below' if output.unplaced else folder / 'train.log'})")
            if output.unplaced:  # refused before its folder was made: no log holds these lines
                log(output.unplaced.rstrip("\n"))
            raise
        trained += 1
        if not rung_complete(summary, rung):
            log(f"stopped by {signals.name} with its checkpoint of step {checkpointed_step(folder)} of "
                f"{rung['steps']}; not fitted or reported until it is complete")
            stop(f"in rung {k} of {len(rungs)} {rung['name']}")
        # a resumed rung trained only its remaining part in this call
        share = summary["session_train_seconds"] / summary["train_seconds"] if summary.get("train_seconds") else 1.0
        done_flops += rung["train_flops_own"] * min(1.0, share)
        elapsed = time.perf_counter() - started
        rate = done_flops / elapsed if done_flops > 0 else grid.flops_per_second
        left = [r for r in rungs[k:] if rung_state(root / r["name"], r) != "finished"]
        log(f"{resumed}val loss {summary['final_val_loss']:.4f} in {duration(time.perf_counter() - rung_started)}; "
            f"elapsed {duration(elapsed)}, estimated time left "
            f"{duration(estimate_seconds(left, rate, held_out_threads=grid.held_out_threads or 1))} "
            f"({rate:.3g} FLOP/s so far)")
        if signals.signum is not None:  # it reached the rung as its last step was done
            stop(f"after rung {k} of {len(rungs)} {rung['name']}")
    return fitted


def gpu_hours_line(train_flops: float, mfu: float, gpu: str) -> str:
    """The grid's GPU-hours at `mfu` of the GPU's dense bf16 peak (scaling/gpu_hours.py)."""
    from lit_pretrain.gpu_peaks import bf16_peak_flops
    from lit_pretrain.scaling.gpu_hours import format_gpu_hours, gpu_hours

    gpu = gpu or "H100"
    peak = bf16_peak_flops(gpu, f"gpu={gpu}")
    return (f"{train_flops:.3g} training FLOPs (6N + attention, PaLM appendix B; branched cooldowns once):"
            + format_gpu_hours(gpu_hours(train_flops, mfu, peak), mfu, gpu, peak, "--mfu").removeprefix(" "))


def _print(text: str = "", end: str = "\n") -> None:
    print(text, end=end, flush=True)


def ladder_parser() -> argparse.ArgumentParser:
    """`lit-pretrain ladder`'s arguments (tests/test_docs.py parses the documented commands with it)."""
    parser = argparse.ArgumentParser(prog="lit-pretrain ladder", description=__doc__.split("\n\n")[0])
    parser.add_argument("grid", nargs="?", help=f"grid file (default {DEFAULT_GRID}; --small: {SMALL_GRID})")
    parser.add_argument("--small", action="store_true", help=f"the small grid of seconds-long rungs ({SMALL_GRID})")
    parser.add_argument("--max-rungs", type=int, help="train at most this many rungs in this call, then stop")
    parser.add_argument("--plan", action="store_true", help="print the rungs and the time estimate; train nothing")
    parser.add_argument("--mfu", type=float, help="with --plan: print the grid's GPU-hours at this model FLOPs "
                        "utilization (e.g. 0.4) of the grid's gpu (its dense bf16 peak)")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ladder_parser().parse_args(argv)
    if args.mfu is not None and not args.plan:
        print("lit-pretrain ladder: error: --mfu goes with --plan (it prints the grid's GPU-hours)", file=sys.stderr)
        return 2
    grid = args.grid or (SMALL_GRID if args.small else DEFAULT_GRID)
    command = " ".join(["lit-pretrain", "ladder", *map(shlex.quote, argv)])
    try:
        run_ladder(grid, max_rungs=args.max_rungs, plan_only=args.plan, log=_print, command=command, mfu=args.mfu)
    except (ConfigError, DataError, RunFolderError) as err:
        print(f"lit-pretrain ladder: error: {err}", file=sys.stderr)
        return 2
    except LadderStopped as stopped:
        # 128 + the signal, as a shell reports a process ended by it (130 for Ctrl-C); SIGTERM's where the run's own
        # handler took the signal
        return 128 + (stopped.signum or signal.SIGTERM)
    except KeyboardInterrupt:
        print(f"\nlit-pretrain ladder: stopped at once by a second Ctrl-C; continue with: {command}", flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
