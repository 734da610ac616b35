"""DownstreamEval: lm-evaluation-harness tasks during training, logged as eval/<task>/<metric>.

When: at validation (its on_validation_epoch_end), every `every_n_steps` optimizer steps (a multiple of
trainer.val_every_n_steps; null: every validation) and at the last step. Running inside validation keeps its cost off
the training step's timing: the throughput monitor pauses from validation's start to its end. Its own cost is logged
as eval/seconds and eval/tokens (tokens through the model).

Who: rank 0 runs lm-eval on one whole copy of the weights; the other ranks wait for its outcome (a broadcast), so an
evaluation must end within strategy.timeout_seconds. An evaluation that fails is skipped with a warning on every
rank together, and training goes on. Under single, ddp and ZeRO 1 every rank holds the whole GPT and rank 0 uses its
own, no copy. Under ZeRO 2/3, tensor or pipeline parallelism (and with regional compile, whose compiled blocks would
recompile for every new input length) the strategy gathers the full state dict, as a checkpoint does (every rank
takes part), and rank 0 loads it into a plain GPT for the evaluation.

The global random generators (python, numpy, torch, CUDA) are saved before and restored after, so a run with the
evaluation trains exactly as one without it; lm-eval seeds its own few-shot sampling.
"""

import random
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn

from lit_pretrain.errors import ConfigError

KEY = "callbacks.downstream_eval"


@contextmanager
def preserved_rng():
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    state = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if cuda else None)
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if cuda:
            torch.cuda.set_rng_state_all(state[3])


class DownstreamEval(Callback):
    def __init__(self, tasks: Sequence[str], val_every_n_steps: int, every_n_steps: Optional[int] = None,
                 limit: Optional[float] = None, max_tokens: Optional[int] = None, include_path: Sequence[str] = (),
                 batch_size: int = 8, num_fewshot: Optional[int] = None, builtin_tasks: bool = True):
        """tasks: lm-eval names; val_every_n_steps: trainer.val_every_n_steps (the evaluation runs at validation);
        the rest as in schema.DownstreamEvalConfig. builtin_tasks=False looks only in include_path (tests)."""
        from lit_pretrain.evaluation.command import require_lm_eval

        require_lm_eval(f"{KEY}.enabled=true")
        if every_n_steps is not None and (every_n_steps < 1 or every_n_steps % val_every_n_steps):
            raise ConfigError(
                f"{KEY}.every_n_steps={every_n_steps} is not a multiple of trainer.val_every_n_steps="
                f"{val_every_n_steps}: the tasks run at validation time; use a multiple of it, or null for every "
                "validation")
        for name, value, low in (("limit", limit, 0), ("max_tokens", max_tokens, 1), ("batch_size", batch_size, 1)):
            if value is not None and value < low:
                raise ConfigError(f"{KEY}.{name}={value} must be at least {low}")
        from lit_pretrain.evaluation import harness

        self.tasks, self.every_n_steps = list(tasks), every_n_steps
        self.limit = None if limit is None else (int(limit) if limit >= 1 else limit)
        self.max_tokens, self.batch_size, self.num_fewshot = max_tokens, batch_size, num_fewshot
        self.include_path = [str(Path(p).resolve()) for p in include_path]
        # Built now, on every rank, so an unknown task name stops the run before the first step, not at the first
        # evaluation; kept for the evaluations (rank 0).
        self._manager = harness.task_manager(self.tasks, self.include_path, key=f"{KEY}.tasks", builtin=builtin_tasks)
        self._samples: Optional[Dict] = None
        self._tokenizer = None
        self._last_step: Optional[int] = None
        self.last: Dict[str, float] = {}
        """The metrics of the latest evaluation (rank 0)."""

    def __getstate__(self):  # spawned processes rebuild nothing: the task index is rank 0's, on first use
        return {**self.__dict__, "_manager": None, "_tokenizer": None}

    def due(self, step: int, max_steps: int) -> bool:
        if step <= 0 or step == self._last_step:
            return False
        return self.every_n_steps is None or step % self.every_n_steps == 0 or step >= max_steps

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        step = trainer.global_step
        if trainer.sanity_checking or not self.due(step, trainer.max_steps):
            return
        self._last_step = step
        started = time.perf_counter()
        model = whole_model(trainer, pl_module)  # a collective under sharded strategies: every rank calls it
        metrics, error = None, None
        if trainer.is_global_zero:
            try:
                with preserved_rng():
                    metrics = self.evaluate(model, trainer)
            except Exception as err:  # reported below: the other ranks must not wait for a rank 0 that died
                error = f"{type(err).__name__}: {err}"
        # The other ranks wait for rank 0 here.
        if trainer.strategy.broadcast(error, src=0) is not None:
            # A failed evaluation costs its scores, not the run: training goes on, and the warning says why.
            rank_zero_warn(f"{KEY}: the evaluation at step {step} failed and was skipped ({error})")
            return
        if metrics is not None:
            metrics["eval/seconds"] = time.perf_counter() - started
            self.last = metrics
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def evaluate(self, model, trainer) -> Dict[str, float]:
        from lit_pretrain.data.tokenizer import load_tokenizer
        from lit_pretrain.evaluation import harness
        from lit_pretrain.evaluation.lm import LitPretrainLM

        if self._manager is None:
            self._manager = harness.task_manager(self.tasks, self.include_path, key=f"{KEY}.tasks")
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(trainer.datamodule.tokenizer_path)
        limit, samples = self.limit, None
        if self.max_tokens is not None:
            if self._samples is None:  # counted once: the documents and the tokenizer do not change
                counts = harness.count_tokens(self._tokenizer, model.cfg.seq_len, self.tasks, self._manager,
                                              limit=self.limit, num_fewshot=self.num_fewshot)
                self._samples = harness.samples_within_budget(counts, self.max_tokens)
            limit, samples = None, self._samples
        lm = LitPretrainLM(model, self._tokenizer, batch_size=self.batch_size)
        results = harness.run_tasks(lm, self.tasks, self._manager, limit=limit, samples=samples,
                                    num_fewshot=self.num_fewshot, bootstrap_iters=0)
        metrics = {f"eval/{task}/{name}": value for task, values in harness.scores(results).items()
                   for name, value in values.items() if not name.endswith("_stderr")}
        metrics["eval/tokens"] = float(lm.tokens_scored)
        return metrics

    def state_dict(self) -> Dict:
        return {"last_step": self._last_step}

    def load_state_dict(self, state: Dict) -> None:
        self._last_step = state.get("last_step")


def whole_model(trainer, pl_module):
    """On rank 0, a GPT holding all of the model's weights (None on the other ranks); see the module docstring."""
    from lit_pretrain.parallel.compile import is_compiled

    gpt = pl_module.model
    if not isinstance(trainer.strategy, ModelParallelStrategy) and not any(is_compiled(b) for b in gpt.blocks):
        return gpt if trainer.is_global_zero else None
    with torch.inference_mode(False):  # validation runs in inference mode; the gather runs as a checkpoint's does
        state = trainer.strategy.lightning_module_state_dict()
    if not trainer.is_global_zero:
        return None
    from lit_pretrain.model.gpt import GPT

    prefix = "model."
    with torch.device(trainer.strategy.root_device):
        copy = GPT(pl_module.model_cfg)
    copy.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, strict=True)
    return copy.eval()
