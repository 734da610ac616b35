"""`lit-pretrain checkpoint average RUN --last K | --steps a,b,c [--weights w,...]`: a one-file checkpoint whose
weights are the mean of several of a run's checkpoints.

Averaging the last checkpoints of a run at a constant learning rate gives much of what a decay to zero gives, at no
training cost (Sanyal et al. 2023, "Early Weight Averaging meets High Learning Rates for LLM Pre-training", LAWA,
section 3: a uniform mean of the last k checkpoints; Li et al. 2025, "Model Merging in Pre-training of Large Language
Models", section 3: PMA, uniform or weighted merges of checkpoints along one run; OLMo-core's model merging of the
last checkpoints). Each checkpoint is read whole (a file verified against its sidecar, or a sharded folder against its
manifest: resume/weights.py read_checkpoint), every weight averaged in float64 and stored in the checkpoint's own
dtype (fp32), so the result is the exact mean rounded once. The file holds the newest checkpoint's configs and
metadata with the averaged weights and no optimizer state: it exports (`lit-pretrain export`), evaluates and
generates like any checkpoint (load_gpt), but does not resume training. It is written beside the run's checkpoints
under a name no step checkpoint has (retention and run.resume=auto never touch it), and never over an existing file.
"""

from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from lit_pretrain.errors import DataError
from lit_pretrain.resume import store
from lit_pretrain.resume.verified import META_KEY, save_atomic, sidecar_path
from lit_pretrain.resume.weights import HPARAMS_KEY, MODULE_PREFIX, SECTIONS, read_checkpoint

# What a training checkpoint holds beyond the weights and configs: state a resume would need, which an average has not.
TRAINING_STATE = ("optimizer_states", "lr_schedulers", "loops", "callbacks", "param_names", "ema_weights")


def select(folder: Path, last: Optional[int] = None, steps: Optional[Sequence[int]] = None) -> List[Path]:
    """The step checkpoints of `folder` (a run's checkpoints/) to average, oldest first: the newest `last`, or those
    of `steps`; a step with both a file and a folder (a run that changed format) counts once, as its file."""
    if (last is None) == (steps is None):
        raise DataError("checkpoint average: give --last K or --steps a,b,c (one of them)")
    by_step: Dict[int, Path] = {}
    for path in store.step_files(folder) if folder.is_dir() else []:
        by_step.setdefault(store.step_of(path), path)
    if not by_step:
        raise DataError(f"{folder} holds no step checkpoints: give a run folder (runs/<name>) whose run wrote some "
                        "(trainer.checkpoint_every_n_steps)")
    if steps is not None:
        missing = [s for s in steps if s not in by_step]
        if missing or len(set(steps)) != len(steps) or not steps:
            raise DataError(f"checkpoint average --steps {','.join(map(str, steps))}: "
                            + (f"no checkpoint of step {missing} in {folder}; " if missing else "each step once; ")
                            + f"choose among {sorted(by_step)}")
        return [by_step[s] for s in sorted(steps)]
    if last < 1 or last > len(by_step):
        raise DataError(f"checkpoint average --last {last}: {folder} holds {len(by_step)} step checkpoints "
                        f"({sorted(by_step)}); give 1 <= K <= {len(by_step)}")
    return [by_step[s] for s in sorted(by_step)[-last:]]


def normalized(weights: Optional[Sequence[float]], count: int) -> List[float]:
    """The merge's weights over their sum (uniform when none are given)."""
    if weights is None:
        return [1.0 / count] * count
    if len(weights) != count or any(not w >= 0 or w == float("inf") for w in weights) or sum(weights) <= 0:
        raise DataError(f"checkpoint average --weights {','.join(map(str, weights))}: give {count} finite weights "
                        ">= 0 (one per checkpoint, oldest first) with a positive sum")
    total = float(sum(weights))
    return [float(w) / total for w in weights]


def average_weights(states: Sequence[Dict[str, torch.Tensor]], weights: Sequence[float]) -> Dict[str, torch.Tensor]:
    """sum_i weights[i] * states[i][k] for every floating tensor k, in float64, stored in its own dtype; tensors
    that are not floating point (counts) must agree and are kept."""
    out = {}
    for key, first in states[0].items():
        if not torch.is_floating_point(first):
            if any(not torch.equal(s[key], first) for s in states[1:]):
                raise DataError(f"checkpoint average: {key} ({first.dtype}) differs between the checkpoints and "
                                "cannot be averaged")
            out[key] = first
            continue
        total = torch.zeros(first.shape, dtype=torch.float64)
        for state, w in zip(states, weights):
            total += w * state[key].double()
        out[key] = total.to(first.dtype)
    return out


def default_out(folder: Path, paths: Sequence[Path], weighted: bool) -> Path:
    steps = [store.step_of(p) for p in paths]
    return folder / f"average-step{steps[0]:07d}-{steps[-1]:07d}-k{len(steps)}{'-weighted' if weighted else ''}.ckpt"


def average_run(run: str | Path, last: Optional[int] = None, steps: Optional[Sequence[int]] = None,
                weights: Optional[Sequence[float]] = None, out: Optional[str | Path] = None) -> Path:
    """Average the chosen checkpoints of run folder `run` into a one-file checkpoint (module docstring); its path."""
    folder = Path(run) / "checkpoints"
    paths = select(folder, last, steps)
    shares = normalized(weights, len(paths))
    target = Path(out) if out is not None else default_out(folder, paths, weights is not None)
    if target.suffix != ".ckpt":
        raise DataError(f"checkpoint average --out {target}: name a .ckpt file (the one-file checkpoint format)")
    for existing in (target, sidecar_path(target)):
        if existing.exists() or existing.is_symlink():
            raise DataError(f"{existing} exists: an existing checkpoint is never overwritten; give another --out or "
                            "move it away")
    states, newest, configs = [], None, []
    for path in paths:
        checkpoint = read_checkpoint(path)
        states.append({k: v for k, v in checkpoint["state_dict"].items() if k.startswith(MODULE_PREFIX)})
        configs.append((checkpoint.get(HPARAMS_KEY) or {}).get(SECTIONS["model"]))
        newest = checkpoint
    if any(c != configs[-1] for c in configs) or any(set(s) != set(states[-1]) for s in states):
        raise DataError(f"checkpoint average: {paths[0].name} .. {paths[-1].name} are not all of one model (their "
                        "model configs or weight names differ): average checkpoints of one model only")
    averaged = {k: v for k, v in newest.items() if k not in TRAINING_STATE}
    averaged["state_dict"] = {**{k: v for k, v in newest["state_dict"].items() if not k.startswith(MODULE_PREFIX)},
                              **average_weights(states, shares)}
    averaged[META_KEY] = {**newest.get(META_KEY, {}),
                          "averaged": {"steps": [store.step_of(p) for p in paths], "weights": shares}}
    target.parent.mkdir(parents=True, exist_ok=True)
    save_atomic(averaged, target)
    return target
