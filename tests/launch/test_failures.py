"""Failures on many nodes, the parts that need no second process: the launcher's world size against the config,
the supervisor's restart command, the watchdog's view of a process."""

import os
import subprocess

import pytest

from lit_pretrain import cli
from lit_pretrain.errors import ConfigError
from lit_pretrain.launch.supervisor import latest_step, restart_args
from lit_pretrain.launch.watchdog import proc_state
from lit_pretrain.launch.world import check_launcher_world, launcher_world
from tests.conftest import EXPERIMENTS

TORCHRUN_2x1 = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "RANK": "1",
                "LOCAL_RANK": "0", "GROUP_RANK": "1"}


@pytest.mark.parametrize("env, world, nodes", [
    ({}, None, None),
    # Lightning's own launcher sets WORLD_SIZE from the config itself: not an external launcher.
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}, None, None),
    (TORCHRUN_2x1, 2, 2),
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, 8, 2),
    ({"SLURM_NTASKS": "16", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "train"}, 16, 2),
    ({"SLURM_NTASKS": "1", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "bash"}, None, None),  # an interactive shell
])
def test_launcher_world_reads_torchrun_and_srun(env, world, nodes):
    got = launcher_world(env)
    assert (got.world_size if got else None, got.nodes if got else None) == (world, nodes)


def test_world_size_mismatch_names_both_keys_and_the_fix():
    check_launcher_world(1, 2, TORCHRUN_2x1)
    with pytest.raises(ConfigError) as err:
        check_launcher_world(1, 1, TORCHRUN_2x1)
    assert str(err.value) == (
        "torchrun started 2 processes on 2 nodes (WORLD_SIZE=2, LOCAL_WORLD_SIZE=1), but trainer.devices × "
        "trainer.num_nodes = 1 × 1 = 1: set trainer.devices=1 trainer.num_nodes=2, or launch as many processes (1)")
    with pytest.raises(ConfigError, match="trainer.devices=1 trainer.num_nodes=2"):  # the right total, wrong split
        check_launcher_world(2, 1, TORCHRUN_2x1)


def test_torchrun_two_nodes_without_num_nodes_is_refused_before_the_run_folder(tmp_path, monkeypatch, capsys):
    """The reported case: `torchrun --nnodes=2 --nproc-per-node=1` without trainer.num_nodes=2 trained two runs of
    one process into one folder. Now: exit 2, one line, no folder (the environment is node 1's, as torchrun sets
    it; the two-agent run itself is in tests/launch/test_multinode.py)."""
    for key, value in TORCHRUN_2x1.items():
        monkeypatch.setenv(key, value)
    rc = cli.main(["train", str(EXPERIMENTS / "runs" / "tiny.yaml"), f"run.root_dir={tmp_path}", "run.name=two"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "trainer.num_nodes=2" in err, err
    assert list(tmp_path.iterdir()) == []


def test_restart_resumes_from_latest_or_starts_again_only_in_its_own_folder(tmp_path):
    run = tmp_path / "run"
    argv = ["train", "r.yaml"]
    # No checkpoint yet: a fresh start again, but only in a folder the first attempt made.
    assert restart_args(argv, run, True, None) == [*argv, "run.resume=null", "run.overwrite=true"]
    assert restart_args(argv, run, False, "auto") == [*argv, "run.resume=auto"]
    assert restart_args(argv, run, True, "/x/step0000004.ckpt") == [*argv, "run.overwrite=false"]
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step0000012\n")
    assert latest_step(run) == 12
    for fresh, resume in ((True, None), (False, "auto"), (True, "/x/step0000004.ckpt")):
        assert restart_args(argv, run, fresh, resume) == [*argv, "run.resume=auto", "run.overwrite=false"]


def test_proc_state_tells_running_gone_and_reused_pids():
    assert proc_state(os.getpid()) in ("R", "S")
    done = subprocess.Popen(["true"])
    done.wait()  # reaped: the pid is free
    assert proc_state(done.pid) is None
    stat = open(f"/proc/{os.getpid()}/stat").read()
    start = stat[stat.rindex(")") + 2:].split()[19]
    assert proc_state(os.getpid(), start) is not None
    assert proc_state(os.getpid(), str(int(start) + 1)) is None  # same pid, another process: not ours to kill
