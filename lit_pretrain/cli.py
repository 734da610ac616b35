"""`lit-pretrain prepare | train RUN_FILE [key=value ...]`, `export`, `import`, `export-data`, `checkpoint inspect |
consolidate | average`, `launch slurm | torchrun`, `ladder`: parse, load the config, call one function."""

import argparse
import dataclasses
import os
import signal
import sys
import textwrap
import time

from lit_pretrain.errors import ConfigError, DataError, DiskFullError, RunFolderError, StartupError
from lit_pretrain.resume.preemption import EXIT_INTERRUPTED, Interrupted

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
    _hf_commands(sub)
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
    sub.add_parser("simulate", help="a run file's step at its world size on this machine, on a fake process group: "
                                    "peak bytes by kind, collectives, the start check (lit-pretrain simulate --help)")
    sub.add_parser("ladder", help="train a ladder of rungs, fit L(N, D) below a compute limit, predict the rungs "
                                  # parsed by lit_pretrain/scaling/ladder/run.py
                                  "above it: lit-pretrain ladder --help")
    _add_run_views(sub)
    _checkpoint_commands(sub)
    sub.add_parser("launch", help="run on many nodes: lit-pretrain launch --help")  # launch/commands.py
    return parser


def _checkpoint_commands(sub) -> None:
    """`checkpoint inspect | consolidate | average` (lit_pretrain/resume/sharded/inspect.py, tools.py; average.py):
    one process, no process group."""
    text = "look into a checkpoint, write a sharded one as one file, or average several"
    actions = sub.add_parser("checkpoint", help=text, description=text).add_subparsers(dest="action", required=True)
    text = ("print step, layout, tensors, bytes and whether every checksum holds (exit 2 when one does not). Reads "
            "a sharded folder's manifest.json, every file it lists (size, sha256), then DCP's .metadata; or a .ckpt "
            "and its .ckpt.json sidecar")
    cmd = actions.add_parser("inspect", help=text.split(". ")[0], description=text)
    cmd.add_argument("ckpt", metavar="CKPT", help="a run folder (runs/<name>: its newest checkpoint, as load_gpt "
                     "reads), a sharded checkpoint folder (checkpoints/step0000012/) or a .ckpt")
    text = ("write a sharded checkpoint folder as one single-process file, in memory near its largest tensor: a .ckpt "
            "(the one-file format, with its sha256 sidecar .ckpt.json; load_gpt and resume read it) or a "
            ".safetensors (the weights, for run.init_from). Reads manifest.json, verifies every file it lists, "
            "then .metadata, the .distcp shards and trainer_state.pt")
    cmd = actions.add_parser("consolidate", help=text.split(", in memory")[0], description=text)
    cmd.add_argument("ckpt", metavar="CKPT", help="a sharded checkpoint folder (checkpoints/step0000012/)")
    cmd.add_argument("out", metavar="OUT", help="the file to write (it must not exist): *.ckpt or *.safetensors")
    text = ("average a run's last K checkpoints (or those of some steps) into one .ckpt that exports and evaluates "
            "like any other (lit_pretrain/resume/average.py): fp32 weights, a uniform mean unless --weights")
    cmd = actions.add_parser("average", help=text.split(" (")[0], description=text)
    cmd.add_argument("run", metavar="RUN", help="a run folder (runs/<name>) with step checkpoints")
    pick = cmd.add_mutually_exclusive_group(required=True)
    pick.add_argument("--last", type=int, metavar="K", help="the newest K step checkpoints")
    pick.add_argument("--steps", type=_numbers(int), metavar="A,B,C", help="the checkpoints of these steps")
    cmd.add_argument("--weights", type=_numbers(float), metavar="W1,W2,...",
                     help="a weighted merge: one weight per checkpoint, oldest first (normalized by their sum)")
    cmd.add_argument("--out", metavar="FILE", help="the .ckpt to write (it must not exist); default: "
                     "RUN/checkpoints/average-step<first>-<last>-k<K>.ckpt")


def _numbers(kind):
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers, e.g. 1,2,3") from None
    return parse


def _checkpoint(args) -> int:
    try:
        if args.action == "inspect":
            from lit_pretrain.resume.sharded.inspect import format_inspect, inspect

            report = inspect(args.ckpt)
            print(format_inspect(args.ckpt, report))
            if report["failures"]:
                raise DataError(f"checkpoint {report['path']} fails its checksums ({len(report['failures'])} lines "
                                "above): choose another checkpoint")
        elif args.action == "average":
            from lit_pretrain.resume.average import average_run

            print(f"wrote {average_run(args.run, args.last, args.steps, args.weights, args.out)}")
        else:
            from lit_pretrain.resume.sharded.tools import consolidate

            print(f"wrote {consolidate(args.ckpt, args.out)}")
    except USAGE_ERRORS as err:
        print(f"lit-pretrain checkpoint {args.action}: error: {err}", file=sys.stderr)
        return 2
    return 0


