"""Cases: expert parallelism (strategy.expert_parallel, parallel/expert.py) on 2 processes against the same MoE
replicated over them (plain data parallelism), same weights, same global batch.

The model is bench/moe/mlp.py's: the experiment's with every MLP an MoE of 8 experts, top 2, each half the dense width.
Two spawned gloo processes (1 thread each) build both layouts from the same weights and alternate them REPEATS
times; a step is forward, backward, the plan's gradient sync, the global norm, clipping and AdamW.

- moe_expert_parallel_state_bytes: parameter, gradient and AdamW bytes one rank holds under EP 2 over what it holds
  with the experts replicated (goal: the dense share plus half the experts', the planner's count for the shape).
- moe_expert_parallel_step: tokens/s of EP 2 over the replicated MoE (report: EP computes every expert once per
  token copy on its owner and pays two all-to-alls per MoE layer each way; replicated, each rank computes all its
  copies and all-reduces every expert's gradient).
"""

import copy
import os
import socket
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lit_pretrain.bench import stats

WORLD, STEPS, SKIP = 2, 4, 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _held_bytes(model, opt) -> int:
    """Bytes of this rank's parameters, gradients and optimizer state (local shards)."""
    from lit_pretrain.parallel.mesh import local

    tensors = [local(p) for p in model.parameters()] + [local(p.grad) for p in model.parameters()
                                                          if p.grad is not None]
    tensors += [local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors)


def _worker(rank: int, port: int, c, model_cfg, repeats: int, results) -> None:
    from lit_pretrain.model.gpt import GPT
    from lit_pretrain.optim.optimizers import build_adamw, clip_by_global_norm
    from lit_pretrain.parallel.apply import apply_plan
    from lit_pretrain.parallel.mesh import build_mesh
    from lit_pretrain.planning.plan import ParallelPlan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    try:
        torch.manual_seed(c.run.seed)
        base = GPT(model_cfg)
        g = torch.Generator().manual_seed(c.run.seed + rank)  # each rank its own half of the global batch
        w = torch.randint(0, model_cfg.vocab_size, (c.trainer.micro_batch_size // WORLD, model_cfg.seq_len + 1),
                          generator=g)
        x, y = w[:, :-1], w[:, 1:]
        steps, held = {}, {}
        for name, ep in (("replicated", 1), ("ep2", 2)):
            plan = ParallelPlan(data_parallel_replicate=WORLD, expert_parallel=ep)
            model = copy.deepcopy(base)
            par = apply_plan(model, plan, build_mesh(plan))  # our mesh's gradient sync for both
            opt = build_adamw(model, c.optim, kernel="foreach")

            def step(model=model, par=par, opt=opt):
                opt.zero_grad()
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
                par.sync_gradients()
                clip_by_global_norm(model.parameters(), c.optim.grad_clip_norm or 1.0, par.grad_norm())
                opt.step()

            step()  # AdamW's state exists after the first step
            held[name] = _held_bytes(model, opt)
            steps[name] = step
        seconds = {"replicated": [], "ep2": []}
        for _ in range(repeats):
            for name, step in steps.items():
                dist.barrier()
                start = 0.0
                for i in range(STEPS):
                    if i == SKIP:
                        start = time.perf_counter()
                    step()
                seconds[name].append((time.perf_counter() - start) / (STEPS - SKIP))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.update({"seconds": seconds, "held": held})


def run(c, repeats: int) -> list:
    import torch.multiprocessing as mp

    from lit_pretrain.bench.moe.mlp import moe_model_cfg
    from lit_pretrain.planning.memory import memory_plan
    from lit_pretrain.planning.plan import ParallelPlan

    model_cfg = moe_model_cfg(c)
    if model_cfg.vocab_size is None:  # the tokenizer's target size, as the run would build it (plan.sized_model)
        model_cfg = replace(model_cfg, vocab_size=c.data.vocab_size)
    if c.trainer.micro_batch_size % WORLD:
        raise ValueError(f"trainer.micro_batch_size={c.trainer.micro_batch_size} must divide by {WORLD} ranks")
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(_free_port(), c, model_cfg, repeats, results), nprocs=WORLD, join=True,
                           start_method="spawn")
        results = dict(results)
    held, seconds = results["held"], results["seconds"]
    tokens = c.trainer.micro_batch_size * model_cfg.seq_len
    # The planner's parameters per rank at EP 2 over replicated: parameters, gradients and AdamW state all scale
    # with them in fp32 (4 + 4 + 8 bytes each).
    planned = (memory_plan(ParallelPlan(data_parallel_shard=WORLD, expert_parallel=2),
                           model_cfg, 1, precision="32-true")
               ["params_per_device"] / memory_plan(ParallelPlan(data_parallel_shard=WORLD),
                                                   model_cfg, 1, precision="32-true")
               ["params_per_device"])
    detail = {"world": WORLD, "global_tokens": tokens, "timed_steps": STEPS - SKIP, "experts": 8, "top_k": 2,
              "held_bytes": held, "planned_ratio": planned}
    return [{"case": "moe_expert_parallel_state_bytes", "value": held["ep2"], "reference": held["replicated"],
             "ratio": held["ep2"] / held["replicated"], "goal": f"{planned:.4f} (planner)", "unit": "bytes/rank",
             "detail": detail},
            {"case": "moe_expert_parallel_step",
             **stats.summary([tokens / s for s in seconds["replicated"]], [tokens / s for s in seconds["ep2"]]),
             "goal": "report", "unit": "tokens/s", "detail": detail}]
