"""Find lm-evaluation-harness tasks, fit them to a token budget, run them, and flatten their scores.

Imported only when an evaluation runs: it imports lm-eval (several seconds) and its task index.
"""

import difflib
import logging
import random
from importlib.metadata import version
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from lm_eval import evaluator
from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
from lm_eval.tasks import TaskManager

from lit_pretrain.errors import ConfigError
from lit_pretrain.evaluation.lm import DEFAULT_MAX_GEN_TOKS, LitPretrainLM

# Keys of lm-eval's per-task results that are not scores.
NOT_SCORES = ("alias", "name", "sample_len", "samples")


def _known(manager: TaskManager, name: str) -> bool:
    return name in manager.all_tasks or (name.endswith((".yaml", ".yml")) and Path(name).is_file())


def task_manager(tasks: Sequence[str], include_path: Sequence[str] = (), key: str = "--tasks",
                 builtin: bool = True) -> TaskManager:
    """A TaskManager that knows every name in `tasks`, or a ConfigError naming the first it does not know.

    The include_path folders are indexed first, alone: lm-eval's own index (about 15,000 names) takes 10-30 s to
    build here, so it is built only when a name is not among the local tasks. builtin=False never builds it.
    """
    if not tasks:
        raise ConfigError(f"{key} is empty: name at least one lm-eval task")
    paths = [str(Path(p)) for p in include_path]
    for p in paths:
        if not Path(p).is_dir():
            raise ConfigError(f"include path {p} is not a folder: point it at a folder of task YAML files")
    manager = TaskManager(include_path=paths, include_defaults=False) if paths else None
    if builtin and (manager is None or not all(_known(manager, t) for t in tasks)):
        manager = TaskManager(include_path=paths or None)
    unknown = [t for t in tasks if manager is None or not _known(manager, t)]
    if unknown:
        close = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3) if manager is not None else []
        hint = f" (closest: {', '.join(close)})" if close else ""
        where = f"lm-eval's tasks or {', '.join(paths)}" if builtin else ", ".join(paths) or "no include path"
        raise ConfigError(f"{key}: unknown task {unknown[0]!r} in {where}{hint}: check the name, or pass the folder "
                          "of its YAML file as an include path")
    return manager


def run_tasks(lm, tasks: Sequence[str], manager: TaskManager, limit: Optional[float] = None,
              samples: Optional[Dict[str, List[int]]] = None, num_fewshot: Optional[int] = None,
              bootstrap_iters: int = 100_000) -> dict:
    """What lm_eval.simple_evaluate does for an `LM` object, minus its environment report.

    simple_evaluate ends by collecting an environment report (torch's collect_env runs pip and other subprocesses,
    and transformers is imported): 9 s here, for each evaluation. So: its seeds (random 0, numpy and torch 1234, the
    few-shot sampler 1234), its task loading and few-shot defaulting, then lm_eval.evaluator.evaluate.
    """
    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # per-task INFO lines would bury the training log
    loaded = manager.load(list(tasks))
    for task in loaded["tasks"].values():
        default = task.get_config("num_fewshot")
        if num_fewshot is not None and default != 0:  # a task that sets 0 keeps it, as in simple_evaluate
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif default is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    results = evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit, samples=samples,
                                 bootstrap_iters=bootstrap_iters, log_samples=False)
    results["lm_eval_version"] = version("lm_eval")
    return results


def scores(results: dict) -> Dict[str, Dict[str, float]]:
    """{task: {metric: value}} of lm-eval's results: 'acc,none' → 'acc', 'exact_match,strict-match' →
    'exact_match/strict-match'; stderr entries kept, non-numbers ('N/A') dropped."""
    out = {}
    for task, entries in {**results["results"], **results.get("groups", {})}.items():
        task_scores = {}
        for name, value in entries.items():
            if name in NOT_SCORES or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, _, filter_name = name.partition(",")
            task_scores[metric if filter_name in ("", "none") else f"{metric}/{filter_name}"] = float(value)
        out[task] = task_scores
    return out


class TokenCounter(LitPretrainLM):
    """Counts, per (task, document), the tokens LitPretrainLM would run through the model, and runs nothing."""

    def __init__(self, tokenizer, max_length: int):
        super(LitPretrainLM, self).__init__()  # TemplateLM's: there is no model to look at
        self._tokenizer, self.max_length = tokenizer, max_length
        self.tokens: Dict[str, Dict[int, int]] = {}

    def _add(self, req, n: int) -> None:
        per_doc = self.tokens.setdefault(req.task_name, {})
        per_doc[req.doc_id] = per_doc.get(req.doc_id, 0) + n

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        for req in requests:
            context, continuation = req.args
            # The input is context + continuation less its last token (plus the prefix token for an empty context),
            # truncated to max_length.
            n = len(self.tok_encode(context + continuation)) - (1 if context else 0)
            self._add(req, min(n, self.max_length))
        return [(0.0, False)] * len(requests)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        for req in requests:  # disjoint windows: each token is input once (the first after the prefix token)
            self._add(req, len(self.tok_encode(req.args[0])))
        return [0.0] * len(requests)

    def generate_until(self, requests, disable_tqdm: bool = False):
        for req in requests:
            context, kwargs = req.args
            start, new = len(self.tok_encode(context)), int((kwargs or {}).get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            # Greedy decoding recomputes the whole window for each new token: at most `new` windows.
            self._add(req, sum(min(start + k, self.max_length) for k in range(max(new, 1))))
        return [""] * len(requests)


def samples_within_budget(counts: Dict[str, Dict[int, int]], max_tokens: int) -> Dict[str, List[int]]:
    """Each task's first documents (in order) whose tokens fit in max_tokens / number of tasks; at least one each."""
    share = max_tokens // max(1, len(counts))
    out = {}
    for task, per_doc in counts.items():
        chosen, used = [], 0
        for doc_id in sorted(per_doc):
            if chosen and used + per_doc[doc_id] > share:
                break
            chosen.append(doc_id)
            used += per_doc[doc_id]
        out[task] = chosen
    return out


def count_tokens(tokenizer, max_length: int, tasks: Sequence[str], manager: TaskManager,
                 limit: Optional[float] = None, num_fewshot: Optional[int] = None) -> Dict[str, Dict[int, int]]:
    counter = TokenCounter(tokenizer, max_length)
    run_tasks(counter, tasks, manager, limit=limit, num_fewshot=num_fewshot, bootstrap_iters=0)
    return counter.tokens
