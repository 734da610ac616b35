"""Beyond one machine: the printed torchrun / sbatch commands, and torchrun really running `lit-pretrain train`."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lit_pretrain import cli
from lit_pretrain.launch.commands import main, sbatch_script, torchrun_command
from tests.conftest import EXPERIMENTS, tiny_data_overrides


def test_torchrun_command_passes_nodes_and_devices_to_the_config():
    cmd = torchrun_command("experiments/runs/default.yaml", 4, 8, ["strategy=zero", "strategy.zero_stage=3"])
    assert cmd == ("torchrun --nnodes=4 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=$HEAD_NODE:29500 "
                   "--rdzv-id=lit-pretrain -m lit_pretrain.cli train experiments/runs/default.yaml "
                   "trainer.devices=8 trainer.num_nodes=4 strategy=zero strategy.zero_stage=3")


def test_sbatch_script_has_one_task_per_device():
    script = sbatch_script("experiments/runs/default.yaml", 2, 4, ["run.name=big"])
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=4\n#SBATCH --gpus-per-node=4\n" in script
    assert script.splitlines()[-1] == ("srun --kill-on-bad-exit=1 .venv/bin/lit-pretrain train "
                                       "experiments/runs/default.yaml trainer.devices=4 trainer.num_nodes=2 "
                                       "run.resume=auto run.name=big")


def test_launch_slurm_writes_a_requeueing_script_that_bash_parses(tmp_path, capsys):
    """`lit-pretrain launch slurm`: requeue, SIGUSR1 before the limit (the checkpoint), resume=auto, one task per
    device, the srun retry loop; the config is checked first (a wrong key: exit 2, nothing written)."""
    out = tmp_path / "job.sbatch"
    # tiny.yaml's 512 tokens a step over 8 data-parallel ranks: micro-batches of 1 x 64 tokens
    argv = ["launch", "slurm", str(EXPERIMENTS / "runs" / "tiny.yaml"), "--nodes", "2", "--gpus-per-node", "4",
            "--out", str(out), "strategy=ddp", "trainer.micro_batch_size=1", "--max-restarts", "2", "--hours", "4"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == f"wrote {out}: submit it with `sbatch {out}`\n"
    lines = out.read_text().splitlines()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --time=4:00:00", "#SBATCH --requeue", "#SBATCH --signal=USR1@300",
                 "#SBATCH --open-mode=append", "for attempt in $(seq 0 2); do", "exit \"$code\""):
        assert line in lines, line
    assert (f"  srun --kill-on-bad-exit=1 .venv/bin/lit-pretrain train {EXPERIMENTS / 'runs' / 'tiny.yaml'} "
            "trainer.devices=4 trainer.num_nodes=2 run.resume=auto strategy=ddp trainer.micro_batch_size=1 "
            "&& exit 0") in lines
    done = subprocess.run(["bash", "-n", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert cli.main(argv) == 2 and "exists" in capsys.readouterr().err  # never overwritten
    bad = tmp_path / "bad.sbatch"
    assert cli.main([*argv[:8], str(bad), "strategy=ddp", "trainer.nope=1"]) == 2
    assert "unknown config key 'trainer.nope'" in capsys.readouterr().err and not bad.exists()


def test_launch_torchrun_with_restarts_resumes():
    cmd = torchrun_command("r.yaml", 2, 8, ["strategy=ddp"], max_restarts=3)
    assert cmd == ("torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=$HEAD_NODE:29500 "
                   "--rdzv-id=lit-pretrain --max-restarts=3 -m lit_pretrain.cli train r.yaml trainer.devices=8 "
                   "trainer.num_nodes=2 run.resume=auto strategy=ddp")


def test_cli_prints_both_and_refuses_zero_devices(capsys):
    main(["--nodes", "3", "--devices", "2", "experiments/runs/tiny.yaml"])
    out = capsys.readouterr().out
    assert "3 nodes x 2 devices = 6 processes" in out and "torchrun --nnodes=3" in out and "#SBATCH --nodes=3" in out
    with pytest.raises(SystemExit):
        main(["--devices", "0"])
    assert "--devices=0: both must be at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_torchrun_runs_the_train_command_unchanged(tmp_path, tiny_data_dir):
    """1 node × 2 processes started by torchrun (not by Lightning): Lightning joins them as they are."""
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun is not installed next to this Python")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = torchrun_command(str(EXPERIMENTS / "runs" / "tiny.yaml"), 1, 2, [
        *tiny_data_overrides(tiny_data_dir), f"run.root_dir={tmp_path}", "run.name=torchrun", "strategy=zero",
        "strategy.zero_stage=3", "trainer.micro_batch_size=4", "trainer.max_steps=3", "trainer.val_every_n_steps=3",
        "schedule.warmup_steps=1",
        "trainer.progress_bar=false", "strategy.timeout_seconds=60"], head="127.0.0.1", port=port)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    done = subprocess.run(cmd, shell=True, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "torchrun" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert len(json.loads((tmp_path / "torchrun" / "memory.json").read_text())["ranks"]) == 2
