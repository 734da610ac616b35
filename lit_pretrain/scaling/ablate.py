"""`make ablate` / `python -m lit_pretrain.scaling.ablate [NAME ...]`: train each arm of each ablation in
experiments/ablations/*.yaml, then write one comparison plot and a table of final validation bits per byte.

An ablation file is data (yaml.safe_load), not a run file:

    description: AdamW vs Muon at equal tokens
    run: ../runs/tiny.yaml          # the run file every arm starts from (relative to this file)
    overrides: [trainer.max_steps=150]
    arms:                           # arm name -> its own overrides, applied after the shared ones
      adamw: [optim.name=adamw]
      muon: [optim.name=muon]

Every arm of one ablation sees the same data, seed, steps and tokens; only its overrides differ. Arm runs go to
<root>/<ablation>/<arm> (root: runs/ablations); a run with a summary.json is reused, never retrained, so an
interrupted `make ablate` continues where it stopped. Outputs: <root>/ablations.png (one panel per ablation:
training loss against tokens seen, one line per arm) and <root>/ablations.md (final val/bits_per_byte per arm; an
arm with callbacks.ema has a row "<arm> (EMA)" more, its val/ema_loss).
"""

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import yaml

from lit_pretrain.atomic import atomic_open
from lit_pretrain.errors import ConfigError, DataError, RunFolderError
from lit_pretrain.paths import confined, is_safe_name
from lit_pretrain.runs.folder import read_metrics, series
from lit_pretrain.runs.state import is_finished

ABLATIONS = Path("experiments") / "ablations"
ROOT = Path("runs") / "ablations"


@dataclass
class Ablation:
    name: str
    description: str
    run_file: Path
    overrides: List[str]
    arms: Dict[str, List[str]]


def load_ablation(path: Path) -> Ablation:
    """Read and check one ablation file; errors name the file and the key."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read the ablation ({err})") from None
    if not isinstance(data, dict) or set(data) - {"description", "run", "overrides", "arms"}:
        raise ConfigError(f"{path}: expected a mapping of description, run, overrides, arms")
    arms = data.get("arms")
    if not isinstance(arms, dict) or len(arms) < 2:
        raise ConfigError(f"{path}: 'arms' must map at least two arm names to lists of overrides")
    for arm, extra in arms.items():
        if not is_safe_name(str(arm)) or not isinstance(extra or [], list):
            raise ConfigError(f"{path}: arms.{arm}: an arm is a folder name mapped to a list of key=value overrides")
    if not is_safe_name(path.stem):
        raise ConfigError(f"{path}: the file name is the ablation's folder name: letters, digits, '.', '_', '-'")
    return Ablation(path.stem, str(data.get("description", "")), (path.parent / str(data["run"])).resolve(),
                    [str(o) for o in data.get("overrides") or []],
                    {str(a): [str(o) for o in (extra or [])] for a, extra in arms.items()})


def train_arm(ablation: Ablation, arm: str, root: Path, log=print) -> dict:
    """Train one arm (or reuse its finished summary); return the summary."""
    folder = root / ablation.name / arm
    summary = folder / "summary.json"
    if summary.is_file() and is_finished(json.loads(summary.read_text())):
        log(f"reuse {ablation.name}/{arm}")
        return json.loads(summary.read_text())
    from lit_pretrain import config as config_lib
    from lit_pretrain.train import train

    overrides = [*ablation.overrides, *ablation.arms[arm], f"run.name={arm}", f"run.root_dir={root / ablation.name}",
                 # an interrupted arm (summary.json not `finished`: run_state.py) starts again from scratch
                 f"run.overwrite={str(folder.exists()).lower()}"]
    log(f"train {ablation.name}/{arm}: {' '.join(ablation.arms[arm]) or '(shared overrides only)'}")
    return train(config_lib.load(ablation.run_file, overrides))


def final(rows: List[dict], key: str) -> Optional[float]:
    values = series(rows, key)
    return values[-1][1] if values else None


def table(results: Dict[str, Dict[str, dict]], descriptions: Dict[str, str]) -> str:
    """The markdown table of every arm's final validation numbers (a missing value is '-')."""
    lines = ["| ablation | arm | val bits/byte | val loss | steps | tokens |", "|---|---|---|---|---|---|"]
    for name, arms in results.items():
        for arm, r in arms.items():
            bpb, loss = r.get("bits_per_byte"), r.get("val_loss")
            cells = [f"{bpb:.4f}" if bpb is not None else "-", f"{loss:.4f}" if loss is not None else "-",
                     str(r.get("steps", "-")), f"{r['tokens']:,}" if r.get("tokens") else "-"]
            lines.append(f"| {name} | {arm} | " + " | ".join(cells) + " |")
    notes = [f"- {name}: {text}" for name, text in descriptions.items() if text]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def _atomic_write(path: Path, write) -> None:
    """Write one of this module's two output names through atomic's atomic_open (a reader sees the old file
    or the new one), confined to the root folder and never through a symbolic link (paths.confined)."""
    confined(path.parent.parent, path.parent, "ablation root")
    if path.is_symlink():
        raise RunFolderError(f"{path} is a symbolic link: the project never writes through a link; remove it")
    with atomic_open(path) as f:
        write(f)


