"""`lit-pretrain prepare | train RUN_FILE [key=value ...]`: parse, load the config, call one function."""

import argparse
import sys

from lit_pretrain.errors import ConfigError, DataError, RunFolderError

USAGE_ERRORS = (ConfigError, DataError, RunFolderError)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lit-pretrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("prepare", "read the corpus, train the tokenizer and write token shards into data.prepared_dir"),
        ("train", "pretrain a model as the experiment says, into runs/<run.name>/"),
        ("show", "print the composed, checked config without running anything"),
    ):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("run_file", help="experiment file, e.g. experiments/runs/default.yaml")
        cmd.add_argument("overrides", nargs="*", help="key=value (optim.lr_peak=1e-3) or group=name (strategy=ddp)")
    text = "run lm-evaluation-harness tasks on a checkpoint; scores into the run folder's eval.json"
    ev = sub.add_parser("evaluate", help=text, description=text)  # lit_pretrain/evaluation/command.py
    ev.add_argument("run", help="a run folder (its checkpoints/last.ckpt) or a checkpoint file in one")
    ev.add_argument("--tasks", required=True, help="comma-separated lm-eval task names, e.g. hellaswag,arc_easy")
    ev.add_argument("--limit", help="examples per task (below 1: a fraction of each task); default all")
    ev.add_argument("--batch-size", type=int, default=8, help="requests per forward pass (default 8)")
    ev.add_argument("--include-path", action="append", default=[], help="folder of task YAML files (repeatable)")
    ev.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: each task's own)")
    ev.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    for name in ("fit", "plan", "memory"):  # parsed by lit_pretrain/scaling/cli.py; listed here for --help
        sub.add_parser(name, help=f"scaling laws and planning: lit-pretrain {name} --help")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("fit", "plan", "memory"):  # scaling laws and planning: lit_pretrain/scaling/cli.py
        from lit_pretrain.scaling.cli import main as scaling_main

        return scaling_main(argv)
    args = _parser().parse_args(argv)
    if args.command == "evaluate":
        return _evaluate(args)
    try:
        from lit_pretrain import config

        cfg = config.load(args.run_file, args.overrides)
        if args.command == "show":
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(cfg), end="")
        elif args.command == "prepare":
            from lit_pretrain.data.prepare import prepare

            prepare(config.to_object(cfg).data)
        else:
            from lit_pretrain.train import train

            train(cfg)
    except USAGE_ERRORS as err:
        print(f"lit-pretrain {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


def _evaluate(args) -> int:
    try:
        from lit_pretrain.evaluation.command import EVAL_FILE, evaluate, format_scores, parse_limit, resolve_run

        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        report = evaluate(args.run, tasks, limit=parse_limit(args.limit), batch_size=args.batch_size,
                          include_path=args.include_path, num_fewshot=args.num_fewshot, device=args.device)
    except USAGE_ERRORS as err:
        print(f"lit-pretrain evaluate: error: {err}", file=sys.stderr)
        return 2
    print(format_scores(report))
    print(f"wrote {resolve_run(args.run)[0] / EVAL_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
