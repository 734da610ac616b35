"""Cases: the pipeline's measured idle fraction against (p-1)/(m+p-1) for p = 2 and m in {1, 2, 4, 8}, and the step
time of each layout (PP2 with each m, TP2) as a ratio to one process on the same batch.

The experiment's model and micro-batch run through our wrappers (parallel/mesh.py) in 2 spawned processes of one
thread each, without Lightning: the case measures the parallelism, not the trainer. One process uses both threads.
On a 2-core machine 2 ranks cannot beat 1 process × 2 threads: the ratios show what the split costs, and the idle
fraction is what the schedule's bubble costs. Idle = 1 − (seconds in the stage's forward and backward) / (step
seconds), averaged over the pipeline ranks (parallel/pipeline.py); it also counts communication and the loss.
The bubble cases run GPipe: 1F1B refuses m < p, and both have the same bubble.
"""

import copy
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lit_pretrain.bench import stats
from lit_pretrain.model.losses import lm_losses

MICRO_BATCHES = (1, 2, 4, 8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(c, batch: int):
    g = torch.Generator().manual_seed(c.run.seed)
    w = torch.randint(0, c.model.vocab_size, (batch, c.model.seq_len + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def _time_steps(step, steps: int, skip: int) -> list:
    """Seconds of each of steps skip..steps (the first `skip` steps allocate and are left out)."""
    seconds = []
    for i in range(steps):
        start = time.perf_counter()
        step()
        if i >= skip:
            seconds.append(time.perf_counter() - start)
    return seconds


def _worker(rank: int, port: int, c, batch: int, steps: int, skip: int, results) -> None:
    from lit_pretrain.model.gpt import GPT
    from lit_pretrain.parallel.apply import apply_plan
    from lit_pretrain.parallel.mesh import build_mesh
    from lit_pretrain.parallel.vocab import split_cross_entropy
    from lit_pretrain.planning.plan import ParallelPlan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    torch.manual_seed(c.run.seed)
    base = GPT(c.model)
    x, y = _batch(c, batch)
    out = {}
    try:
        for m in MICRO_BATCHES:
            plan = ParallelPlan(pipeline_parallel=2, schedule="gpipe", micro_batches=m)
            par = apply_plan(copy.deepcopy(base), plan, build_mesh(plan))
            idle = []

            def pp_step(par=par, idle=idle):
                par.runner.loss((x, y))
                idle.append(par.runner.last_idle_fraction)

            seconds = _time_steps(pp_step, steps, skip)
            out[f"pp2_m{m}"] = {"seconds": seconds, "idle": idle[skip:],
                                "formula": par.runner.bubble_formula}
        plan = ParallelPlan(tensor_parallel=2)
        par = apply_plan(copy.deepcopy(base), plan, build_mesh(plan))

        def tp_step(model=par.gpt, group=par.vocab_group):  # logits: this rank's vocabulary columns
            lm_losses(model(x), y, split_cross_entropy=split_cross_entropy(group))[0].backward()

        out["tp2"] = {"seconds": _time_steps(tp_step, steps, skip)}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.update(out)


def run(c, steps: int = 1 + stats.ALTERNATIONS, skip: int = 1) -> list:
    """Spawning the ranks costs more than the steps, so the case's pairs are timed steps, not alternated launches:
    step i of each layout against step i of the one process (bench/stats.py); the spread is step-to-step noise."""
    import torch.multiprocessing as mp

    from lit_pretrain.model.gpt import GPT

    batch = max(8, c.trainer.micro_batch_size // 8 * 8)  # divisible into 8 micro-batches
    torch.manual_seed(c.run.seed)
    model = GPT(c.model)
    x, y = _batch(c, batch)
    single = _time_steps(lambda: F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward(), steps, skip)
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(_free_port(), c, batch, steps, skip, results), nprocs=2, join=True,
                           start_method="spawn")
        results = dict(results)
    detail = {"batch": batch, "timed_steps": steps - skip, "forward_backward_only": True,
              "pairs": "timed step i of each side"}
    cases = []
    for m in MICRO_BATCHES:
        r = results[f"pp2_m{m}"]
        cases.append({"case": f"pipeline_idle_fraction_p2_m{m}",
                      **stats.single(r["idle"], lambda idle, f=r["formula"]: idle / f), "reference": r["formula"],
                      "goal": "report (formula (p-1)/(m+p-1))",
                      "unit": "fraction", "detail": detail})
    for name in [f"pp2_m{m}" for m in MICRO_BATCHES] + ["tp2"]:
        cases.append({"case": f"step_seconds_{name}", **stats.summary(single, results[name]["seconds"]),
                      "goal": "report (2 ranks x 1 thread vs 1 process x 2 threads)", "unit": "s/step",
                      "detail": detail})
    return cases
