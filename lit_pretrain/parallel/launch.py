"""`python -m lit_pretrain.parallel.launch --nodes N --devices G [RUN_FILE] [key=value ...]`: print the commands
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
                     head: str = "$HEAD_NODE", port: int = DEFAULT_PORT, job_id: str = "lit-pretrain") -> str:
    """One command, the same on every node (torchrun's c10d rendezvous at the head node assigns node ranks)."""
    check(nodes, devices)
    cmd = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={devices}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={head}:{port}", f"--rdzv-id={job_id}", "-m", "lit_pretrain.cli",
           *train_args(run_file, nodes, devices, overrides)]
    # The head node stays a shell variable for the user to set; everything else is quoted as given.
    return " ".join(c if c.startswith("--rdzv-endpoint=$") else shlex.quote(c) for c in cmd)


def sbatch_script(run_file: str, nodes: int, devices: int, overrides: Sequence[str] = (),
                  job_name: str = "lit-pretrain", hours: int = 24) -> str:
    """A batch script: one task per device (Lightning's SLURMEnvironment wants ntasks-per-node == devices)."""
    check(nodes, devices)
    train = " ".join(shlex.quote(a) for a in train_args(run_file, nodes, devices, overrides))
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={devices}",
        f"#SBATCH --gpus-per-node={devices}",
        f"#SBATCH --time={hours}:00:00",
        "#SBATCH --output=%x-%j.out",
        "# srun starts every task; Lightning reads SLURM_* for ranks and the head node's address.",
        f"srun .venv/bin/lit-pretrain {train}",
        "",
    ])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_pretrain.parallel.launch", description=__doc__,
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
