"""`lit-pretrain evaluate RUN_OR_CKPT --tasks ...`: lm-eval tasks on a checkpoint, scores into RUN/eval.json."""

import importlib.util
import json
import time
from pathlib import Path
from typing import Optional, Sequence, Tuple

from lit_pretrain.errors import ConfigError, DataError

EVAL_FILE = "eval.json"


def require_lm_eval(key: str) -> None:
    """lm-eval is an optional extra: say how to install it instead of failing on an import."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(f"{key} needs lm-evaluation-harness, which is not installed: "
                          "pip install 'lit-pretrain[eval]' (or pip install lm-eval)")


def resolve_run(run_or_ckpt: str | Path) -> Tuple[Path, str]:
    """(run folder, checkpoint file name in its checkpoints/) of a run folder (→ last.ckpt) or a checkpoint file."""
    path = Path(run_or_ckpt)
    if path.is_dir() and (path / "config.yaml").is_file():
        return path, "last.ckpt"
    if path.is_file() and path.parent.name == "checkpoints" and (path.parent.parent / "config.yaml").is_file():
        return path.parent.parent, path.name
    raise DataError(f"{run_or_ckpt} is neither a run folder (with config.yaml) nor a checkpoint file in a run "
                    "folder's checkpoints/: give runs/<name> or runs/<name>/checkpoints/<file>.ckpt")


def parse_limit(text: Optional[str]) -> Optional[float]:
    """lm-eval's --limit: a count of examples per task, or below 1 a fraction of each task."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(f"--limit {text}: give a positive number of examples per task, or a fraction below 1")
    return int(value) if value >= 1 else value


def load_run_tokenizer(run_dir: Path):
    """The tokenizer the run trained with: tokenizer.json of its config's data.prepared_dir."""
    from lit_pretrain import config as config_lib
    from lit_pretrain.data.shards import run_tokenizer_entry
    from lit_pretrain.data.tokenizer import load_tokenizer

    saved = config_lib.load(run_dir / "config.yaml", check_inputs=False)  # its corpus may have moved since
    folder, tok = run_tokenizer_entry(saved.data)
    return load_tokenizer(folder / tok["file"], eos_token=None)


def checkpoint_step(run_dir: Path, checkpoint: str) -> Optional[int]:
    """The optimizer step its sidecar records (resume/checkpoint_io.py, `<name>.ckpt.json`), read as plain JSON:
    importing checkpoint_io would import Lightning, seconds for one number."""
    try:
        side = json.loads((run_dir / "checkpoints" / f"{checkpoint}.json").read_text())
    except (OSError, ValueError):
        return None
    step = (side.get("meta") or {}).get("step") if isinstance(side, dict) else None
    return step if isinstance(step, int) else None


def evaluate(run_or_ckpt: str | Path, tasks: Sequence[str], limit: Optional[float] = None, batch_size: int = 8,
             include_path: Sequence[str] = (), num_fewshot: Optional[int] = None,
             device: Optional[str] = None) -> dict:
    """Run `tasks` on the checkpoint; write and return the run's eval.json (scores per task and what produced them)."""
    require_lm_eval("lit-pretrain evaluate")
    run_dir, checkpoint = resolve_run(run_or_ckpt)
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size}: give at least 1")
    import torch

    from lit_pretrain.atomic import atomic_write_bytes
    from lit_pretrain.evaluation import harness
    from lit_pretrain.evaluation.lm import LitPretrainLM
    from lit_pretrain.resume.weights import load_gpt

    manager = harness.task_manager(tasks, include_path, key="--tasks")  # an unknown name fails before any loading
    tokenizer = load_run_tokenizer(run_dir)
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_gpt(run_dir, checkpoint).to(target)
    lm = LitPretrainLM(model, tokenizer, batch_size=batch_size, device=target)
    started = time.perf_counter()
    results = harness.run_tasks(lm, tasks, manager, limit=limit, num_fewshot=num_fewshot)
    report = {
        "checkpoint": str(run_dir / "checkpoints" / checkpoint),
        "step": checkpoint_step(run_dir, checkpoint),
        "tasks": harness.scores(results),
        "samples_per_task": {k: v.get("effective") for k, v in (results.get("n-samples") or {}).items()},
        "num_fewshot": results.get("n-shot"),
        "limit": limit,
        "batch_size": batch_size,
        "task_versions": results.get("versions"),
        "lm_eval_version": results.get("lm_eval_version"),
        "tokens_scored": lm.tokens_scored,
        "seconds": round(time.perf_counter() - started, 3),
    }
    # Atomic: a temporary file beside it, renamed over eval.json; no other file of the run folder is touched.
    atomic_write_bytes(run_dir / EVAL_FILE, (json.dumps(report, indent=2, default=str) + "\n").encode())
    return report


def format_scores(report: dict) -> str:
    lines = [f"{'task':<28} {'metric':<24} value"]
    for task, metrics in report["tasks"].items():
        for metric, value in metrics.items():
            lines.append(f"{task:<28} {metric:<24} {value:.4f}")
    return "\n".join(lines)