def _hf_commands(sub) -> None:
    """export / import: the Hugging Face transformers format (lit_pretrain/interop/hf.py)."""
    text = ("write a checkpoint as a transformers folder (LlamaForCausalLM; Qwen3 with model.qk_norm, "
            "OlmoeForCausalLM with model.moe; safetensors, tokenizer)")
    cmd = sub.add_parser("export", help=text, description=text)
    cmd.add_argument("source", metavar="RUN_OR_CKPT", help="a run folder (its last.ckpt) or a checkpoint file in one")
    cmd.add_argument("--to", choices=["hf"], required=True, help="the format: hf (Hugging Face transformers)")
    cmd.add_argument("out", metavar="OUT", help="the folder to write; it must not exist or be empty")
    cmd.add_argument("--weights", choices=["raw", "ema"], default="raw",
                     help="raw: the trained weights (default); ema: their exponential moving average (callbacks.ema)")
    text = ("write a prepared folder's token shards in another pipeline's format: megatron (.bin + .idx) or numpy "
            "(OLMo-core's flat ids + .csv.gz document offsets), with its tokenizer.json")
    cmd = sub.add_parser("export-data", help=text, description=text)
    cmd.add_argument("--to", choices=["megatron", "numpy"], required=True, help="the format")
    cmd.add_argument("prepared_dir", metavar="PREPARED_DIR", help="a folder `lit-pretrain prepare` wrote")
    cmd.add_argument("out", metavar="OUT", help="the folder to write; it must not exist or be empty")
    text = "start a run from a transformers Llama folder's weights (continued pretraining)"
    cmd = sub.add_parser("import", help=text, description=text)
    cmd.add_argument("hf_folder", metavar="HF_FOLDER",
                     help="config.json (LlamaForCausalLM, Qwen3ForCausalLM or OlmoeForCausalLM) and model.safetensors")
    cmd.add_argument("run_file", nargs="?", help="experiment to train; its model.* keys come from config.json")
    cmd.add_argument("overrides", nargs="*", help="key=value or group=name, as for train")
    cmd.add_argument("--out", metavar="FILE", help="instead of training, write the weights under our names to FILE "
                                                    "(a new .safetensors) for run.init_from=FILE")


def _run_hf(args, started: float) -> None:
    from lit_pretrain.interop import hf

    if args.command == "export":
        print(f"wrote {hf.export_run(args.source, args.out, weights=args.weights)}")
    elif args.out is not None:
        if args.run_file is not None:
            raise ConfigError("import: give RUN_FILE to train from the weights, or --out FILE to write them, not both")
        out = hf.write_weights(args.hf_folder, args.out)
        model_keys = " ".join(o for o in hf.import_overrides(args.hf_folder) if o.startswith("model."))
        print(f"wrote {out}; start a run from it: lit-pretrain train RUN_FILE run.init_from={out} {model_keys}")
    elif args.run_file is None:
        raise ConfigError("import: give RUN_FILE (the experiment to train from the weights) or --out FILE")
    else:
        from lit_pretrain import config

        cfg = config.load(args.run_file, [*hf.import_overrides(args.hf_folder), *args.overrides])
        from lit_pretrain.train import train  # Lightning: only once the folder and config are known to be good

        train(cfg, started=started)


