"""`lit-pretrain compare RUN RUN... --out compare.png`: several runs' curves in one figure, one colour per run.

`panels(runs)` is the whole logic: a pure function from the runs' records to the lines (and notes) of each panel.
`plot(panels, out)` only draws them. Every x axis is tokens seen (or training FLOPs), not optimizer steps, so runs
with different batch sizes line up.
"""

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from lit_pretrain.errors import ConfigError
from lit_pretrain.runs.table import RunRecord, read_run, status, steps_logged


@dataclass
class Line:
    run: str
    label: str
    x: List[float]
    y: List[float]
    color: str
    dashed: bool = False


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    lines: List[Line] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    log_x: bool = False


# Which metrics.csv columns each panel draws: the first column of a tuple a run has is used (the module logs
# train/grad_norm at logged steps; the gradient-norm monitor's interval mean is the fallback).
PANELS = {
    "loss_tokens": ("loss against tokens", "tokens seen", "cross-entropy (nats / token)"),
    "loss_flops": ("loss against training FLOPs", "FLOPs (tokens × flops_per_token)", "cross-entropy (nats / token)"),
    "lr": ("learning rate", "tokens seen", "learning rate"),
    "grad_norm": ("gradient norm (before clipping)", "tokens seen", "global L2 norm"),
    "throughput": ("throughput", "tokens seen", "tokens / s"),
}
LOSSES = (("train/loss", "train", False), ("val/loss", "val", True))
SINGLE = {"lr": ("train/lr",), "grad_norm": ("train/grad_norm", "grad_norm/mean"),
          "throughput": ("throughput/tokens_per_s",)}


def tokens_per_step(run: RunRecord) -> Optional[float]:
    """summary.json's tokens_per_step; else config.yaml's trainer.tokens_per_step; else what the train rows imply
    (train/tokens_seen / steps done)."""
    if run.summary and run.summary.get("tokens_per_step"):
        return float(run.summary["tokens_per_step"])
    configured = (run.config.get("trainer") or {}).get("tokens_per_step")
    if configured:
        return float(configured)
    for r in run.rows:
        if "train/tokens_seen" in r and r.get("step"):
            return r["train/tokens_seen"] / r["step"]
    return None


def points(run: RunRecord, key: str, per_step: float) -> tuple:
    """(tokens seen, value) of every metrics row holding `key`, in file order (every row's step is the optimizer
    steps completed when it was measured: lit_pretrain/runs/step_axis.py)."""
    # The tokens the run logged at a step where it did (a trainer.batch_schedule's steps differ in size).
    seen = {r["step"]: r["train/tokens_seen"] for r in run.rows if "train/tokens_seen" in r and "step" in r}
    pairs = [(seen.get(r["step"], r["step"] * per_step), r[key]) for r in run.rows if key in r and "step" in r]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def labels(runs: Sequence[RunRecord]) -> List[str]:
    """Each run's folder name, or its whole path where two runs share a folder name (runs/a/x and other/x)."""
    names = [r.name for r in runs]
    return [r.name if names.count(r.name) == 1 else str(r.path) for r in runs]


def state_of(run: RunRecord) -> str:
    """'' for a finished run; else its state as `runs` shows it, with the steps done and planned (a preempted,
    failed, killed or running run's curves stop short of what it was planned to train)."""
    state = status(run)
    if state == "finished":
        return ""
    s = run.summary or {}
    done = s.get("steps") if s.get("status") == "preempted" else steps_logged(run.rows)
    planned = s.get("max_steps") or (run.config.get("trainer") or {}).get("max_steps")
    steps = f"{done if done is not None else 0} of {planned} steps" if planned else f"{done or 0} steps"
    return f"{state}; {steps}"


