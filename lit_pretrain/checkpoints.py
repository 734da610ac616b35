"""Read a run's checkpoint back into a plain GPT (and its AdamW state), whatever strategy wrote it.

Every strategy writes the same one-file checkpoint: single and ddp as Lightning always does; ZeRO stage 1
consolidates ZeroRedundancyOptimizer's shards on rank 0 first; ZeRO stages 2 and 3 (Lightning's
ModelParallelStrategy with `save_distributed_checkpoint=False`) gather the full model and optimizer state dicts to
rank 0 through torch.distributed.checkpoint.state_dict, which works on CPU, unlike the FSDP1 full-state-dict path.
So a checkpoint written under any strategy reads into one process for evaluation, or to continue under another.

Checkpoints are read with `torch.load(weights_only=True)`: a checkpoint is data, and unpickling arbitrary objects
would run code from the file.
"""

from pathlib import Path

import torch

from lit_pretrain import config as config_lib
from lit_pretrain.errors import DataError
from lit_pretrain.model import GPT

MODULE_PREFIX = "model."  # PretrainModule holds the GPT as `self.model`


def read_checkpoint(run_dir: str | Path, checkpoint: str = "last.ckpt") -> dict:
    path = Path(run_dir) / "checkpoints" / checkpoint
    if path.is_dir():
        raise DataError(
            f"checkpoint {path} is a folder (a sharded distributed checkpoint); this project writes one-file "
            "checkpoints under every strategy: convert it with torch.distributed.checkpoint.format_utils."
            "dcp_to_torch_save, or choose another checkpoint"
        )
    if not path.is_file():
        choices = sorted(p.name for p in path.parent.glob("*.ckpt"))
        raise DataError(f"checkpoint {path} does not exist: choose one of {choices}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: say which one
        raise DataError(f"checkpoint {path} cannot be read as a weights-only checkpoint ({err})") from None


def load_gpt(run_dir: str | Path, checkpoint: str = "last.ckpt") -> GPT:
    """The GPT of `run_dir/checkpoints/<checkpoint>`, shaped by the run's own config.yaml."""
    run_dir = Path(run_dir)
    model_cfg = config_lib.to_object(config_lib.load(run_dir / "config.yaml")).model
    state = read_checkpoint(run_dir, checkpoint)
    if "state_dict" not in state:
        raise DataError(f"checkpoint {run_dir / 'checkpoints' / checkpoint} has no state_dict: not a training "
                        "checkpoint of this project")
    weights = {k[len(MODULE_PREFIX):]: v for k, v in state["state_dict"].items() if k.startswith(MODULE_PREFIX)}
    model = GPT(model_cfg)
    model.load_state_dict(weights, strict=True)
    return model.eval()


def load_optimizer_state(run_dir: str | Path, checkpoint: str = "last.ckpt",
                         model: GPT | None = None) -> torch.optim.Optimizer:
    """A single-process AdamW over `model` (default: the checkpoint's GPT) holding the checkpoint's optimizer state.

    The groups are rebuilt as training builds them (module.param_groups); torch maps saved state to parameters
    by their position in the groups, which every strategy's consolidated state keeps.
    """
    from lit_pretrain.module import param_groups  # imports Lightning: only when optimizer state is wanted

    run_dir = Path(run_dir)
    c = config_lib.to_object(config_lib.load(run_dir / "config.yaml"))
    model = model if model is not None else load_gpt(run_dir, checkpoint)
    states = read_checkpoint(run_dir, checkpoint).get("optimizer_states") or []
    if len(states) != 1:
        raise DataError(f"checkpoint {run_dir / 'checkpoints' / checkpoint} holds {len(states)} optimizer states, "
                        "expected 1: it was saved without optimizer state (save_weights_only) or by another program")
    o = c.optim
    optimizer = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr_peak, betas=(o.beta1, o.beta2),
                                  eps=o.eps)
    optimizer.load_state_dict(states[0])
    return optimizer
