"""`python -m lit_pretrain.launch.commands --nodes N --devices G [RUN_FILE] [key=value ...]`: print the commands
that run an experiment on N nodes × G devices, with torchrun or under SLURM.

Nothing here launches anything: Lightning recognizes both environments by itself (TorchElasticEnvironment from
torchrun's variables, SLURMEnvironment from srun's) and then only joins the processes they started, so the same
`lit-pretrain train` runs on one machine or many with no code change. What must agree: trainer.devices is the
processes per node and trainer.num_nodes the nodes, as the launcher starts them; the commands pass both.
"""

import argparse
import shlex
from typing import List, Sequence

DEFAULT_PORT = 29500


def train_args(run_file: str, nodes: int, devices: int, overrides: Sequence[str]) -> List[str]:
    return ["train", run_file, f"trainer.devices={devices}", f"trainer.num_nodes={nodes}", *overrides]


def check(nodes: int, devices: int) -> None:
    if nodes < 1 or devices < 1:
        raise ValueError(f"--nodes={nodes} --devices={devices}: both must be at least 1")


def torchrun_command(run_file: str, nodes: int, devices: int, overrides: Sequence[str] = (),
                     head: str = "$HEAD_NODE", port: int = DEFAULT_PORT, job_id: str = "lit-pretrain",
                     max_restarts: int = 0) -> str:
    """One command, the same on every node (torchrun's c10d rendezvous at the head node assigns node ranks). With
    max_restarts, every agent restarts its workers after a failure (any node's), and they resume (run.resume=auto)."""
    check(nodes, devices)
    restarts = [f"--max-restarts={max_restarts}"] if max_restarts else []
    resume = ["run.resume=auto"] if max_restarts else []
    cmd = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={devices}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={head}:{port}", f"--rdzv-id={job_id}", *restarts, "-m", "lit_pretrain.cli",
           *train_args(run_file, nodes, devices, [*resume, *overrides])]
    # The head node stays a shell variable for the user to set; everything else is quoted as given.
    return " ".join(c if c.startswith("--rdzv-endpoint=$") else shlex.quote(c) for c in cmd)


SIGNAL_SECONDS = 300
"""`--signal=USR1@300`: the warning before the time limit. It must cover the rest of a step, the checkpoint write
and the requeue; 90 s (SLURM's example) is short for a large model's checkpoint."""


def sbatch_script(run_file: str, nodes: int, devices: int, overrides: Sequence[str] = (),
                  job_name: str = "lit-pretrain", hours: int = 24, signal_seconds: int = SIGNAL_SECONDS,
                  max_restarts: int = 0) -> str:
    """A batch script: one task per device (Lightning's SLURMEnvironment wants ntasks-per-node == devices), that
    survives its time limit and preemption: SIGUSR1 `signal_seconds` before the limit (or SIGTERM on preemption)
    makes every rank checkpoint at the next step boundary; rank 0 then runs `scontrol requeue` and the ranks exit
    0 (resume/preemption.py); the requeued job (--requeue also allows SLURM to requeue it after a node failure)
    continues from the newest verified checkpoint (run.resume=auto; a fresh run starts when there is none).
    max_restarts: srun runs again in the same allocation after a failure, at most that many times (as OLMo-core's
    launch_with_retries.sh); a refused start (exit 2: config or data) is not retried."""
    check(nodes, devices)
    train = " ".join(shlex.quote(a) for a in train_args(run_file, nodes, devices, ["run.resume=auto", *overrides]))
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={devices}",
        f"#SBATCH --gpus-per-node={devices}",
        f"#SBATCH --time={hours}:00:00",
        "#SBATCH --output=%x-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        f"#SBATCH --signal=USR1@{signal_seconds}",
        "# srun starts every task; Lightning's SLURMEnvironment reads SLURM_* for ranks and the head node's address.",
        "# --kill-on-bad-exit: a rank that fails (the watchdog's exit code 3 included) ends the whole step.",
        *(retries(f"srun --kill-on-bad-exit=1 .venv/bin/lit-pretrain {train}", max_restarts) if max_restarts
          else [f"srun --kill-on-bad-exit=1 .venv/bin/lit-pretrain {train}"]),
        "",
    ])


