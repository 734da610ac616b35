"""`lit-pretrain prepare | train RUN_FILE [key=value ...]`: parse, load the config, call one function."""

import argparse
import dataclasses
import sys
import textwrap

from lit_pretrain.errors import ConfigError, DataError, RunFolderError

USAGE_ERRORS = (ConfigError, DataError, RunFolderError)


def _sections(schema: type, prefix: str = "") -> list:
    """Every config section under `schema`, dotted (data, data.deduplication, ...), read off the typed schema so the
    help cannot drift from it."""
    out = []
    for f in dataclasses.fields(schema):
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            out += [f"{prefix}{f.name}", *_sections(sub, f"{prefix}{f.name}.")]
    return out


def _keys_help(command: str) -> str:
    from lit_pretrain.schema import Config

    every = _sections(Config)
    used = [s for s in every if s == "data" or s.startswith("data.")] if command == "prepare" else every
    text = (f"config sections whose keys `{command}` uses (set any key as section.key=value; each key is "
            f"documented in lit_pretrain/schema.py): {', '.join(used)}.")
    if command == "prepare":
        text += " The other sections are loaded and checked but not used."
    return textwrap.fill(text, width=100)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lit-pretrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("prepare", "read the corpus, check its quality, deduplicate it (exact, then near duplicates), train the "
                    "tokenizer and write token shards into data.prepared_dir"),
        ("train", "pretrain a model as the experiment says, into runs/<run.name>/"),
        ("show", "print the composed, checked config without running anything"),
    ):
        cmd = sub.add_parser(name, help=text, description=textwrap.fill(text, width=100), epilog=_keys_help(name),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.add_argument("run_file", help="experiment file, e.g. experiments/runs/default.yaml")
        cmd.add_argument("overrides", nargs="*", help="key=value (optim.lr_peak=1e-3) or group=name (strategy=ddp)")
    gen = sub.add_parser("generate", help="sample text from a trained run (KV-cache decoding)",
                         description="Continue each --prompt with the run's model; stops at the end-of-document "
                                     "token; prints the samples, then tokens/s on stderr.")
    gen.add_argument("source", metavar="RUN_OR_CKPT", help="a run folder (its checkpoints/last.ckpt) or a checkpoint")
    gen.add_argument("--prompt", action="append", help="text to continue (repeat for several; default: empty)")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="at most this many (default 128; fewer where "
                                                                     "model.seq_len ends)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default 0.8)")
    gen.add_argument("--top-k", type=int, default=None, help="sample among the k most probable tokens")
    gen.add_argument("--top-p", type=float, default=None, help="sample among the most probable tokens of mass p")
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    gen.add_argument("--batch", type=int, default=1, help="samples of each prompt, decoded together (default 1)")
    for name in ("fit", "plan", "memory"):  # parsed by lit_pretrain/scaling/cli.py; listed here for --help
        sub.add_parser(name, help=f"scaling laws and planning: lit-pretrain {name} --help")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("fit", "plan", "memory"):  # scaling laws and planning: lit_pretrain/scaling/cli.py
        from lit_pretrain.scaling.cli import main as scaling_main

        return scaling_main(argv)
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":  # imports torch: only here, so the other commands stay fast
            from lit_pretrain.generate import main as generate_main

            generate_main(args)
            return 0
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
