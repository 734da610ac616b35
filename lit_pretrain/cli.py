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
    for name in ("fit", "plan", "memory"):  # parsed by lit_pretrain/scaling/cli.py; listed here for --help
        sub.add_parser(name, help=f"scaling laws and planning: lit-pretrain {name} --help")
    _add_run_views(sub)
    return parser


def _add_run_views(sub) -> None:
    """`compare` and `runs`: runs at a glance (lit_pretrain/compare.py, lit_pretrain/run_table.py; no torch)."""
    text = "plot runs together: loss against tokens and FLOPs, learning rate, gradient norm, throughput"
    cmd = sub.add_parser("compare", help=text, description=text)
    cmd.add_argument("run_dirs", nargs="+", metavar="RUN", help="run folders, e.g. runs/default runs/tiny")
    cmd.add_argument("--out", default="compare.png", help="the figure to write (the only file written)")
    text = "a table of the runs under ROOT: steps, tokens, final losses, bits per byte, tokens/s, status"
    cmd = sub.add_parser("runs", help=text, description=text)
    cmd.add_argument("root", nargs="?", default="runs", help="folder holding run folders (default: runs)")
    cmd.add_argument("--active-minutes", type=float, default=None,
                     help="a run without summary.json that changed this recently is 'running' (default: 15)")


def _run_views(args) -> int:
    try:
        if args.command == "compare":
            from lit_pretrain.compare import compare

            for note in compare(args.run_dirs, args.out):
                print(f"note: {note}")
            print(f"wrote {args.out}")
        else:
            from lit_pretrain.run_table import table

            print(table(args.root, **({} if args.active_minutes is None else {"active_minutes": args.active_minutes})))
    except USAGE_ERRORS as err:
        print(f"lit-pretrain {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("fit", "plan", "memory"):  # scaling laws and planning: lit_pretrain/scaling/cli.py
        from lit_pretrain.scaling.cli import main as scaling_main

        return scaling_main(argv)
    args = _parser().parse_args(argv)
    if args.command in ("compare", "runs"):
        return _run_views(args)
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


if __name__ == "__main__":
    sys.exit(main())
