"""Which dim of a weight each tensor-parallel style splits, and a parameter's style under a plan: data that the
tensor-parallel layers (parallel/tensor.py) split by and that a sharded checkpoint (resume/sharded/save.py) records
each tensor's offset with, so a checkpoint needs no torch transform to know the layout it was saved under."""

from typing import Dict, Optional

# An nn.Linear's (out, in); "vocab" the rows of the (V, d) embedding and head (parallel/vocab.py); the routed
# experts' stacks (E, out, in) split the linear dims one further in (parallel/expert_tensor.py).
SHARD_DIM = {"column": 0, "row": 1, "vocab": 0, "expert_column": 1, "expert_row": 2}
WRAPPER_PREFIX = "_checkpoint_wrapped_module."  # activation checkpointing's wrapper, left out of every plan name


def plain_name(name: str) -> str:
    return name.replace(WRAPPER_PREFIX, "")


def style_of(name: str, plan: Dict[str, str]) -> Optional[str]:
    """The plan's sharding style (a key of SHARD_DIM) for a module name or a parameter name (ending in .weight);
    None when the tensor is whole on every rank (replicated or "partial")."""
    name = plain_name(name)
    if name.endswith(".weight"):
        name = name[: -len(".weight")]
    style = plan.get(name)
    return style if style in SHARD_DIM else None