def panels(runs: Sequence[RunRecord]) -> Dict[str, Panel]:
    """The lines of each panel, one colour per run (matplotlib's C0, C1, ...); a run missing a series gets a note."""
    out = {key: Panel(*spec, log_x=key == "loss_flops") for key, spec in PANELS.items()}
    for i, (run, name) in enumerate(zip(runs, labels(runs))):
        color = f"C{i % 10}"
        per_step = tokens_per_step(run)
        if per_step is None:
            for panel in out.values():
                panel.notes.append(f"{name}: no tokens_per_step (no summary.json and no train rows in metrics.csv)")
            continue
        flops = (run.summary or {}).get("flops_per_token")
        for key, label, dashed in LOSSES:
            x, y = points(run, key, per_step)
            if not x:
                out["loss_tokens"].notes.append(f"{name}: no {key} in metrics.csv")
                continue
            out["loss_tokens"].lines.append(Line(name, f"{name} {label}", x, y, color, dashed))
            if flops:
                out["loss_flops"].lines.append(Line(name, f"{name} {label}", [t * flops for t in x], y, color, dashed))
        if not flops:
            out["loss_flops"].notes.append(f"{name}: no flops_per_token (summary.json is written when training ends)")
        for key, columns in SINGLE.items():
            found = next((c for c in columns if any(c in r for r in run.rows)), None)
            if found is None:
                out[key].notes.append(f"{name}: no {' or '.join(columns)} in metrics.csv")
                continue
            x, y = points(run, found, per_step)
            out[key].lines.append(Line(name, name, x, y, color))
    return out


def check_out(out: Path) -> str:
    """The image format of --out (its suffix), refused before anything is drawn if matplotlib cannot write it."""
    from matplotlib.figure import Figure

    fmt = out.suffix.lstrip(".").lower()
    supported = Figure().canvas.get_supported_filetypes()
    if fmt not in supported:
        raise ConfigError(f"--out {out}: '{out.suffix or 'no suffix'}' is not an image format matplotlib writes; "
                          f"end the name in one of .{', .'.join(sorted(supported))} (e.g. compare.png)")
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder: give a file name, e.g. {out / 'compare.png'}")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: folder {out.parent} does not exist; create it or write elsewhere")
    return fmt


def plot(all_panels: Dict[str, Panel], runs: Sequence[str], out: Path) -> None:
    """Draw the panels (2 × 3, the sixth holds the run legend and the notes) into `out`, atomically: the figure is
    written to a new temporary file beside it and renamed over it, so no other file is touched and a failed draw
    leaves any earlier `out` as it was."""
    import matplotlib

    matplotlib.use("Agg")  # no display where runs are compared
    import matplotlib.pyplot as plt

    out = Path(out)
    fmt = check_out(out)
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    # Fixed margins: tight_layout measures every tick label and took most of the drawing time.
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.07, top=0.95, wspace=0.28, hspace=0.3)
    for ax, panel in zip(axes.flat, all_panels.values()):
        for line in panel.lines:
            ax.plot(line.x, line.y, color=line.color, linestyle="--" if line.dashed else "-",
                    marker="o" if line.dashed else None, markersize=3, label=line.label)
        ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        if panel.log_x and panel.lines:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        if not panel.lines:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    legend = axes.flat[-1]
    legend.axis("off")
    for i, name in enumerate(runs):
        legend.plot([], [], color=f"C{i % 10}", label=name)
    legend.legend(loc="upper left", title="runs (solid: train, dashed: val)", frameon=False)
    notes = [f"{p.title}: {n}" for p in all_panels.values() for n in p.notes]
    if notes:
        legend.text(0.0, 0.45, "\n".join(notes[:12]), va="top", fontsize=8, transform=legend.transAxes, wrap=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format=fmt, dpi=110)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; give it an ordinary new file's mode
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def compare(run_dirs: Sequence[str], out: str) -> List[str]:
    """Read the runs, draw the figure into `out`; return the notes (series some run lacks)."""
    if len(set(Path(p).resolve() for p in run_dirs)) != len(run_dirs):
        raise ConfigError("compare: a run folder is given twice; give each run once")
    runs = [read_run(Path(p)) for p in run_dirs]
    check_out(Path(out))  # before reading anything heavy or drawing
    all_panels = panels(runs)
    states = [state_of(r) for r in runs]
    # The legend names each run with its state where it is not finished: a curve that stops short reads as such.
    plot(all_panels, [f"{name} ({state})" if state else name for name, state in zip(labels(runs), states)], Path(out))
    return [f"{name}: {state}" for name, state in zip(labels(runs), states) if state] + \
        [f"{p.title}: {n}" for p in all_panels.values() for n in p.notes]
