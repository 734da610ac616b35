"""Start-up bounded on its own: every rank joins the rendezvous store within strategy.startup_timeout_seconds, or the
job ends with one line naming the ranks that did not arrive.

torch's env:// rendezvous waits for the whole world for the process-group timeout (strategy.timeout_seconds, 1800 s
here): a rank that hangs before it joins (a node that never booted, a stuck import, a container still pulling)
held the job for half an hour and then failed without saying which rank was missing. As torchtitan bounds its
start-up apart from its collectives (comm.init_timeout_seconds, 300 s), the store is made here with the start-up
timeout, each rank sets its own key in it, and one server-side wait on all keys (no polling: O(world) messages)
ends at the start-up timeout; only then are the keys read one by one, to name the missing ranks. The process group
is then made over the same store, with the collective timeout.
"""

import os
import socket
from datetime import timedelta
from typing import List, Optional

import torch.distributed as dist

from lit_pretrain.errors import StartupError
from lit_pretrain.internals import BeforeProcessGroup, process_group_backend, process_group_timeout

KEY_PREFIX = "lit_pretrain/startup/"


def _ranks(ranks: List[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def form_world(address: str, port: int, rank: int, world_size: int, backend: str, timeout: timedelta,
               startup_timeout: float, device_id=None) -> None:
    """init_process_group over a TCPStore whose start-up waits at most `startup_timeout` seconds for all ranks."""
    fix = (f"check that every rank's process started (its node, its log), or raise strategy.startup_timeout_seconds "
           f"(now {startup_timeout:g})")
    # Under torchrun the agent of node 0 holds the store (as torch's own env:// rendezvous does); otherwise rank 0.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(address, port, is_master=rank == 0 and not agent, wait_for_workers=False,
                              timeout=timedelta(seconds=startup_timeout), multi_tenant=True)
    except (RuntimeError, OSError) as err:  # DistStoreError / DistNetworkError are RuntimeErrors
        where = "torchrun's agent" if agent else "rank 0"
        raise StartupError(f"start-up: rank {rank} could not reach the rendezvous store of {where} at "
                           f"{address}:{port} within {startup_timeout:g} s ({str(err).splitlines()[0]}): "
                           f"{where} did not arrive; {fix}") from None
    # A restart under torchrun reuses the agent's store: keys of this attempt only.
    prefix = f"{KEY_PREFIX}{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(f"{prefix}{rank}", socket.gethostname())
    keys = [f"{prefix}{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=startup_timeout))
    except RuntimeError:
        missing = missing_ranks(store, keys)
        if missing:
            raise StartupError(f"start-up: {_ranks(missing)} of {world_size} did not arrive within "
                               f"strategy.startup_timeout_seconds={startup_timeout:g} (seen by rank {rank}): "
                               f"{fix}") from None
        raise
    store.set_timeout(timeout)  # from here on, the collectives' timeout
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device_id)


def missing_ranks(store, keys: List[str]) -> List[int]:
    return [r for r, key in enumerate(keys) if not store.check([key])]


class BoundedStartup(BeforeProcessGroup):
    """Strategy mixin: the process group is formed by form_world before Lightning's own set-up (which then finds it
    made and goes on). build_strategy sets `startup_timeout_seconds`; None keeps Lightning's path."""

    startup_timeout_seconds: Optional[float] = None

    def before_process_group(self) -> None:
        if self.startup_timeout_seconds is None or dist.is_initialized():
            return
        self.set_world_ranks()
        env = self.cluster_environment
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.main_address, str(env.main_port)
        device = self.root_device
        form_world(env.main_address, env.main_port, env.global_rank(), env.world_size(),
                   process_group_backend(self), process_group_timeout(self), self.startup_timeout_seconds,
                   device_id=device if device.type != "cpu" else None)