def plot(curves: Dict[str, Dict[str, list]], out: Path) -> None:
    """One panel per ablation: training loss against tokens seen, one line per arm."""
    from matplotlib.figure import Figure

    n = len(curves)
    cols = min(n, 3)
    fig = Figure(figsize=(5 * cols, 3.6 * math.ceil(n / cols)), layout="constrained")
    for i, (name, arms) in enumerate(curves.items()):
        ax = fig.add_subplot(math.ceil(n / cols), cols, i + 1)
        for arm, points in arms.items():
            if points:
                ax.plot(*zip(*points), label=arm)
        ax.set_title(name)
        ax.set_xlabel("tokens seen")
        ax.set_ylabel("train/loss (nats/token)")
        ax.legend()
    _atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=110))


def run(names: Sequence[str] = (), folder: Path = ABLATIONS, root: Path = ROOT, log=print) -> str:
    """Train the named ablations (all in `folder` when none), write the plot and the table; return the table."""
    files = sorted(folder.glob("*.yaml"))
    known = {f.stem: f for f in files}
    for name in names:
        if name not in known:
            raise ConfigError(f"ablation {name!r}: no {folder}/{name}.yaml; choose from {', '.join(known) or 'none'}")
    ablations = [load_ablation(known[n]) for n in (names or known)]
    results: Dict[str, Dict[str, dict]] = {}
    curves: Dict[str, Dict[str, list]] = {}
    for ablation in ablations:
        for arm in ablation.arms:
            summary = train_arm(ablation, arm, root, log)
            rows = read_metrics(root / ablation.name / arm / "metrics.csv")
            per_step = summary.get("tokens_per_step") or 0
            seen = dict(series(rows, "train/tokens_seen"))  # a trainer.batch_schedule's steps differ in size
            curves.setdefault(ablation.name, {})[arm] = [(seen.get(s, s * per_step), v)
                                                         for s, v in series(rows, "train/loss")]
            bpb = summary.get("val_bits_per_byte")
            results.setdefault(ablation.name, {})[arm] = {
                "bits_per_byte": bpb if bpb is not None else final(rows, "val/bits_per_byte"),
                "val_loss": summary.get("final_val_loss"),
                "steps": summary.get("steps"), "tokens": summary.get("tokens_seen")}
            if summary.get("final_val_ema_loss") is not None:  # callbacks.ema: the same run's average, its own row
                results[ablation.name][f"{arm} (EMA)"] = {
                    "bits_per_byte": None, "val_loss": summary["final_val_ema_loss"],
                    "steps": summary.get("steps"), "tokens": summary.get("tokens_seen")}
    root.mkdir(parents=True, exist_ok=True)
    text = table(results, {a.name: a.description for a in ablations})
    _atomic_write(root / "ablations.md", lambda f: f.write(text.encode()))
    plot(curves, root / "ablations.png")
    log(f"wrote {root / 'ablations.md'} and {root / 'ablations.png'}")
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_pretrain.scaling.ablate", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="ablations to run (file stems in experiments/ablations); all if none")
    parser.add_argument("--root", default=str(ROOT), help="folder of the arm runs, the plot and the table")
    args = parser.parse_args(argv)
    try:
        print(run(args.names, root=Path(args.root)), end="")
    except (ConfigError, DataError, RunFolderError) as err:  # one line, exit 2, as the CLI does
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
