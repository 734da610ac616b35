"""Spawned gloo workers for tests/simulate/test_simulate.py: each case's run file and overrides loaded as `simulate`
loads them, then one real optimizer step through the simulation's own step (simulate/engine.py build and
run_steps, on real tensors and a real process group), counted by the same collective counter, with the state bytes
the memory callback reports (parallel/memory.rank_state_bytes). Each rank returns its own; the test simulates the
same ranks on the fake backend and compares."""

import os
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist


def real_step(run_file: str, overrides: list) -> dict:
    from lit_pretrain import config
    from lit_pretrain.optim.optimizers import build_optimizer
    from lit_pretrain.parallel.memory import rank_state_bytes
    from lit_pretrain.simulate.engine import accumulation, build, group_labels, run_steps, step_collectives

    cfg = config.load(run_file, overrides, check_inputs=False)
    plan = replace(cfg.plan, compile=False)
    gpt, par, mesh = build(cfg, plan, "cpu")
    optimizer = build_optimizer(gpt, cfg.optim, plan.zero_stage, layout=par)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size or cfg.data.vocab_size, (cfg.trainer.micro_batch_size,
                                                                       cfg.model.seq_len), generator=g)
    accumulate = accumulation(cfg)
    run = min(accumulate, 2)
    parts = run_steps(cfg, par, gpt, optimizer, (x, torch.roll(x, -1, 1)), 1, run, group_labels(mesh))
    return {"collectives": step_collectives(parts, accumulate, run), "state": rank_state_bytes(gpt, optimizer)}


def worker(rank: int, world: int, port: int, cases: list, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        for name, run_file, overrides in cases:
            results[(name, rank)] = real_step(run_file, overrides)
            dist.barrier()
    finally:
        dist.destroy_process_group()
