"""Spawned workers for tests/parallel/test_expert_parallel.py: expert parallelism (strategy.expert_parallel) in the
parallel plans of tests/parallel/test_mesh_parallel.py, against one process built from the same weights, and sharded
checkpoints resharded between expert-parallel and other layouts (tests/helpers/sharded_workers.py's cases on the MoE
model).

Each case returns, from global rank 0, what it measured; the test asserts it.
"""

import copy
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.model.losses import lm_losses
from lit_pretrain.model.moe import moe_layers
from lit_pretrain.parallel.apply import apply_plan
from lit_pretrain.parallel.mesh import build_mesh
from lit_pretrain.parallel.vocab import split_cross_entropy
from tests.helpers import sharded_workers
from tests.helpers.mesh_workers import BATCH, CFG, case, data, data_parallel_rank

# 4 experts, top 2, dropless. The Switch loss and the z-loss are 0 here: mesh_workers trains the task loss alone
# (tests/parallel/test_moe_parallel.py covers the z-loss and the bias through the CLI), so the parity is of the routing,
# the dispatch and the experts' gradients.
MOE = {"moe": {"num_experts": 4, "top_k": 2, "d_ff_expert": 32, "aux_loss": 0.0, "router_z_loss": 0.0}}


def held_experts(par) -> int:
    """Expert rows this rank holds (after the FSDP shard): E / expert_parallel / its FSDP share, summed over layers."""
    return sum(layer.experts["w_gate"].weight.to_local().shape[0] if hasattr(layer.experts["w_gate"].weight,
                                                                            "to_local")
               else layer.experts["w_gate"].weight.shape[0] for layer in moe_layers(par.gpt))


def routing_counts(plan) -> dict:
    """Tokens per expert of every MoE layer in one training forward of the first batch, summed over the data-
    parallel ranks, by layer index, on rank 0 (None elsewhere); and the same from one process."""
    torch.manual_seed(0)
    init = GPT(GPTConfig(**{**CFG, **MOE}))
    xs, ys = data()
    ref = copy.deepcopy(init)
    ref(xs[0])
    expected = {m.layer: m.load[:4].tolist() for m in moe_layers(ref)}
    model = copy.deepcopy(init)
    par = apply_plan(model, plan, build_mesh(plan))
    per = BATCH // plan.data_parallel
    d = data_parallel_rank(par)
    x, y = xs[0][d * per:(d + 1) * per], ys[0][d * per:(d + 1) * per]
    if par.runner is not None:
        par.runner.loss((x, y))
    else:
        # logits: this rank's columns
        lm_losses(model(x), y, split_cross_entropy=split_cross_entropy(par.vocab_group))[0].backward()
    counts = {}
    for m in moe_layers(model):
        load = m.load[:4].clone()
        for group in (par.replicate, par.shard_group):
            dist.all_reduce(load, group=group)
        counts[m.layer] = load.tolist()
    parts = [None] * dist.get_world_size(par.pp)
    dist.all_gather_object(parts, counts, group=par.pp)
    merged = {k: v for part in parts for k, v in part.items()}
    held = held_experts(par)
    # The stacks' shapes (an FSDP2 shard's global shape) on every rank: E/P experts x 1/t of their width.
    widths = [None] * dist.get_world_size()
    dist.all_gather_object(widths, {tuple(w.weight.shape) for m in moe_layers(model) for w in m.experts.values()})
    return {"counts": merged, "expected": expected, "held_expert_rows": held, "expert_shapes": widths}


def ep_case(plan, name: str, out: dict) -> None:
    case(plan, out, name, MOE)  # losses, norms, first-step gradients, weights, AdamW moments, round trips
    routing = routing_counts(plan)
    if dist.get_rank() == 0:
        out[name].update(routing)


def reshard_case(src, dst, folder, out: dict, name: str) -> None:
    sharded_workers.reshard_case(src, dst, folder, out, name)


def worker(rank: int, world: int, port: int, cases: list, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    sharded_workers.MODEL.update(MOE)  # the reshard cases' model: the MoE one
    out = {}
    try:
        for kind, *args in cases:
            if kind == "parity":
                ep_case(*args, out=out)
            else:
                reshard_case(*args, out=out, name=args[-1].name)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.update(out)
