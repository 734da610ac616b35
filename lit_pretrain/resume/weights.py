"""Read a checkpoint back into a plain GPT (and its AdamW state), whatever strategy wrote it, wherever it lies.

A checkpoint is one of two formats (checkpoint.format). One file, the same under every strategy: single and ddp
as Lightning always does; ZeRO stage 1 consolidates ZeroRedundancyOptimizer's shards on rank 0 first; ZeRO stages
2 and 3 and our mesh strategy gather the full model and optimizer state to rank 0. Or a sharded folder
(resume/sharded/save.py), each rank's share under single-process names, read here whole into one process. Either way a
checkpoint written under any strategy reads into one process for evaluation, or to continue under another. The
optimizer state of a one-file checkpoint is keyed by parameter name under every strategy (optim/named_state.py).

Checkpoints are opened by `resume.checkpoint_io.load_verified`: checked against their sha256 sidecar, then
`torch.load(weights_only=True)`: a checkpoint is data, and unpickling arbitrary objects would run code from the file.
A checkpoint carries its own configs (PretrainModule's hyperparameters, and the run's flattened config in its
`lit_pretrain` metadata), so a file copied out of its run folder, with its sidecar, reads back on its own.
"""

import dataclasses
import typing
from pathlib import Path
from typing import Any, Dict, Tuple

import torch

from lit_pretrain import config as config_lib
from lit_pretrain.errors import DataError
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.optim.named_state import names_of, read_named, to_positions
from lit_pretrain.optim.optimizers import adamw_with_state
from lit_pretrain.resume.verified import META_KEY, load_verified
from lit_pretrain.schema import OptimConfig

MODULE_PREFIX = "model."  # PretrainModule holds the GPT as `self.model`
# Metadata of a weights file under our names (`import --out`, `checkpoint consolidate`): the model fields and the
# tokenizer it was trained with.
META_MODEL, META_TOKENIZER = "lit_pretrain.model.gpt", "lit_pretrain.tokenizer_sha256"
HPARAMS_KEY = "hyper_parameters"  # where Lightning stores what save_hyperparameters saved
# PretrainModule's hyperparameter names of the model and optimizer configs (module.py's __init__ arguments).
SECTIONS = {"model": "model_cfg", "optim": "optim"}


def route_moved(model_cfg: Any, strategy: Any) -> Tuple[Any, Any]:
    """PretrainModule's model_cfg and strategy hyperparameters, from a checkpoint written before activation
    checkpointing moved to the strategy section and FP8 to the trainer (config.MOVED): the former go into `strategy`
    (where it does not set them itself); trainer.float8 is no hyperparameter of the module (the plan carries it) and
    is dropped, as from_plain does. One line names what moved."""
    if not isinstance(model_cfg, dict):
        return model_cfg, strategy
    model_cfg, found = _without_moved("model", model_cfg)
    if found and (strategy is None or isinstance(strategy, dict)):
        strategy = dict(strategy or {})
        for old, value in found.items():
            section, key = config_lib.MOVED[old].split(".", 1)
            if section == "strategy":
                strategy.setdefault(key, value)
    config_lib.moved_notice("the checkpoint's hyperparameters", list(found))
    return model_cfg, strategy


def _without_moved(section: str, data: dict) -> Tuple[dict, Dict[str, Any]]:
    """`data` (a `section` of plain config) without its keys that moved to another section, and those, by old name."""
    found = {f"{section}.{k}": v for k, v in data.items() if f"{section}.{k}" in config_lib.MOVED}
    return {k: v for k, v in data.items() if f"{section}.{k}" not in found}, found


def from_plain(cls: type, data: Any) -> Any:
    """A config dataclass from the plain dict `dataclasses.asdict` made of it (nested sections too); an instance
    passes through. A key the dataclass lacks (a checkpoint from another version) is a DataError naming it, except
    the model keys that moved to another section since (config.MOVED): how a run was trained, not what its weights
    are; they are dropped with a one-line notice (route_moved gives PretrainModule's strategy its own)."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise DataError(f"{cls.__name__} from a checkpoint: expected a dict of its fields, got {type(data).__name__}")
    if cls is GPTConfig:
        data, found = _without_moved("model", data)
        config_lib.moved_notice(f"{cls.__name__} from a checkpoint", list(found))
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise DataError(f"{cls.__name__} from a checkpoint has unknown fields {unknown}: it was written by another "
                        "version of lit_pretrain")
    return cls(**{k: from_plain(hints[k], v) if dataclasses.is_dataclass(hints[k]) else v for k, v in data.items()})


def checkpoint_path(source: str | Path, checkpoint: str = "last.ckpt") -> Path:
    """`source` itself when it is a checkpoint file or a sharded checkpoint folder, else
    `source/checkpoints/<checkpoint>` of a run folder; for the default last.ckpt of a run whose newest checkpoint is
    a sharded folder (no last.ckpt then), the folder its `latest` pointer names."""
    from lit_pretrain.resume.sharded.manifest import STEP_FOLDER, is_sharded

    source = Path(source)
    if source.is_file() or is_sharded(source):
        return source
    path = source / "checkpoints" / checkpoint
    latest = source / "checkpoints" / "latest"
    if checkpoint == "last.ckpt" and not path.exists() and latest.is_file():
        named = latest.read_text().strip()
        if STEP_FOLDER.match(named):
            path = source / "checkpoints" / named
    if is_sharded(path):
        return path
    if not path.is_file():
        if not source.is_dir():
            raise DataError(f"{source} is neither a checkpoint file nor a run folder: give runs/<name> or a .ckpt")
        choices = sorted(p.name for p in path.parent.iterdir() if p.suffix == ".ckpt" or STEP_FOLDER.match(p.name)) \
            if path.parent.is_dir() else []
        raise DataError(f"checkpoint {path} does not exist: choose one of {choices}")
    return path


def _read(path: Path) -> dict:
    """A one-file checkpoint verified against its sidecar, or a sharded folder verified against its manifest and
    read whole into this process (resume/sharded/save.py as_single_checkpoint): the same dict either way."""
    if path.is_dir():
        from lit_pretrain.resume.sharded.save import as_single_checkpoint

        return as_single_checkpoint(path)
    return load_verified(path)


def read_checkpoint(source: str | Path, checkpoint: str = "last.ckpt") -> dict:
    """The checkpoint's contents, verified (see checkpoint_path for `source`)."""
    return _read(checkpoint_path(source, checkpoint))


