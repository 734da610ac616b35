"""Read a run's checkpoint back into a plain GPT, for evaluation or to start another run from its weights.

Checkpoints are read with `torch.load(weights_only=True)`: a checkpoint is data, and unpickling arbitrary objects
would run code from the file.
"""

from pathlib import Path

import torch

from lit_pretrain import config as config_lib
from lit_pretrain.errors import DataError
from lit_pretrain.model import GPT

MODULE_PREFIX = "model."  # PretrainModule holds the GPT as `self.model`


def load_gpt(run_dir: str | Path, checkpoint: str = "last.ckpt") -> GPT:
    """The GPT of `run_dir/checkpoints/<checkpoint>`, shaped by the run's own config.yaml."""
    run_dir = Path(run_dir)
    path = run_dir / "checkpoints" / checkpoint
    if not path.is_file():
        choices = sorted(p.name for p in path.parent.glob("*.ckpt"))
        raise DataError(f"checkpoint {path} does not exist: choose one of {choices}")
    model_cfg = config_lib.to_object(config_lib.load(run_dir / "config.yaml")).model
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    except Exception as err:  # a truncated or foreign file: say which one
        raise DataError(f"checkpoint {path} cannot be read as a weights-only checkpoint ({err})") from None
    weights = {k[len(MODULE_PREFIX):]: v for k, v in state.items() if k.startswith(MODULE_PREFIX)}
    model = GPT(model_cfg)
    model.load_state_dict(weights, strict=True)
    return model.eval()
