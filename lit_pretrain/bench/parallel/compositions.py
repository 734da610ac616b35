"""Cases: the step time of each composition of the parallel plan on 4 processes against one process on the same
global batch, and the bytes each rank all-gathers, reduce-scatters and all-reduces in a step against the formulas
of planning/communication.py.

One group of 4 spawned gloo processes (1 thread each) builds every composition once from the same weights (the
experiment's model, the trainer's micro-batch as the global batch), then alternates: the reference (rank 0 alone,
2 threads, the others waiting in a barrier) and each composition in turn, REPEATS times; each case reports the
medians and the spread of the per-alternation ratios (bench/stats.py). A step is forward, backward, the plan's
gradient sync, the global norm, clipping and AdamW. On 2 cores 4 ranks x 1 thread share what 1 process x 2
threads has alone: the ratios report what the split and its communication cost here, not a speed-up.

Communication is counted by wrapping torch.distributed's collectives for one step after the timing: the functions
in torch.distributed.distributed_c10d, and every reference to them held by a loaded torch.distributed or
lit_pretrain module (FSDP2 calls dist.all_gather_single and dist.reduce_scatter_single on gloo, HSDP dist.all_reduce;
parallel/sequence.py holds its own references). A collective called inside another (all_gather_single may
delegate) counts once, as the outermost.
"""

import copy
import os
import socket
import sys
import threading
import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F

from lit_pretrain.bench import stats
from lit_pretrain.model.losses import lm_losses

WORLD, STEPS, SKIP = 4, 4, 1
REPEATS = stats.ALTERNATIONS
TIMED = ("zero3_tp2", "zero2_pp2", "hsdp_2x2", "dp2_tp2_sp")
GATHER = ("all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base")
SCATTER = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base")
OTHER = ("all_reduce", "all_to_all", "all_to_all_single", "broadcast", "reduce", "send", "recv", "isend", "irecv",
         "batch_isend_irecv", "all_gather_object", "broadcast_object_list", "barrier")


def plans():
    from lit_pretrain.planning.plan import ParallelPlan

    return {
        "zero3_tp2": ParallelPlan(data_parallel_shard=2, zero_stage=3, tensor_parallel=2),
        "zero2_pp2": ParallelPlan(data_parallel_shard=2, zero_stage=2, pipeline_parallel=2, micro_batches=2),
        "hsdp_2x2": ParallelPlan(data_parallel_replicate=2, data_parallel_shard=2, zero_stage=3),
        "dp2_tp2_sp": ParallelPlan(data_parallel_replicate=2, tensor_parallel=2, sequence_parallel=True),
        # Communication only (the formulas one at a time): ZeRO-3 over 4 shards, TP 2 with 2 replicas.
        "zero3": ParallelPlan(data_parallel_shard=4, zero_stage=3),
        "dp2_tp2": ParallelPlan(data_parallel_replicate=2, tensor_parallel=2),
    }


def formulas(cfg, batch: int) -> dict:
    """Per-rank bytes per step of each measured composition, from planning/communication.py."""
    from lit_pretrain.planning import communication as cm

    L, d, f, V, T = cfg.n_layers, cfg.d_model, cfg.hidden_dim, cfg.vocab_size, cfg.seq_len
    b = batch // 2  # each composition has 2 data-parallel ranks (or 4 for zero3)
    return {
        "zero3": cm.total(cm.zero(L, d, f, V, w=4), cm.grad_norm(1)),
        "dp2_tp2": cm.total(cm.tensor_parallel(L, d, b, T), cm.replicas_all_reduce(L, d, f, V, t=2),
                            cm.grad_norm(0, 1)),
        "zero3_tp2": cm.total(cm.zero(L, d, f, V, w=2, t=2), cm.tensor_parallel(L, d, b, T), cm.grad_norm(1, 1)),
        "dp2_tp2_sp": cm.total(cm.sequence_parallel(L, d, b, T), cm.replicas_all_reduce(L, d, f, V, t=2),
                               cm.grad_norm(0, 1)),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


class CountCollectives:
    """Within the block: bytes per kind (all_gather: output, reduce_scatter: input, else the tensor arguments)."""

    def __init__(self):
        self.bytes = defaultdict(int)
        self.calls = defaultdict(int)
        self._depth = threading.local()
        self._patched = []

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                if name in GATHER:
                    kind, size = "all_gather", _nbytes(args[0] if args else kwargs.get("output_tensor"))
                elif name in SCATTER:
                    kind, size = "reduce_scatter", _nbytes(args[1] if len(args) > 1 else kwargs.get("input"))
                else:
                    kind, size = name, _nbytes(args[0] if args else next(iter(kwargs.values()), None))
                self.bytes[kind] += size
                self.calls[kind] += 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def __enter__(self):
        originals = {getattr(c10d, n): n for n in GATHER + SCATTER + OTHER if hasattr(c10d, n)}
        wrappers = {fn: self._wrap(name, fn) for fn, name in originals.items()}
        for mod in list(sys.modules.values()):
            mname = getattr(mod, "__name__", "") or ""
            if not (mname.startswith("torch.distributed") or mname.startswith("lit_pretrain")):
                continue
            for attr, value in list(vars(mod).items()):
                if callable(value) and _hashable(value) and value in wrappers:
                    setattr(mod, attr, wrappers[value])
                    self._patched.append((mod, attr, value))
        return self

    def __exit__(self, *exc):
        for mod, attr, value in reversed(self._patched):
            setattr(mod, attr, value)
        self._patched.clear()


def _batch(c, batch: int):
    g = torch.Generator().manual_seed(c.run.seed)
    w = torch.randint(0, c.model.vocab_size, (batch, c.model.seq_len + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def _timed(step, steps: int = STEPS, skip: int = SKIP) -> float:
    for i in range(steps):
        if i == skip:
            start = time.perf_counter()
        step()
    return (time.perf_counter() - start) / (steps - skip)


def _reference_step(c, model, opt, x, y, max_norm):
    def step():
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), max_norm, norm)
        opt.step()

    return step


def _plan_step(par, opt, x, y, max_norm):
    from lit_pretrain.parallel.vocab import split_cross_entropy

    d = par.plan.data_parallel
    dp_rank = dist.get_rank(par.replicate) * par.plan.data_parallel_shard + dist.get_rank(par.shard_group)
    per = x.shape[0] // d
    x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
    params = list(par.gpt.parameters())

    def step():
        opt.zero_grad()
        if par.runner is not None:
            par.runner.loss((x, y))
        else:
            # the layout's logits: this rank's vocabulary columns under tensor parallelism (parallel/vocab.py)
            lm_losses(par.gpt(x), y, split_cross_entropy=split_cross_entropy(par.vocab_group))[0].backward()
        par.sync_gradients()
        norm = par.grad_norm()
        torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, norm)
        opt.step()

    return step


