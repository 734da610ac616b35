"""Case: the in-training evaluation's share of wall time at the experiment's settings.

Three costs are measured on the experiment's model (random weights: the cost does not depend on them) and the
datamodule case's sample of its corpus, and combined for the experiment's schedule:
- a training step: the step case's tokens/s of our Trainer (passed in);
- one validation: trainer.val_windows windows through the module's own validation (loss and bits per byte),
  timed as `val/seconds` is logged;
- one downstream evaluation (callbacks.downstream_eval with its config's batch size), on a local multiple-choice
  task made from held-out documents of the sample: QUESTIONS questions, each a document's lines before a line as
  context and that line among 3 lines of other documents as choices (4 requests a question). Timed from task loading
  to scores, as `eval/seconds` is logged.
Validation runs every trainer.val_every_n_steps and at the last step; the downstream evaluation at each of those
when enabled (every_n_steps null). The case reports the share with the downstream evaluation (value, percent) and
without it (the default settings: the callback is off) in its detail. Every figure scales with its own knob:
val_windows, the task's size (or callbacks.downstream_eval.max_tokens), val_every_n_steps.
"""

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import lightning as L
import numpy as np

from lit_pretrain.bench import stats
from lit_pretrain.data.datamodule import TokenShardDataModule
from lit_pretrain.data.shards import load_manifest, open_shard
from lit_pretrain.data.tokenizer import eod_id, load_tokenizer
from lit_pretrain.module import PretrainModule

QUESTIONS = 100
CONTEXT_CHARS = 400  # the context is the last CONTEXT_CHARS characters before the answer line


def evaluations(max_steps: int, every_n_steps: int) -> int:
    """How many times an evaluation at every `every_n_steps` and at the last step runs in `max_steps` steps."""
    return max_steps // every_n_steps + (1 if max_steps % every_n_steps else 0)


def wall_share(max_steps: int, step_seconds: float, runs: int, seconds_per_run: float) -> float:
    """Fraction of the wall time spent in `runs` evaluations of `seconds_per_run` among max_steps training steps."""
    spent = runs * seconds_per_run
    return spent / (max_steps * step_seconds + spent)


def held_out_documents(folder: Path) -> List[str]:
    manifest = load_manifest(folder)
    tokenizer = load_tokenizer(folder / manifest["tokenizer"]["file"])
    ids = np.concatenate([open_shard(str(folder / s["file"]), manifest["dtype"])
                          for s in manifest["splits"]["val"]["shards"]])
    ends = np.flatnonzero(ids == eod_id(tokenizer))
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(ids[s:e].tolist()) for s, e in zip(starts, ends)]


def write_task(documents: List[str], folder: Path, seed: int = 0) -> str:
    """A multiple-choice task (YAML + JSON Lines) from the documents' lines; returns its name."""
    rng = random.Random(seed)
    lines = [[ln for ln in doc.splitlines() if len(ln.strip()) > 10] for doc in documents]
    usable = [i for i, doc in enumerate(lines) if len(doc) > 3]
    rows = []
    for _ in range(QUESTIONS):
        i = rng.choice(usable)
        k = rng.randrange(1, len(lines[i]))
        others = [rng.choice(lines[j]) for j in rng.sample([j for j in usable if j != i], 3)]
        choices = [lines[i][k], *others]
        rng.shuffle(choices)
        rows.append({"context": "\n".join(lines[i][:k])[-CONTEXT_CHARS:] + "\n", "choices": choices,
                     "answer": choices.index(lines[i][k])})
    data = folder / "held_out_lines.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "held_out_lines.yaml").write_text(
        f"task: held_out_lines\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\ntarget_delimiter: ''\n"
        "doc_to_target: '{{answer}}'\ndoc_to_choice: '{{choices}}'\nmetric_list:\n  - metric: acc\n")
    return "held_out_lines"


def validation_seconds(c, sample_data, module) -> float:
    data = TokenShardDataModule(sample_data, seq_len=c.model.seq_len, micro_batch_size=c.trainer.micro_batch_size,
                                seed=c.run.seed, val_windows=c.trainer.val_windows)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    return trainer.validate(module, datamodule=data, verbose=False)[0]["val/seconds"]


def downstream_seconds(c, sample_data, module, folder: Path) -> Dict:
    from lit_pretrain.evaluation import harness
    from lit_pretrain.evaluation.lm import LitPretrainLM

    d = c.callbacks.downstream_eval
    task = write_task(held_out_documents(Path(sample_data.prepared_dir)), folder)
    folder_in = Path(sample_data.prepared_dir)
    tokenizer = load_tokenizer(folder_in / load_manifest(folder_in)["tokenizer"]["file"])
    manager = harness.task_manager([task], [str(folder)], builtin=False)
    start = time.perf_counter()
    lm = LitPretrainLM(module.model.eval(), tokenizer, batch_size=d.batch_size)
    results = harness.run_tasks(lm, [task], manager, bootstrap_iters=0)
    return {"seconds": time.perf_counter() - start, "tokens": lm.tokens_scored,
            "acc": harness.scores(results)[task]["acc"]}


def run(c, sample_data, trainer_tokens_per_s: float, repeats: int) -> Dict:
    """Each of `repeats` rounds times one validation and one downstream evaluation and gives one share; the case
    reports their median and spread (bench/stats.py)."""
    module = PretrainModule(c.model, c.optim, c.schedule, max_steps=1, tokens_per_step=1, seed=c.run.seed)
    t = c.trainer
    step = (t.tokens_per_step or t.micro_batch_size * c.model.seq_len) / trainer_tokens_per_s  # planning/batch.py
    runs = evaluations(t.max_steps, t.val_every_n_steps)
    vals, downs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(max(1, repeats)):
            vals.append(validation_seconds(c, sample_data, module))
            downs.append(downstream_seconds(c, sample_data, module, Path(tmp)))
    shares = [100 * wall_share(t.max_steps, step, runs, v + d["seconds"]) for v, d in zip(vals, downs)]
    val, down_s, downstream = stats.median(vals), stats.median([d["seconds"] for d in downs]), downs[0]
    without = wall_share(t.max_steps, step, runs, val)
    with_downstream = wall_share(t.max_steps, step, runs, val + down_s)
    return {"case": "in_training_evaluation_share", **stats.single(shares, lambda share: share / 100),
            "reference": 100.0, "goal": "report", "unit": "percent of wall time",
            "detail": {"share_validation_only": without, "share_with_downstream_eval": with_downstream,
                       "validation_seconds": val, "downstream_seconds": down_s,
                       "downstream_tokens": downstream["tokens"], "downstream_questions": QUESTIONS,
                       "downstream_acc_random_weights": downstream["acc"], "step_seconds": step,
                       "evaluations": runs, "max_steps": t.max_steps, "val_every_n_steps": t.val_every_n_steps,
                       "val_windows": t.val_windows}}
