"""Two "nodes" on one machine: two torchrun agents (`--nnodes=2 --nproc-per-node=1`, one c10d rendezvous), started
with the command `lit-pretrain launch` prints, train bitwise what one node of 2 processes trains, under DDP and under
ZeRO-3 (FSDP2); without trainer.num_nodes=2 both refuse to start."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_pretrain.launch.commands import torchrun_command
from lit_pretrain.resume.weights import read_checkpoint
from tests.conftest import EXPERIMENTS, free_port, run_module, tiny_data_overrides, train_args

pytestmark = pytest.mark.slow

COMMON = ["trainer.max_steps=3", "trainer.val_every_n_steps=3", "trainer.log_every_n_steps=1",
          "schedule.warmup_steps=1", "trainer.progress_bar=false", "strategy.timeout_seconds=60",
          "trainer.val_windows=8", "trainer.micro_batch_size=4"]
LAYOUTS = {"ddp": ["strategy=ddp"], "zero3": ["strategy=zero", "strategy.zero_stage=3"]}


def agents_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # torchrun beside this Python
    return env


def two_agents(tmp_path: Path, data_dir: Path, name: str, overrides: list) -> list:
    """The torchrun command for 2 nodes x 1 device, run twice at once (node ranks come from the rendezvous)."""
    cmd = torchrun_command(str(EXPERIMENTS / "runs" / "tiny.yaml"), 2, 1, [
        *tiny_data_overrides(data_dir), f"run.root_dir={tmp_path}", f"run.name={name}", *overrides],
        head="127.0.0.1", port=free_port(), job_id=name)
    procs = [subprocess.Popen(cmd, shell=True, env=agents_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    return [(p.wait(timeout=300), p.stdout.read()) for p in procs]


def losses(run_dir: Path) -> list:
    from lit_pretrain.runs.folder import read_metrics, series

    rows = read_metrics(run_dir / "metrics.csv")
    return series(rows, "train/loss") + series(rows, "val/loss")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_torchrun_nodes_train_bitwise_one_node_of_two(tmp_path, tiny_data_dir, layout):
    """Same global ranks, same data, same gloo reductions over loopback: equality is bitwise, not approximate."""
    run_module(*train_args(tiny_data_dir, tmp_path, "one-node"), *COMMON, *LAYOUTS[layout], "trainer.devices=2")
    for code, out in two_agents(tmp_path, tiny_data_dir, "two-nodes", [*COMMON, *LAYOUTS[layout]]):
        assert code == 0, out[-4000:]
    one, two = tmp_path / "one-node", tmp_path / "two-nodes"
    assert len(losses(one)) == 4 and losses(two) == losses(one)
    a, b = read_checkpoint(one)["state_dict"], read_checkpoint(two)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_torchrun_nodes_without_num_nodes_refuse_to_start(tmp_path, tiny_data_dir):
    """The reported case: `--nnodes=2 --nproc-per-node=1` with trainer.num_nodes=1 trained two separate runs into
    one folder. Now each node's process prints one line naming the keys and nothing is made."""
    for code, out in two_agents(tmp_path, tiny_data_dir, "mismatch", [*COMMON, "trainer.num_nodes=1"]):
        assert code != 0
        assert ("lit-pretrain train: error: torchrun started 2 processes on 2 nodes (WORLD_SIZE=2, "
                "LOCAL_WORLD_SIZE=1), but trainer.devices × trainer.num_nodes = 1 × 1 = 1: set trainer.devices=1 "
                "trainer.num_nodes=2") in out, out[-3000:]
    assert not (tmp_path / "mismatch").exists()