def _add_run_views(sub) -> None:
    """`compare` and `runs`: runs at a glance (lit_pretrain/runs/compare.py, lit_pretrain/runs/table.py; no torch)."""
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
            from lit_pretrain.runs.compare import compare

            for note in compare(args.run_dirs, args.out):
                print(f"note: {note}")
            print(f"wrote {args.out}")
        else:
            from lit_pretrain.runs.table import table

            print(table(args.root, **({} if args.active_minutes is None else {"active_minutes": args.active_minutes})))
    except USAGE_ERRORS as err:
        print(f"lit-pretrain {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    """`lit-pretrain`. A reader that closes the pipe early (`lit-pretrain ladder --plan | head`) ends the command
    quietly with 141 (128 + SIGPIPE, as a shell reports a process ended by it), not with a traceback: Python turns
    the signal into BrokenPipeError, and its interpreter would raise it again flushing stdout at exit, so stdout is
    pointed at /dev/null first."""
    try:
        return _main(argv)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


_COMMANDS = []  # the commands this process has begun (a test calls main several times)


def _command_started() -> float:
    """When this command began (time.perf_counter): the process's first when the process imported the package, its
    imports included (lit_pretrain.STARTED); a later one in the same process when it was called."""
    from lit_pretrain import STARTED

    _COMMANDS.append(time.perf_counter())
    return STARTED if len(_COMMANDS) == 1 else _COMMANDS[-1]


def _main(argv=None) -> int:
    started = _command_started()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("fit", "plan", "memory"):  # scaling laws and planning: lit_pretrain/scaling/cli.py
        from lit_pretrain.scaling.cli import main as scaling_main

        return scaling_main(argv)
    if argv and argv[0] == "ladder":  # the model ladder: lit_pretrain/scaling/ladder/run.py
        from lit_pretrain.scaling.ladder.run import main as ladder_main

        return ladder_main(argv[1:])
    if argv and argv[0] == "simulate":  # a large run checked on this machine: lit_pretrain/simulate/cli.py
        from lit_pretrain.simulate.cli import main as simulate_main

        return simulate_main(argv[1:])
    if argv and argv[0] == "launch":
        return _launch(argv[1:])
    args = _parser().parse_args(argv)
    if args.command in ("compare", "runs"):
        return _run_views(args)
    if args.command == "evaluate":
        return _evaluate(args)
    if args.command == "checkpoint":
        return _checkpoint(args)
    try:
        if args.command == "generate":  # imports torch: only here, so the other commands stay fast
            from lit_pretrain.evaluation.generate import main as generate_main

            generate_main(args)
            return 0
        if args.command in ("export", "import"):
            _run_hf(args, started)
            return 0
        if args.command == "export-data":
            from lit_pretrain.data.export import export_data

            for path in export_data(args.prepared_dir, args.out, args.to):
                print(f"wrote {path}")
            return 0
        from lit_pretrain import config

        cfg = config.load(args.run_file, args.overrides)
        if args.command == "show":
            print(config.to_yaml(cfg), end="")
        elif args.command == "prepare":
            from lit_pretrain.data.datamodule import prepare_sources
            from lit_pretrain.data.preparation.prepare import prepare
            from lit_pretrain.data.pretokenized import is_pretokenized, open_corpus

            data = cfg.data
            if data.sources:  # a mixture: each source's own folder
                manifests = prepare_sources(data)
            elif is_pretokenized(data):  # nothing to write: the files are checked where they lie
                manifests = [open_corpus(data)]
            else:
                manifests = [prepare(data)]
            from lit_pretrain.data.datamodule import source_configs
            from lit_pretrain.data.packing import prepare_report

            for source, manifest in zip(source_configs(data) if data.sources else [data], manifests):
                print(prepare_report(source.prepared_dir, manifest, cfg.model.seq_len, data.packing_buffer))
        elif cfg.run.max_restarts and not _supervised():
            return _supervise(argv, cfg)
        else:
            from lit_pretrain.train import train

            train(cfg, started=started)  # wall_seconds from the command's start: its imports and config load too
    except StartupError as err:  # a rank that never arrived: as the watchdog's failed peer, exit 3 (restartable)
        print(f"lit-pretrain {args.command}: error: {err}", file=sys.stderr)
        return 3
    except DiskFullError as err:  # the data is safe (atomic writes); a restart would fail the same way: exit 2
        print(f"lit-pretrain {args.command}: error: {err.strerror}", file=sys.stderr)
        return 2
    except Interrupted as stop:  # Ctrl-C: the checkpoint is written; rank 0 says how to resume
        if stop.message:
            print(stop.message, flush=True)
        return EXIT_INTERRUPTED
    except USAGE_ERRORS as err:
        print(f"lit-pretrain {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


def _launch(argv) -> int:
    from lit_pretrain.launch.commands import launch_command, launch_parser

    args = launch_parser().parse_intermixed_args(argv)
    try:
        print(launch_command(args))
    except (*USAGE_ERRORS, ValueError) as err:
        print(f"lit-pretrain launch: error: {err}", file=sys.stderr)
        return 2
    return 0


def _supervised() -> bool:
    from lit_pretrain.launch.supervisor import supervised

    return supervised()


def _supervise(argv, cfg) -> int:
    """run.max_restarts > 0: this process supervises the run and restarts it (lit_pretrain/launch/supervisor.py)."""
    from lit_pretrain.launch.supervisor import supervise
    from lit_pretrain.launch.world import launcher_world
    from lit_pretrain.runs.folder import run_dir_path

    given = launcher_world()
    if given is not None:
        how = "torchrun's --max-restarts" if given.launcher == "torchrun" else "the job's requeue (#SBATCH --requeue)"
        raise ConfigError(f"run.max_restarts={cfg.run.max_restarts} restarts a run on one machine, but "
                          f"{given.launcher} started this one: set run.max_restarts=0 and use {how}")
    return supervise(argv, cfg.run.max_restarts, run_dir_path(cfg.run.root_dir, cfg.run.name), cfg.run.overwrite,
                     cfg.run.resume)


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
