"""The world size an external launcher gives against the one the config asks for.

torchrun and SLURM start the processes; Lightning then only joins them, and a config that asks for fewer
(trainer.devices=1, trainer.num_nodes=1 under `torchrun --nnodes=2`) makes each process a run of its own: both
trained alone, exited 0 and wrote into the same run folder. The config is the record of the run (the
batch, the accumulation and a resume's checks all read trainer.devices and trainer.num_nodes), so a mismatch is
refused, naming both keys and the values that fit, before anything is prepared or made; the values are not taken
silently from the launcher.

What each launcher sets: torchrun WORLD_SIZE and LOCAL_WORLD_SIZE (with TORCHELASTIC_RUN_ID); srun SLURM_NTASKS
and SLURM_NNODES. Lightning's own launcher (`trainer.devices=2` on one machine) sets WORLD_SIZE from the config
itself, so it always agrees.
"""

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from lit_pretrain.errors import ConfigError


@dataclass(frozen=True)
class LauncherWorld:
    launcher: str
    world_size: int
    nodes: Optional[int]
    """Nodes, when the launcher says (None: only the total is known)."""
    variables: str
    """The variables read, as NAME=value, for the message."""


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def launcher_world(env: Mapping[str, str] = os.environ) -> Optional[LauncherWorld]:
    """The world torchrun or srun started this process in; None without an external launcher."""
    world, local = _int(env, "WORLD_SIZE"), _int(env, "LOCAL_WORLD_SIZE")
    if "TORCHELASTIC_RUN_ID" in env and world is not None:
        nodes = world // local if local and world % local == 0 else None
        return LauncherWorld("torchrun", world, nodes, f"WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}")
    tasks, nodes = _int(env, "SLURM_NTASKS"), _int(env, "SLURM_NNODES")
    # Lightning's SLURMEnvironment ignores an interactive allocation (job name bash or interactive): so do we.
    if tasks is not None and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return LauncherWorld("srun", tasks, nodes, f"SLURM_NTASKS={tasks}, SLURM_NNODES={nodes}")
    return None


def check_launcher_world(devices: int, num_nodes: int, env: Mapping[str, str] = os.environ) -> None:
    """A ConfigError (one line) when the launcher's world differs from trainer.devices × trainer.num_nodes."""
    given = launcher_world(env)
    if given is None:
        return
    asked = devices * num_nodes
    if given.world_size == asked and given.nodes in (None, num_nodes):
        return
    if given.nodes:
        fix = f"set trainer.devices={given.world_size // given.nodes} trainer.num_nodes={given.nodes}"
    else:
        fix = f"set trainer.devices × trainer.num_nodes to {given.world_size}"
    raise ConfigError(f"{given.launcher} started {given.world_size} processes on "
                      f"{given.nodes if given.nodes else 'an unknown number of'} nodes ({given.variables}), but "
                      f"trainer.devices × trainer.num_nodes = {devices} × {num_nodes} = {asked}: {fix}, or launch "
                      f"as many processes ({asked})")
