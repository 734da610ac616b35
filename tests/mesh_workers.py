"""Spawned workers for tests/test_mesh_parallel.py: each parallel plan against a single-process reference built from
the same weights, inside one spawn per world size.

Each case returns, from global rank 0, the largest differences it measured; the test asserts them.
"""

import copy
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lit_pretrain.model import GPT
from lit_pretrain.model_config import GPTConfig
from lit_pretrain.optim import build_adamw
from lit_pretrain.parallel.apply import apply_plan
from lit_pretrain.parallel.memory import SavedActivations
from lit_pretrain.parallel.mesh import build_mesh
from lit_pretrain.parallel.plan import ParallelPlan
from lit_pretrain.parallel.tensor import apply_tensor_parallel
from lit_pretrain.schema import OptimConfig

CFG = dict(vocab_size=64, n_layers=4, d_model=32, n_heads=4, d_ff=64, seq_len=16, tie_embeddings=True)
BATCH, STEPS, LR, MAX_NORM = 8, 3, 1e-2, 0.05


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, CFG["vocab_size"], (STEPS, BATCH, CFG["seq_len"]), generator=g)
    return x, torch.roll(x, -1, dims=-1)


def adamw(model):
    # torch's default betas (0.9, 0.999); foreach, the kernel that works on every layout's tensors.
    return build_adamw(model, OptimConfig(lr_peak=LR, weight_decay=0.1, beta2=0.999), kernel="foreach")


def reference(model, xs, ys):
    """One process: losses, pre-clip norms, first-step gradients by name, final weights and AdamW state."""
    opt = adamw(model)
    losses, norms, grads0 = [], [], None
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), MAX_NORM, norm)
        if grads0 is None:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms, grads0, opt


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


def data_parallel_rank(par) -> int:
    """This rank's data-parallel index (replica-major, as MeshStrategy.distributed_sampler_kwargs)."""
    return dist.get_rank(par.replicate) * par.plan.data_parallel_shard + dist.get_rank(par.shard_group)


def run_layout(plan: ParallelPlan, init, xs, ys):
    model = copy.deepcopy(init)
    par = apply_plan(model, plan, build_mesh(plan))
    opt = adamw(model)
    d = plan.data_parallel
    dp_rank = data_parallel_rank(par)
    per = BATCH // d
    losses, norms, grads0 = [], [], None
    for step, (x, y) in enumerate(zip(xs, ys)):
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        opt.zero_grad()
        if par.runner is not None:
            loss = par.runner.loss((x, y))
        else:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            loss = loss.detach()
        par.sync_gradients()
        norm = par.grad_norm()
        torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], MAX_NORM, norm)
        if step == 0:  # every rank gathers (a collective); rank 0 gets the result
            grads0 = par._gather_named({n: p.grad for n, p in model.named_parameters()})
        opt.step()
        for group in (par.replicate, par.shard_group):  # the logged loss: mean over data-parallel ranks
            dist.all_reduce(loss, group=group)
        losses.append(loss.item() / d)
        norms.append(norm.item())
    return par, model, opt, losses, norms, grads0


def dist_broadcast(obj):
    """Rank 0's object on every rank (the gathered state exists on rank 0 only, as a checkpoint file would)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def case(plan: ParallelPlan, out: dict, name: str, variant: dict):
    """`variant`: model keys over CFG (issue 21's variants: n_kv_heads, qk_norm, logit_softcap, norm, mlp)."""
    cfg = GPTConfig(**{**CFG, **variant})
    torch.manual_seed(0)
    init = GPT(cfg)
    xs, ys = data()
    ref_model = copy.deepcopy(init)
    ref_losses, ref_norms, ref_grads, ref_opt = reference(ref_model, xs, ys)
    par, model, opt, losses, norms, grads0 = run_layout(plan, init, xs, ys)
    full = par.full_state()
    full_opt = par.full_optimizer_state(opt)
    # The gathered AdamW state sliced into a fresh optimizer of this layout, and gathered again.
    fresh = adamw(model)
    par.load_full_optimizer_state(fresh, dist_broadcast(full_opt))
    opt_back = par.full_optimizer_state(fresh)
    # Round trip: the reference's (single-process) weights into this layout, and gathered back.
    par.load_full_state(ref_model.state_dict())
    back = par.full_state()
    tp_logits = None
    if par.runner is None:  # the layout's own forward (TP, DP×TP) on the reference weights
        with torch.no_grad():
            tp_logits = model(xs[0])
    if dist.get_rank() != 0:
        return
    ref_names = {id(p): n for n, p in ref_model.named_parameters()}
    ref_state = {ref_names[id(p)]: s for p, s in ref_opt.state.items()}
    loaded = GPT(cfg)
    loaded.load_state_dict(full)
    with torch.no_grad():
        ref_logits = ref_model(xs[0])
        loaded_logits = loaded(xs[0])
    out[name] = {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
        "clipped": min(ref_norms) > MAX_NORM,
        "grad": max_diff(grads0, ref_grads),
        "grad_keys": sorted(grads0) == sorted(ref_grads),
        "weights": max_diff(full, ref_model.state_dict()),
        "keys": list(full) == list(ref_model.state_dict()),
        "exp_avg": max(abs(full_opt[n]["exp_avg"] - s["exp_avg"]).max().item() for n, s in ref_state.items()),
        "exp_avg_sq": max(abs(full_opt[n]["exp_avg_sq"] - s["exp_avg_sq"]).max().item()
                          for n, s in ref_state.items()),
        "opt_steps": {int(s["step"]) for s in full_opt.values()},
        "round_trip": max_diff(back, ref_model.state_dict()),
        "opt_round_trip": max(abs(opt_back[n][k] - v).max().item() for n, s in full_opt.items() for k, v in s.items()),
        "loaded_logits": (loaded_logits - ref_logits).abs().max().item(),
        "layout_logits": None if tp_logits is None else (tp_logits - ref_logits).abs().max().item(),
        "sequence_parallel": any(getattr(m, "sequence_parallel", False) for m in par.gpt.modules()),
    }


def saved_block_bytes(tp_group, sequence_parallel: bool) -> int:
    """Bytes the first block saves for backward on this rank under tensor parallelism over `tp_group`, with or
    without sequence parallelism (collectives inside: every rank of the group calls it)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    apply_tensor_parallel(model, tp_group, sequence_parallel=sequence_parallel)
    h = model.tok_embeddings(data()[0][0])  # (B, T, d), or this rank's (B, T/t, d) under sequence parallelism
    with SavedActivations(model) as meter:
        out = model.blocks[0](h, model.rope_cos, model.rope_sin)
    out.float().pow(2).mean().backward()  # the saved tensors are usable (and released)
    return meter.bytes


def activation_case(out: dict) -> None:
    """TP-only and TP + sequence parallelism, saved bytes per block, over the whole world as the TP group."""
    plan = ParallelPlan(tensor_parallel=dist.get_world_size())
    tp = build_mesh(plan).get_group("tensor_parallel")
    measured = {sp: saved_block_bytes(tp, sp) for sp in (False, True)}
    if dist.get_rank() == 0:
        out["activations"] = {"tp": measured[False], "tp_sp": measured[True],
                              "shape": dict(batch=BATCH, **CFG)}


def worker(rank: int, world: int, port: int, cases: list, results, measure_activations: bool = False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=20))
    out = {}
    try:
        for name, plan, *variant in cases:
            case(plan, out, name, variant[0] if variant else {})
            dist.barrier()
        if measure_activations:
            activation_case(out)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.update(out)