def retries(command: str, max_restarts: int) -> List[str]:
    return [
        f"for attempt in $(seq 0 {max_restarts}); do",
        f"  {command} && exit 0",
        "  code=$?",
        "  [ \"$code\" -eq 2 ] && exit 2  # a refused start: the config or the data is wrong, a retry fails alike",
        f"  echo \"srun failed with exit code $code (attempt $((attempt + 1)) of {max_restarts + 1})\" >&2",
        "done",
        "exit \"$code\"",
    ]


LAUNCH_HELP = ("write an sbatch script (slurm) or print the torchrun command (torchrun) that runs RUN_FILE on N nodes "
               "x G devices; the config is loaded and checked first")


def launch_parser() -> argparse.ArgumentParser:
    """`lit-pretrain launch slurm|torchrun RUN_FILE [key=value ...] --nodes N --gpus-per-node G` (options and
    overrides in any order: parsed with parse_intermixed_args)."""
    cmd = argparse.ArgumentParser(prog="lit-pretrain launch", description=LAUNCH_HELP)
    cmd.add_argument("launcher", choices=["slurm", "torchrun"])
    cmd.add_argument("run_file", help="experiment file, e.g. experiments/runs/default.yaml")
    cmd.add_argument("overrides", nargs="*", help="key=value config overrides, passed on")
    cmd.add_argument("--nodes", type=int, required=True, help="nodes (trainer.num_nodes)")
    cmd.add_argument("--gpus-per-node", type=int, required=True, help="devices per node (trainer.devices)")
    cmd.add_argument("--out", default="lit-pretrain.sbatch", help="slurm: the script to write (it must not exist)")
    cmd.add_argument("--hours", type=int, default=24, help="slurm: the time limit (default 24)")
    cmd.add_argument("--signal-seconds", type=int, default=SIGNAL_SECONDS,
                     help=f"slurm: SIGUSR1 this long before the limit, to checkpoint (default {SIGNAL_SECONDS})")
    cmd.add_argument("--job-name", default="lit-pretrain")
    cmd.add_argument("--max-restarts", type=int, default=0,
                     help="restarts after a failure, each resuming (run.resume=auto): torchrun's --max-restarts, or "
                          "srun run again in the allocation")
    return cmd


def launch_command(args) -> str:
    """The `launch` command: check the config, then write the script or return the command; what to print."""
    from pathlib import Path

    from lit_pretrain import config
    from lit_pretrain.errors import ConfigError

    check(args.nodes, args.gpus_per_node)
    devices = [f"trainer.devices={args.gpus_per_node}", f"trainer.num_nodes={args.nodes}"]
    config.load(args.run_file, [*args.overrides, *devices])  # a bad key or value: refused now
    if args.launcher == "torchrun":
        return ("export HEAD_NODE=<address of the first node>  # then on every node:\n" + torchrun_command(
            args.run_file, args.nodes, args.gpus_per_node, args.overrides, job_id=args.job_name,
            max_restarts=args.max_restarts))
    out = Path(args.out)
    if out.exists():
        raise ConfigError(f"--out {out} exists: choose another file, or remove it first")
    out.write_text(sbatch_script(args.run_file, args.nodes, args.gpus_per_node, args.overrides, args.job_name,
                                 args.hours, args.signal_seconds, args.max_restarts))
    return f"wrote {out}: submit it with `sbatch {out}`"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_pretrain.launch.commands", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2, help="nodes (trainer.num_nodes)")
    parser.add_argument("--devices", type=int, default=8, help="devices per node (trainer.devices)")
    parser.add_argument("run_file", nargs="?", default="experiments/runs/default.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides, passed on")
    args = parser.parse_args(argv)
    try:
        check(args.nodes, args.devices)
    except ValueError as err:
        parser.error(str(err))
    world = args.nodes * args.devices
    print(f"# {args.nodes} nodes x {args.devices} devices = {world} processes. With torchrun, on every node:")
    print("export HEAD_NODE=<address of the first node>")
    print(torchrun_command(args.run_file, args.nodes, args.devices, args.overrides))
    print("\n# With SLURM: save as job.sbatch and run `sbatch job.sbatch`")
    print(sbatch_script(args.run_file, args.nodes, args.devices, args.overrides))


if __name__ == "__main__":
    main()