def _worker(rank: int, port: int, c, batch: int, results) -> None:
    from lit_pretrain.model.gpt import GPT
    from lit_pretrain.optim.optimizers import build_adamw
    from lit_pretrain.parallel.apply import apply_plan
    from lit_pretrain.parallel.mesh import build_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    max_norm = c.optim.grad_clip_norm or 1.0
    torch.manual_seed(c.run.seed)
    base = GPT(c.model)
    x, y = _batch(c, batch)
    steps = {}
    for name, plan in plans().items():
        model = copy.deepcopy(base)
        par = apply_plan(model, plan, build_mesh(plan))
        steps[name] = _plan_step(par, build_adamw(model, c.optim, kernel="foreach"), x, y, max_norm)
    if rank == 0:
        ref = copy.deepcopy(base)
        reference = _reference_step(c, ref, build_adamw(ref, c.optim, kernel="foreach"), x, y, max_norm)
    seconds = defaultdict(list)
    try:
        for _ in range(REPEATS):
            if rank == 0:  # rank 0 alone with both threads; the others wait in the barrier
                torch.set_num_threads(2)
                seconds["single"].append(_timed(reference))
                torch.set_num_threads(1)
            dist.barrier()
            for name in TIMED:
                seconds[name].append(_timed(steps[name]))
                dist.barrier()
        comm = {}
        for name in formulas(c.model, batch):
            if name not in TIMED:
                steps[name]()  # the communication-only layouts: one untimed first step
            dist.barrier()
            with CountCollectives() as counter:
                steps[name]()
            comm[name] = {"bytes": dict(counter.bytes), "calls": dict(counter.calls)}
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.update({"seconds": dict(seconds), "comm": comm})


def run(c) -> list:
    import torch.multiprocessing as mp

    batch = c.trainer.micro_batch_size
    if batch % 4:
        raise ValueError(f"trainer.micro_batch_size={batch} must divide by 4 data-parallel ranks for the bench")
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(_free_port(), c, batch, results), nprocs=WORLD, join=True,
                           start_method="spawn")
        results = dict(results)
    single = results["seconds"]["single"]
    detail = {"global_batch": batch, "timed_steps": STEPS - SKIP, "repeats": REPEATS,
              "model": {k: getattr(c.model, k) for k in ("n_layers", "d_model", "hidden_dim", "vocab_size",
                                                         "seq_len")}}
    cases = []
    for name in TIMED:
        cases.append({"case": f"step_seconds_{name}_4proc", **stats.summary(single, results["seconds"][name]),
                      "goal": "report (4 ranks x 1 thread vs 1 process x 2 threads)", "unit": "s/step",
                      "detail": detail})
    for name, expected in formulas(c.model, batch).items():
        measured = results["comm"][name]
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            if not expected[kind] and not measured["bytes"].get(kind):
                continue
            value = measured["bytes"].get(kind, 0)
            cases.append({"case": f"comm_bytes_{name}_{kind}", "value": value, "reference": expected[kind],
                          "ratio": value / expected[kind] if expected[kind] else float("inf"),
                          "goal": "0.95-1.05 (formula: planning/communication.py)", "unit": "bytes/rank/step",
                          "detail": {**detail, "calls": measured["calls"], "all_bytes": measured["bytes"]}})
    return cases


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
