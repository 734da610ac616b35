"""`lit-pretrain simulate RUN_FILE [key=value ...] [--world N] [--ranks 0|corners|all|r,r] [--steps S] [--json]`:
a run file's step at its world size on this machine (docs/large-runs.md). The config loads and is checked as `train`
loads it (config.load: a refused layout is refused here with train's line), except that the corpus need not exist;
then each chosen rank is simulated (simulate/engine.py), and the start check runs (simulate/start_check.py)."""

import argparse
import json
import sys

from lit_pretrain.errors import ConfigError, DataError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lit-pretrain simulate", description=__doc__)
    p.add_argument("run_file", help="experiment file, e.g. experiments/runs/llama3_1_8b_h200x32.yaml")
    p.add_argument("overrides", nargs="*", help="key=value or group=name, as for train")
    p.add_argument("--world", type=int, help="simulate at this many ranks (trainer.num_nodes = N / trainer.devices)")
    p.add_argument("--ranks", default="0", help="0 (default: the data-parallel ranks are alike), corners (each "
                                                "pipeline stage's first and last rank, each expert group), all, "
                                                "or a list: 0,7")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps (default 2: the second holds the "
                                                        "optimizer state through its forward, as every later one)")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="micro-batches of a step to run (default 2; the rest of the accumulation repeats the second)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def world_overrides(run_file: str, overrides: list, world: int) -> list:
    """`overrides` with trainer.num_nodes set so the run has `world` ranks, or a ConfigError naming --world."""
    from lit_pretrain import config

    devices = config.load(run_file, overrides, check_memory=False, check_inputs=False).trainer.devices
    if world < 1 or world % devices:
        raise ConfigError(f"--world {world} is not a multiple of trainer.devices={devices}: give a multiple, or set "
                          f"trainer.devices too")
    return list(overrides) + [f"trainer.num_nodes={world // devices}"]


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        from lit_pretrain import config

        overrides = args.overrides
        if args.world is not None:
            overrides = world_overrides(args.run_file, overrides, args.world)
        cfg = config.load(args.run_file, overrides, check_inputs=False)
        from lit_pretrain.simulate.engine import ranks_to_simulate, simulate_rank
        from lit_pretrain.simulate.report import as_json, format_results, planner_figures
        from lit_pretrain.simulate.start_check import format_start_check, start_check

        ranks = ranks_to_simulate(cfg.plan, args.ranks)
        results = [simulate_rank(cfg, rank, args.steps, args.micro_batches) for rank in ranks]
        planner = planner_figures(cfg)
        check = start_check(cfg, results)
    except (ConfigError, DataError) as err:
        print(f"lit-pretrain simulate: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        out = as_json(cfg, results, planner)
        out["start_check"] = check
        print(json.dumps(out, indent=2))
    else:
        print(format_results(cfg, results, planner))
        print(format_start_check(check))
    return 0 if check["ok"] else 1
