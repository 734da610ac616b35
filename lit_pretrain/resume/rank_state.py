"""RankState: the RNG states (torch, numpy, python) of every rank, saved in the checkpoint and restored per rank.

Lightning writes one checkpoint from rank 0, holding rank 0's callback states; random streams differ per rank (each
rank's dropout masks, say), so each rank's states are gathered with all_gather_object when the checkpoint is made
(Lightning builds the checkpoint dict on every rank) and each rank takes its own back on resume. States are applied
just before the first resumed batch, the point in the uninterrupted run where they were taken, so nothing Lightning
does while starting up (building iterators draws a seed from torch's generator) shifts the streams.

World-size changes: rank r takes saved rank r's states when there is one; a rank with no saved counterpart takes
rank 0's streams advanced by a seed of (rank) — documented, deterministic, and never another rank's exact stream.
"""

import random
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback


def capture() -> Dict[str, Any]:
    """This process's RNG states as weights-only-loadable data (tensors, ints, strings)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(), "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos),
                                                      int(has_gauss), float(cached)],
            "python": [version, list(internal), gauss_next]}


def apply(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def gather(state: Dict[str, Any]) -> List[Dict[str, Any]]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    out: List[Optional[Dict[str, Any]]] = [None] * dist.get_world_size()
    dist.all_gather_object(out, state)
    return out


def pick(states: List[Dict[str, Any]], rank: int) -> Dict[str, Any]:
    if rank < len(states):
        return states[rank]
    # No saved stream for this rank: rank 0's, re-seeded by rank (see the module docstring).
    generator = torch.Generator().manual_seed(rank)
    torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
    np.random.seed(rank)
    random.seed(rank)
    return capture()


class RankState(Callback):
    def __init__(self):
        self._to_apply: Optional[Dict[str, Any]] = None
        self.restored_from_world_size: Optional[int] = None

    def state_dict(self) -> Dict[str, Any]:
        return {"ranks": gather(capture())}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._saved = state["ranks"]
        self.restored_from_world_size = len(state["ranks"])

    def on_train_start(self, trainer, pl_module) -> None:
        if self.restored_from_world_size is not None:
            self._to_apply = pick(self._saved, trainer.global_rank)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._to_apply is not None:
            apply(self._to_apply)
            self._to_apply = None
