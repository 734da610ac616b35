"""Spawned worker for tests/parallel/test_loss_path_parallel.py: one training step through the one loss path
(`ParallelModel.losses`) of a layout with model.loss_chunk_size and/or model.mtp_depth, against one process's
whole-window step from the same weights. Rank 0 returns, per case, the largest loss and first-step gradient
differences."""

import copy
import dataclasses
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.parallel.apply import apply_plan, one_process
from lit_pretrain.parallel.mesh import build_mesh
from lit_pretrain.parallel.tensor import plain_name
from tests.helpers.mesh_workers import CFG, data, with_documents

Z_LOSS = 1e-3


def loss_path_case(plan, variant: dict) -> dict:
    variant = dict(variant)
    eod = variant.pop("eod_id", None)  # document masking, documents across the context-parallel chunks' edges
    cfg = GPTConfig(**{**CFG, **variant})
    torch.manual_seed(0)
    init = GPT(dataclasses.replace(cfg, loss_chunk_size=None))
    xs, ys = data() if eod is None else with_documents(data()[0], eod)
    batch = (xs[0], torch.roll(xs[0], -1, dims=-1))  # the targets unmasked: the loss path masks them
    ref = copy.deepcopy(init)
    want = one_process(ref).losses(batch, Z_LOSS, eod, training=True)
    want.trained.backward()
    model = copy.deepcopy(init)
    model.cfg = cfg  # the same weights, the chunked loss
    par = apply_plan(model, plan, build_mesh(plan))
    got = par.losses(batch, Z_LOSS, eod, training=True)
    if not par.runs_backward:
        got.trained.backward()
    par.sync_gradients()
    grads = par._gather_named({plain_name(n): p.grad for n, p in model.named_parameters()})
    if dist.get_rank() != 0:
        return {}
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    mtp = None if want.mtp is None else abs(got.mtp.item() - want.mtp.item())
    return {"task": abs(got.task.item() - want.task.item()), "z": abs(got.z.item() - want.z.item()), "mtp": mtp,
            "grad": max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()),
            "grad_keys": sorted(grads) == sorted(ref_grads)}


def worker(rank: int, world: int, port: int, cases: list, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=20))
    out = {}
    try:
        for name, plan, variant in cases:
            out[name] = loss_path_case(plan, variant)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.update(out)
