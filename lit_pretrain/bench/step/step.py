"""Case: tokens/s of our Trainer's training step against a hand-written PyTorch loop (same model, batch, seed).

Both sides do the same work per step: forward, fp32 cross-entropy, backward, global-norm gradient clipping, AdamW
with the same parameter groups, the learning-rate schedule. The data is the same in-memory random windows, so
the case measures what Lightning and our module add to a step, not the data path (a case of its own).
"""

import contextlib
import functools
import tempfile
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lit_pretrain.bench import stats
from lit_pretrain.model.gpt import GPT
from lit_pretrain.module import PretrainModule
from lit_pretrain.optim.optimizers import build_adamw, clip_by_global_norm
from lit_pretrain.optim.schedule import lr_lambda
from lit_pretrain.parallel.apply import apply_plan
from lit_pretrain.planning.plan import ParallelPlan, build_plan


class _StepClock(L.Callback):
    """Time from the end of optimizer step `skip` to the end of the last one (warm-up and compile excluded).

    On a CPU it also marks the end of every step in between (`step_seconds`: one sample per step, for the cases
    whose pairs are timed steps). On a GPU the clock waits for the device at the two end steps only, so the steps
    between run asynchronously and are not marked.
    """

    def __init__(self, skip: int):
        self.skip, self.start, self.end, self.marks = skip, None, None, []

    def on_train_batch_end(self, trainer, pl_module, *args):
        step = trainer.global_step
        if step < self.skip:
            return
        ends = step in (self.skip, trainer.max_steps)
        if pl_module.device.type == "cuda":
            if not ends:
                return
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        if step == self.skip:
            self.start = now
        self.end = now
        if pl_module.device.type != "cuda":
            self.marks.append(now)

    def step_seconds(self) -> list:
        """Seconds of each step after `skip` (CPU only)."""
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def _data(c, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(c.run.seed)
    shape = (steps * c.trainer.micro_batch_size, c.model.seq_len + 1)
    windows = torch.randint(0, c.model.vocab_size, shape, generator=g)
    return DataLoader(TensorDataset(windows[:, :-1], windows[:, 1:]), batch_size=c.trainer.micro_batch_size)


def raw_step(c, compile: bool = False, bf16: bool = False):
    """The hand-written training step on the experiment's GPT: (its AdamW, step(x, y)), where a step is forward,
    fp32 cross-entropy, backward, global-norm clipping, AdamW and zeroing the gradients. `compile`: the forward and
    loss compiled as `trainer.compile: true` compiles the module's step on one process (parallel/compile.py, the
    same function). `bf16`: the forward and loss under bf16 autocast as Lightning's MixedPrecision plugin runs the
    training step for trainer.precision=bf16-mixed (cache_enabled=False; backward, clipping and AdamW outside it)."""
    torch.manual_seed(c.run.seed)
    model = GPT(c.model)
    forward_losses = apply_plan(model, ParallelPlan(compile=True)).forward_losses if compile else None
    opt = build_adamw(model, c.optim, build_plan(c).zero_stage)
    precision = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16, cache_enabled=False) if bf16 else \
        contextlib.nullcontext

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with precision():
            if forward_losses is not None:
                loss = forward_losses(x, y)[0]
            else:
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        clip_by_global_norm(model.parameters(), c.optim.grad_clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return opt, step


def raw_loop(c, steps: int, skip: int, compile: bool = False) -> float:
    """Tokens/s of the plain loop (raw_step and the learning-rate schedule) over steps skip..steps. `compile`: the
    compiled twin, so the Trainer / raw ratio compares like with like both ways; its first steps (left out by
    `skip`) compile."""
    opt, train_step = raw_step(c, compile)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(c.schedule, c.optim.lr_peak, steps))
    start = None
    for step, (x, y) in enumerate(_data(c, steps)):
        train_step(x, y)
        sched.step()
        if step + 1 == skip:
            start = time.perf_counter()
    return (steps - skip) * c.trainer.micro_batch_size * c.model.seq_len / (time.perf_counter() - start)


def trainer_loop(c, steps: int, skip: int, compile: bool = False, precision: str = "32-true",
                 accelerator: str = "cpu", strategy="auto", devices: int = 1, callbacks=(), plan=None) -> float:
    """Tokens/s (this rank's) of PretrainModule under L.Trainer, logging as `lit-pretrain train` does (CSV, every
    n steps). With `compile`, the first steps (left out by `skip`) pay the compile time. `callbacks`: more
    Lightning callbacks (bench/step/gpu_cases.py's probes). `plan`: the one `strategy` was built from (None: one
    process)."""
    tokens_per_step = c.trainer.micro_batch_size * c.model.seq_len
    module = PretrainModule(c.model, c.optim, c.schedule, max_steps=steps, tokens_per_step=tokens_per_step,
                            seed=c.run.seed, strategy=c.strategy, compile=compile, plan=plan)
    clock = _StepClock(skip)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = L.Trainer(accelerator=accelerator, devices=devices, strategy=strategy, max_steps=steps,
                            limit_val_batches=0, precision=precision,
                            logger=L.pytorch.loggers.CSVLogger(tmp, name="", version=""),
                            log_every_n_steps=c.trainer.log_every_n_steps, callbacks=[clock, *callbacks],
                            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
        trainer.fit(module, _data(c, steps))
    return (steps - skip) * tokens_per_step / (clock.end - clock.start)


def paired_case(case: str, reference, candidate, repeats: int, goal: str, unit: str, names, detail) -> dict:
    """Alternate reference() and candidate() `repeats` times; report the medians and the spread of the
    per-alternation ratios (bench/stats.py). `names` label the two series in the case's detail."""
    refs, cands = stats.alternate(reference, candidate, repeats)
    return {"case": case, **stats.summary(refs, cands), "goal": goal, "unit": unit,
            "detail": {names[1]: cands, names[0]: refs, **detail}}


def run_compiled(c, steps: int, skip: int, repeats: int) -> dict:
    """The same comparison with both sides compiled (`trainer.compile: true` and raw_loop's compiled twin)."""
    return paired_case("trainer_step_compiled_tokens_per_s", lambda: raw_loop(c, steps, skip, compile=True),
                       lambda: trainer_loop(c, steps, skip, compile=True), repeats, ">= 0.97", "tokens/s",
                       ("raw_loop_compiled", "trainer_compiled"), {"steps": steps, "timed_steps": steps - skip})


def run(c, steps: int, skip: int, repeats: int) -> dict:
    return paired_case("trainer_step_tokens_per_s", lambda: raw_loop(c, steps, skip),
                       lambda: trainer_loop(c, steps, skip), repeats, ">= 0.97", "tokens/s", ("raw_loop", "trainer"),
                       {"steps": steps, "timed_steps": steps - skip,
                        "params": GPT(c.model).num_params(non_embedding=False)})