def _section(state: dict, path: Path, name: str, cls: type) -> Any:
    """A config section of the run that wrote the checkpoint: from its hyperparameters, else from its run metadata,
    else from the config.yaml of the run folder it lies in."""
    hparams = state.get(HPARAMS_KEY) or {}
    if SECTIONS[name] in hparams:
        return from_plain(cls, hparams[SECTIONS[name]])
    flat = (state.get(META_KEY) or {}).get("config")
    if isinstance(flat, dict) and any(k.startswith(f"{name}.") for k in flat):
        return from_plain(cls, {k[len(name) + 1:]: v for k, v in flat.items() if k.startswith(f"{name}.")})
    run_config = path.parent.parent / "config.yaml"  # a sharded folder lies in checkpoints/ too
    if path.parent.name == "checkpoints" and run_config.is_file():
        return getattr(config_lib.load(run_config, check_inputs=False), name)
    raise DataError(f"checkpoint {path} carries no {name} config (no hyperparameters, no run metadata) and lies "
                    "outside a run folder: read it from its run's checkpoints/ folder, beside the run's config.yaml")


WEIGHTS = ("raw", "ema")  # which weights load_gpt gives: the trained ones, or their EMA (callbacks.ema)


def _gpt(state: dict, path: Path, weights: str = "raw") -> GPT:
    if "state_dict" not in state:
        raise DataError(f"checkpoint {path} has no state_dict: not a training checkpoint of this project")
    raw = {k[len(MODULE_PREFIX):]: v for k, v in state["state_dict"].items() if k.startswith(MODULE_PREFIX)}
    model = GPT(_section(state, path, "model", GPTConfig))
    model.load_state_dict(raw, strict=True)
    if weights == "ema":
        from lit_pretrain.resume.sharded.save import EMA_KEY  # torch.distributed: only for the EMA

        _load_ema(model, state.get(EMA_KEY), path)
    elif weights != "raw":
        raise DataError(f"weights={weights!r}: expected one of {', '.join(WEIGHTS)}")
    return model.eval()


def _load_ema(model: GPT, ema: Any, path: Path) -> None:
    """The EMA of every parameter in place of the weights; buffers (a MoE layer's routing bias) stay the trained
    model's, as the average keeps none of them (callbacks/ema.py)."""
    if not ema:
        raise DataError(f"checkpoint {path} holds no EMA of the weights: it was written without callbacks.ema."
                        "enabled=true (or before the average started at callbacks.ema.start_step); use the raw "
                        "weights (--weights raw) or a checkpoint of a run with the EMA")
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied embedding once, as the EMA keeps it
            if name not in ema or tuple(ema[name].shape) != tuple(p.shape):
                raise DataError(f"checkpoint {path}: its EMA lacks {name} {tuple(p.shape)}: it is not this model's")
            p.copy_(ema[name])


def load_gpt(source: str | Path, checkpoint: str = "last.ckpt", weights: str = "raw") -> GPT:
    """The GPT of a checkpoint file, or of `source/checkpoints/<checkpoint>` of a run folder, shaped by the config
    the checkpoint carries. weights="ema": the EMA of the weights the checkpoint holds (callbacks.ema)."""
    path = checkpoint_path(source, checkpoint)
    return _gpt(_read(path), path, weights)


def load_optimizer_state(source: str | Path, checkpoint: str = "last.ckpt",
                         model: GPT | None = None) -> torch.optim.Optimizer:
    """A single-process optimizer (the checkpoint's optim.name) over `model` (default: the checkpoint's GPT) holding
    the checkpoint's optimizer state.

    The groups are rebuilt as training builds them (optim.adamw_with_state), and the state, keyed by parameter name
    (or by either numbering of files written before: optim/named_state.py read_named), placed by name.
    """
    path = checkpoint_path(source, checkpoint)
    state: Dict = _read(path)
    model = model if model is not None else _gpt(state, path)
    states = state.get("optimizer_states") or []
    if len(states) != 1:
        raise DataError(f"checkpoint {path} holds {len(states)} optimizer states, expected 1: it was saved without "
                        "optimizer state (save_weights_only) or by another program")
    optim = _section(state, path, "optim", OptimConfig)
    names = names_of(model, optim)
    return adamw_with_state(model, optim, to_positions(read_named(states[0], names, path), names.groups, path))
