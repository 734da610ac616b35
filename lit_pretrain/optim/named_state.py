"""One numbering for the optimizer state of every one-file checkpoint: by parameter name.

torch numbers an optimizer's state by position (`Optimizer.state_dict`: 0, 1, ... over its parameter groups), and
what a position means depends on who numbered it: one process, DDP, ZeRO-1's consolidation and our mesh numbered
the groups' parameters in order (optim.param_groups), Lightning's FSDP path (ZeRO-2/3) numbered
`model.parameters()` instead, so a file written by one and read by the other put every moment on the wrong tensor.
A name means the same under every layout, as torch.distributed.checkpoint's `get_optimizer_state_dict` (and
torchtitan with it) keys a full optimizer state. Every one-file checkpoint holds, in `optimizer_states[0]`:

    {"state": {"blocks.0.attn.wq.weight": {"step": ..., "exp_avg": ..., "exp_avg_sq": ...}, ...},
     "param_groups": [{"lr": ..., "weight_decay": ..., ..., "params": ["blocks.0.attn.wq.weight", ...]}, ...]}

The names are the single-process GPT's (`GPT.named_parameters()`, a tied matrix under its first name), those of the
checkpoint's `state_dict` without the module's `model.`; Muon's momentum is keyed the same way. Files written by
position before are read too (`read_named`), whichever of the two numberings they hold; nothing writes them.
"""

from typing import Dict, List, NamedTuple

import torch
from torch import nn

from lit_pretrain.errors import DataError
from lit_pretrain.model.gpt import GPT
from lit_pretrain.optim.optimizers import local_optimizer, param_groups
from lit_pretrain.schema import OptimConfig


class Names(NamedTuple):
    """A run's parameter names as its optimizer sees them: `groups`, per parameter group (optim.param_groups' order)
    the names of its parameters in order; `parameters`, every name in `model.parameters()` order."""
    groups: List[List[str]]
    parameters: List[str]


def names_of(model: nn.Module, optim: OptimConfig) -> Names:
    """The names of `model` (a plain GPT, or any module whose names are single-process names) under `optim`'s
    groups."""
    named = {id(p): n for n, p in model.named_parameters()}
    return Names([[named[id(p)] for p in g["params"]] for g in param_groups(model, optim)], list(named.values()))


def single_process_names(model_cfg, optim: OptimConfig) -> Names:
    """names_of the single-process GPT of `model_cfg`, built on the meta device (no memory): the same names and
    groups on every rank of every layout, whatever part of the model a rank holds."""
    with torch.device("meta"):
        return names_of(GPT(model_cfg), optim)


def is_named(state: Dict) -> bool:
    """Whether an optimizer state dict is keyed by name (this format); an empty one counts when its groups are."""
    keys = [*state.get("state", {}), *(n for g in state.get("param_groups", []) for n in g.get("params", []))]
    return all(isinstance(k, str) for k in keys)


def _settings(group: Dict) -> Dict:
    return {k: v for k, v in group.items() if k != "params"}


def to_named(state: Dict, groups: List[List[str]]) -> Dict:
    """A state dict numbered by position in the groups (`Optimizer.state_dict` of an optimizer built by
    optim.build_optimizer; ZeroRedundancyOptimizer's consolidation numbers its global groups the same way) keyed by
    name instead; `groups` are the names of those groups (Names.groups). One already by name passes through."""
    if is_named(state):
        return state
    saved = state["param_groups"]
    if [len(g["params"]) for g in saved] != [len(names) for names in groups]:
        raise ValueError(f"optimizer state of {[len(g['params']) for g in saved]} parameters per group, but the "
                         f"model's groups hold {[len(names) for names in groups]}")
    name_of = {i: n for g, names in zip(saved, groups) for i, n in zip(g["params"], names)}
    return {"state": {name_of[i]: s for i, s in state["state"].items()},
            "param_groups": [{**_settings(g), "params": list(names)} for g, names in zip(saved, groups)]}


def read_named(state: Dict, names: Names, source) -> Dict:
    """The optimizer state of a one-file checkpoint (`source`, for messages) by name, whatever wrote it: by name
    as is; by position in the groups (one process, DDP, ZeRO-1, the mesh strategies and `checkpoint consolidate`
    before this format) or by position in `model.parameters()` (Lightning's ZeRO-2/3 file before it: each group's
    positions sorted, FSDP.rekey_optim_state_dict). The two are told apart by the groups' positions: 0, 1, 2, ...
    in order only for the first (where the second reads the same, the two numberings agree)."""
    if is_named(state):
        return state
    positions = [i for g in state["param_groups"] for i in g["params"]]
    try:
        if positions == list(range(len(positions))):
            return to_named(state, names.groups)
        if sorted(positions) != list(range(len(names.parameters))):
            raise ValueError(f"its groups number {len(positions)} parameters, the model has {len(names.parameters)}")
    except ValueError as err:
        raise DataError(f"checkpoint {source}: its optimizer state does not fit this model ({err}): resume from a "
                        "checkpoint of this model and optimizer, or start from its weights with run.init_from") \
            from None
    name_of = dict(enumerate(names.parameters))
    return {"state": {name_of[i]: s for i, s in state["state"].items()},
            "param_groups": [{**_settings(g), "params": [name_of[i] for i in g["params"]]}
                             for g in state["param_groups"]]}


def _check_groups(named: Dict, groups: List[List[str]], source) -> None:
    saved = named["param_groups"]
    if [sorted(g["params"]) for g in saved] != [sorted(names) for names in groups]:
        raise DataError(f"checkpoint {source}: its optimizer groups ({[len(g['params']) for g in saved]} parameters) "
                        f"are not this run's ({[len(n) for n in groups]}): the optimizer section (optim.name, "
                        "optim.no_weight_decay, optim.lr_multipliers) differs from the checkpoint's; set it back, or "
                        "start from the checkpoint's weights with run.init_from")


def to_positions(named: Dict, groups: List[List[str]], source) -> Dict:
    """A by-name state numbered for an optimizer whose groups hold `groups` (Names.groups), as
    `Optimizer.load_state_dict` (and ZeroRedundancyOptimizer's) reads it: state and group settings by position.
    The saved groups must hold the same names as this run's (a changed optimizer section regroups them): a
    DataError naming `source` otherwise."""
    _check_groups(named, groups, source)
    position = {n: i for i, n in enumerate(n for names in groups for n in names)}
    return {"state": {position[n]: s for n, s in named["state"].items()},
            "param_groups": [{**_settings(g), "params": [position[n] for n in names]}
                             for g, names in zip(named["param_groups"], groups)]}


def load_group_settings(optimizer, named: Dict, groups: List[List[str]], source) -> None:
    """The saved groups' settings (lr, betas, weight decay, ...) into `optimizer`'s groups, as
    `Optimizer.load_state_dict` replaces them (ZeroRedundancyOptimizer's local optimizer too), where the state
    itself was placed by name; the groups checked as in to_positions."""
    _check_groups(named, groups, source)
    for opt in {id(optimizer): optimizer, id(local_optimizer(optimizer)): local_optimizer(optimizer)}.values():
        if len(opt.param_groups) == len(groups):
            for group, saved in zip(opt.param_groups, named["param_groups"]):
                group.update(_settings(saved))
