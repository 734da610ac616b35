"""The collectives a step issues, counted by kind and group with their bytes: a dispatch mode that sees torch's c10d
ops (FSDP2's all-gathers and reduce-scatters, our dist.all_reduce, the pipeline's sends) and the functional
collectives DTensor's redistributions issue. It counts the same on torch's fake backend and on gloo, so a
simulated step and a real one can be compared call for call (tests/simulate/).

Bytes follow planning/communication.py's convention (and the bench's counter, bench/parallel/compositions.py): an
all-gather counts its output, a reduce-scatter its input, every other collective its tensor argument.
"""

from collections import defaultdict
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.distributed as dist

from lit_pretrain.internals import dispatch_mode_class, group_name_to_ranks

# op name (without overload) -> (kind, which argument holds the counted tensors, output multiplier by group size)
C10D = {
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0), "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0),
    "reduce_": ("reduce", 0), "gather_": ("gather", 1), "scatter_": ("scatter", 0),
}
FUNCTIONAL = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


def nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(nbytes(v) for v in x)
    return 0


def _ranks(args: Iterable) -> Tuple[int, ...]:
    for a in args:
        if isinstance(a, dist.ProcessGroup):
            return tuple(dist.get_process_group_ranks(a))
        if isinstance(a, torch.ScriptObject):  # a c10d op's group, boxed (its ReduceOp is boxed the same way)
            try:
                return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(a)))
            except RuntimeError:
                continue
    names = [a for a in args if isinstance(a, str)]
    return tuple(group_name_to_ranks(names[-1])) if names else ()


class CollectiveCounter(dispatch_mode_class()):
    """Within its context: {(kind, group): [calls, bytes]} in `counts`. `labels`: {ranks of a group: its name} (the
    mesh's dimensions, simulate/engine.py group_labels); a group not named there reads "N ranks"."""

    def __init__(self, labels: Optional[Dict[Tuple[int, ...], str]] = None):
        super().__init__()
        self.labels = labels or {}
        self.counts: Dict[Tuple[str, str], list] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run first: its redistributions come back here as collectives
        namespace, name = func.namespace, func.__name__.split(".")[0]
        if namespace == "c10d" and name in C10D:
            kind, arg = C10D[name]
            self._add(kind, args, nbytes(args[arg]))
        elif namespace == "_c10d_functional" and name in FUNCTIONAL:
            kind = FUNCTIONAL[name]
            size = nbytes(args[0]) * (args[1] if kind == "all_gather" else 1)  # (input, group_size, group_name)
            self._add(kind, args, size)
        return func(*args, **kwargs)

    def _add(self, kind: str, args, size: int) -> None:
        ranks = _ranks(args)
        entry = self.counts[(kind, self.labels.get(ranks, f"{len(ranks)} ranks"))]
        entry[0] += 1
        entry[1] += size

    def totals(self) -> Dict[str, list]:
        """{kind: [calls, bytes]} over every group."""
        out: Dict[str, list] = defaultdict(lambda: [0, 0])
        for (kind, _), (calls, size) in self.counts.items():
            out[kind][0] += calls
            out[kind][1] += size
        return dict(out)
