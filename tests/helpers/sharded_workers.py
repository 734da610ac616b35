"""Spawned workers for tests/resume/test_sharded_checkpoint.py: a sharded checkpoint written under one layout and read
into another, inside one spawn per world size (tests/helpers/mesh_workers.py's model, data and steps).

A case trains the source layout for K1 steps, saves (every rank its chunks), loads into a fresh model and AdamW of
the target layout, gathers both to single-process names on rank 0, then trains the target K2 more steps and
compares with the target layout trained K1 + K2 steps without a checkpoint.
"""

import copy
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.model.losses import lm_losses
from lit_pretrain.optim.optimizers import clip_by_global_norm
from lit_pretrain.parallel.apply import apply_plan
from lit_pretrain.parallel.mesh import build_mesh
from lit_pretrain.planning.plan import ParallelPlan
from lit_pretrain.resume.sharded import save as sharded
from lit_pretrain.resume.sharded.manifest import STEP_FOLDER
from tests.helpers.mesh_workers import BATCH, CFG, MAX_NORM, adamw, data, data_parallel_rank, layout_loss

K1 = 2  # steps before the checkpoint; the data has mesh_workers.STEPS = 3
MODEL: dict = {}  # model keys over CFG (tests/helpers/expert_workers.py sets model.moe)


def init_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**CFG, **MODEL}))


def train_steps(par, model, opt, xs, ys) -> list:
    """mesh_workers.run_layout's step on an existing layout (par None: one process)."""
    d = par.plan.data_parallel if par is not None else 1
    dp_rank = data_parallel_rank(par) if par is not None else 0
    per = BATCH // d
    losses = []
    for x, y in zip(xs, ys):
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        opt.zero_grad()
        if par is not None and par.runner is not None:
            loss = par.runner.loss((x, y))
        else:
            # under tensor parallelism the logits are this rank's vocabulary columns (parallel/vocab.py); under
            # context parallelism this rank's positions (mesh_workers.layout_loss)
            loss = layout_loss(par, model, x, y) if par is not None else lm_losses(model(x), y)[0]
            loss.backward()
            loss = loss.detach()
        if par is not None:
            par.sync_gradients()
            norm = par.grad_norm()
            for group in (par.replicate, par.shard_group):
                dist.all_reduce(loss, group=group)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        clip_by_global_norm(model.parameters(), MAX_NORM, norm)
        opt.step()
        losses.append(loss.item() / d)
    return losses


def layout(plan: ParallelPlan):
    model = copy.deepcopy(init_model())
    par = apply_plan(model, plan, build_mesh(plan))
    return par, model, adamw(model, plan.zero_stage)  # ZeRO-1: ZeroRedundancyOptimizer, each rank its tensors' state


def save(folder: Path, par, model, opt) -> None:
    chunks = {**sharded.model_chunks(model, par), **sharded.optimizer_chunks(model, opt, par)}
    group, rank = sharded.checkpoint_group(), sharded._rank()
    sharded._prepare_folder(folder, rank, group)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    sharded._save_torch({"optimizer_states": [{"state": {}, "param_groups": groups}]} if rank == 0 else None,
                        folder, rank)
    named = STEP_FOLDER.match(folder.name)
    step = int(named.group(1)) if named else K1
    sharded._save_files(folder, chunks, group, {"step": step, "meta": {}, "layout": {}, "world_size": sharded._world()},
                        None)


def load(folder: Path, par, model, opt) -> None:
    sharded.load_model(folder, model, par)
    sharded.load_optimizer(folder, model, par, opt, sharded.read_trainer_state(folder))


def full(par, model, opt):
    """(weights, AdamW state by name) gathered on rank 0 (None elsewhere), copied: training on changes neither."""
    if par is None:
        names = {id(p): n for n, p in model.named_parameters()}
        weights, state = model.state_dict(), {names[id(p)]: s for p, s in opt.state.items()}
    else:
        weights, state = par.full_state(), par.full_optimizer_state(opt)
    if weights is None:
        return None
    return ({k: v.clone() for k, v in weights.items()},
            {n: {k: torch.as_tensor(v).clone() for k, v in s.items()} for n, s in state.items()})


def compare(a, b) -> dict:
    """Largest differences of weights and AdamW state, and whether every tensor is bitwise equal."""
    (wa, oa), (wb, ob) = a, b
    pairs = {k: (wa[k], wb[k]) for k in wa}
    pairs.update({f"{n}.{k}": (torch.as_tensor(oa[n][k]), torch.as_tensor(ob[n][k])) for n in oa for k in oa[n]})
    diffs = {k: (x.float() - y.float()).abs().max().item() for k, (x, y) in pairs.items()}
    return {"keys": sorted(wa) == sorted(wb) and sorted(oa) == sorted(ob),
            "bitwise": all(torch.equal(x, y) for x, y in pairs.values()),
            "max": max(diffs.values()), "worst": max(diffs, key=diffs.get)}


def reshard_case(src: ParallelPlan, dst: ParallelPlan, folder: Path, out: dict, name: str) -> None:
    xs, ys = data()
    par, model, opt = layout(src)
    train_steps(par, model, opt, xs[:K1], ys[:K1])
    save(folder, par, model, opt)
    saved = full(par, model, opt)
    par2, model2, opt2 = layout(dst)
    load(folder, par2, model2, opt2)
    loaded = full(par2, model2, opt2)
    continued = train_steps(par2, model2, opt2, xs[K1:], ys[K1:])
    after = full(par2, model2, opt2)
    par3, model3, opt3 = layout(dst)
    straight = train_steps(par3, model3, opt3, xs, ys)
    reference = full(par3, model3, opt3)
    if dist.get_rank() == 0:
        out[name] = {"loaded": compare(saved, loaded), "continued": compare(reference, after),
                     "loss": abs(continued[-1] - straight[-1])}
        torch.save(saved, folder.parent / f"{folder.name}.full.pt")  # for a test reading the folder in one process


def worker(rank: int, world: int, port: int, cases: list, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    out = {}
    try:
        for kind, args in cases:
            if kind == "reshard":
                reshard_case(*args, out=out, name=args[-1].name)
            elif kind == "save":  # train and save only: the test reads it into one process
                plan, folder = args
                par, model, opt = layout(plan)
                xs, ys = data()
                train_steps(par, model, opt, xs[:K1], ys[:K1])
                save(folder, par, model, opt)
                saved = full(par, model, opt)
                if rank == 0:
                    torch.save(saved, folder.parent / f"{folder.name}.full.pt")
            elif kind == "load":  # a checkpoint the test wrote in one process, into this layout, and on (against
                # one process trained throughout: tests/parallel/test_mesh_parallel.py bounds this layout against it
                # alike)
                plan, folder = args
                xs, ys = data()
                par, model, opt = layout(plan)
                load(folder, par, model, opt)
                loaded = full(par, model, opt)
                continued = train_steps(par, model, opt, xs[K1:], ys[K1:])
                after = full(par, model, opt)
                if rank == 0:  # the uninterrupted reference: one process, written by the test beside the folder
                    saved = torch.load(folder.parent / f"{folder.name}.full.pt", weights_only=True)
                    reference, straight = torch.load(folder.parent / f"{folder.name}.straight.pt", weights_only=True)
                    out[folder.name] = {"loaded": compare(saved, loaded), "continued": compare(reference, after),
                                        "loss": abs(continued[-1] - straight[-1])}
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.update(out)
