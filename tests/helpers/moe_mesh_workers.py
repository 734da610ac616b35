"""Spawned workers for tests/parallel/test_moe_mesh.py: model.moe under tensor (and sequence), pipeline parallelism and
HSDP against one process, through tests/helpers/mesh_workers.py's `case` with training loops that add what an MoE step
adds: `moe.moe_loss` to the loss (under pipeline parallelism the schedule's backward trains it, parallel/moe_mesh.py),
and `moe.end_step` after the optimizer step, with the routing counts summed over the data-parallel (and
context-parallel) ranks only.

Each loop also records, per step and MoE layer, the statistics `end_step` kept (tokens per expert, dropped, total,
auxiliary and z losses, forwards) and the balancing bias; the case compares them with one process's.
"""

import copy
import os
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.model.moe import end_step, moe_layers, moe_loss
from lit_pretrain.optim.optimizers import clip_by_global_norm
from lit_pretrain.parallel.apply import apply_plan
from lit_pretrain.parallel.mesh import build_mesh, local
from lit_pretrain.parallel.moe_mesh import data_parallel_sum
from lit_pretrain.parallel.tensor import plain_name, style_of
from lit_pretrain.planning.plan import ParallelPlan
from tests.helpers.mesh_workers import BATCH, CFG, MAX_NORM, adamw, case, data, data_parallel_rank, layout_loss

_RECORDED: dict = {}  # "reference" / "layout" -> [per step: {layer: (stats, bias)}]


def record(model, key: str) -> None:
    _RECORDED.setdefault(key, []).append(
        {m.layer: (m.step_stats.clone(), None if m.expert_bias is None else m.expert_bias.clone())
         for m in moe_layers(model)})


def moe_reference(model, xs, ys, make_opt=adamw, micro: int = 1):
    """One process, as mesh_workers.reference plus the MoE losses and bias update; `micro` > 1: each batch as that
    many micro-batches accumulated (the pipeline's split), each with its own auxiliary loss."""
    opt = make_opt(model)
    losses, norms, grads0 = [], [], None
    _RECORDED["reference"] = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        task = 0.0
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            ce = F.cross_entropy(model(xm).flatten(0, 1), ym.flatten())
            balance = moe_loss(model)
            ((ce if balance is None else ce + balance) / micro).backward()
            task += ce.item() / micro
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), MAX_NORM, norm)
        if grads0 is None:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        end_step(model)
        record(model, "reference")
        losses.append(task)
        norms.append(norm.item())
    return losses, norms, grads0, opt


def moe_run_layout(plan: ParallelPlan, init, xs, ys, make_opt=None):
    """mesh_workers.run_layout plus the MoE losses (outside the pipeline) and the bias update with the counts
    summed over the data-parallel groups (what MeshStrategy.data_parallel_sum does)."""
    model = copy.deepcopy(init)
    par = apply_plan(model, plan, build_mesh(plan))
    opt = adamw(model)
    d, dp_rank = plan.data_parallel, data_parallel_rank(par)
    per = BATCH // d
    losses, norms, grads0 = [], [], None
    _RECORDED["layout"] = []
    for step, (x, y) in enumerate(zip(xs, ys)):
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        opt.zero_grad()
        if par.runner is not None:
            loss = par.runner.loss((x, y))  # the MoE losses train inside the schedule's backward
        else:
            # logits: this rank's columns (of its positions under context parallelism)
            loss = layout_loss(par, model, x, y)
            balance = moe_loss(model)
            (loss if balance is None else loss + balance).backward()
            loss = loss.detach()
        par.sync_gradients()
        norm = par.grad_norm()
        # by device mesh: FSDP2 shards the experts under expert parallelism over a mesh of their own
        clip_by_global_norm([p for p in model.parameters() if p.grad is not None], MAX_NORM, norm)
        if step == 0:
            # Single-process names (activation checkpointing's wrapper prefixes the parameters' names).
            grads0 = par._gather_named({plain_name(n): p.grad for n, p in model.named_parameters()})
        opt.step()
        end_step(model, lambda t: data_parallel_sum(t, [par.replicate, par.shard_group, par.cp_group]))
        record(model, "layout")
        for group in (par.replicate, par.shard_group):
            dist.all_reduce(loss, group=group)
        losses.append(loss.item() / d)
        norms.append(norm.item())
    _RECORDED["replicas_equal"] = replicas_equal(par, model)
    _RECORDED["expert_shapes"] = expert_shapes(par)
    return par, model, opt, losses, norms, grads0


def expert_shapes(par) -> set:
    """The shapes of the routed experts' stacks this rank holds, as tensor and expert parallelism leave them (an FSDP2
    shard's global shape: its split of dim 0 is ZeRO's, counted apart)."""
    return {tuple(linear.weight.shape) for layer in moe_layers(par.gpt) for linear in layer.experts.values()}


def replicas_equal(par, model) -> bool:
    """Whether every parameter replicated over the tensor-parallel group (router, norms)
    holds the same values on all its ranks, bitwise, after training: their gradients agreed at every step."""
    same = torch.ones(())
    for name, p in model.named_parameters():
        if style_of(name, par.tp_plan) is None:
            t = local(p.detach())
            hi, lo = t.clone(), t.clone()
            dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=par.tp)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=par.tp)
            same = torch.minimum(same, torch.tensor(float(torch.equal(hi, lo))))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)  # over the world: every rank's verdict
    return bool(same)


def router_grad(cfg: GPTConfig, micro: int, layer: int):
    """One process's first-step gradient of block `layer`'s router, `micro` micro-batches accumulated, as the step
    clips it (by MAX_NORM over the whole gradient's norm, as the cases' first-step gradients are)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = (t[0] for t in data())
    for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
        ce = F.cross_entropy(model(xm).flatten(0, 1), ym.flatten())
        balance = moe_loss(model)
        ((ce if balance is None else ce + balance) / micro).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    return model.blocks[layer].mlp.router.weight.grad * min(1.0, MAX_NORM / norm.item())


def moe_case(plan: ParallelPlan, out: dict, name: str, variant: dict):
    """mesh_workers.case with the MoE loops, then the routing statistics and biases against one process's.
    variant: model keys over CFG with `moe` (MoEConfig fields); `micro_reference`: the reference's micro-batches."""
    variant = dict(variant)
    micro = variant.pop("micro_reference", 1)
    case(plan, out, name, variant, train=(partial(moe_reference, micro=micro), moe_run_layout))
    # Every rank's layers, per step: a layer lives on one pipeline stage and on every tensor- and data-parallel
    # rank of it, whose copies must agree bit for bit.
    parts, shapes = [None] * dist.get_world_size(), [None] * dist.get_world_size()
    dist.all_gather_object(parts, _RECORDED["layout"])
    dist.all_gather_object(shapes, _RECORDED["expert_shapes"])
    if dist.get_rank() != 0:
        return
    ref = _RECORDED["reference"]
    cfg = GPTConfig(**{**CFG, **variant})
    E = cfg.moe.num_experts
    counts = stats_z = bias = 0.0
    consistent, seen = True, set()
    for step, ref_step in enumerate(ref):
        for rank_steps in parts:
            for layer, (stats, b) in rank_steps[step].items():
                seen.add(layer)
                holder = next(p[step][layer] for p in parts if layer in p[step])  # the first rank holding it
                consistent &= torch.equal(stats, holder[0]) and (b is None or torch.equal(b, holder[1]))
                r_stats, r_bias = ref_step[layer]
                counts = max(counts, (stats[:E + 2] - r_stats[:E + 2]).abs().max().item())
                # The z-loss's mean over the step's forwards (moe.step_statistics): one forward in one process, m
                # under the pipeline, whose mean of equal-sized micro-batches' means is the batch's mean.
                stats_z = max(stats_z, abs(stats[E + 3] / stats[E + 4] - r_stats[E + 3] / r_stats[E + 4]).item())
                if b is not None:
                    bias = max(bias, (b - r_bias).abs().max().item())
    r = out[name]
    r.update(counts=counts, z_stat=stats_z, bias=bias, stats_consistent=consistent,
             replicas_equal=_RECORDED["replicas_equal"], expert_shapes=shapes,
             tensor_parallel=plan.tensor_parallel, expert_parallel=plan.expert_parallel,
             layers_seen=sorted(seen) == cfg.moe_layers(), bias_on=cfg.moe.bias_update_rate > 0)
    if micro > 1:  # the auxiliary loss's own share of the first MoE router's gradient, in one process
        no_aux = GPTConfig(**{**CFG, **variant, "moe": {**variant["moe"], "aux_loss": 0.0}})
        layer = cfg.moe_layers()[0]  # block 0: always on the first stage
        with_aux = router_grad(cfg, micro, layer)
        r["aux_effect"] = (with_aux - router_grad(no_aux, micro, layer)).abs().max().item()
        r["router_grad_scale"] = with_aux.abs().max().item()


def planner_case(out: dict) -> None:
    """One MoE block (a shared expert) under tensor parallelism over the whole world, with and without sequence
    parallelism: its parameters on this rank and the bytes it saves for backward, against the memory planner."""
    from lit_pretrain.parallel.activation_checkpointing import apply_activation_checkpointing
    from lit_pretrain.parallel.expert_tensor import apply_expert_tensor_parallel
    from lit_pretrain.parallel.memory import SavedActivations
    from lit_pretrain.parallel.tensor import apply_tensor_parallel
    from lit_pretrain.planning.memory import block_activation_bytes, memory_plan
    from lit_pretrain.planning.recompute import selective_block_bytes

    t = dist.get_world_size()
    tp = build_mesh(ParallelPlan(tensor_parallel=t)).get_group("tensor_parallel")
    moe = dict(num_experts=4, top_k=2, d_ff_expert=32, num_shared_experts=1)
    cfg = GPTConfig(**{**CFG, "n_layers": 1, "moe": moe})
    x = data()[0][0]
    B, T = x.shape
    def run(sp: bool, mode: str):
        torch.manual_seed(0)
        model = GPT(cfg)
        apply_tensor_parallel(model, tp, sequence_parallel=sp)
        apply_expert_tensor_parallel(model, tp)  # the routed experts too, as apply_plan does
        apply_activation_checkpointing(model, mode)
        block = model.blocks[0]
        h = model.tok_embeddings(x)  # (B, T, d), or this rank's (B, T/t, d) under sequence parallelism
        with SavedActivations(model) as meter:
            y = block(h, model.rope_cos, model.rope_sin)
        y.square().mean().backward()  # selective: the recomputation's collectives and routing under TP
        counts = block.mlp.load[:4]  # this forward's assignments per expert: the whole micro-batch's
        grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
        return meter.bytes, counts, grads, block

    measured, selective = {}, {}
    for sp in (False, True):
        saved, counts, grads, block = run(sp, "none")
        planned = block_activation_bytes(T, B, cfg.d_model, cfg.n_heads, cfg.hidden_dim, t, sp, moe=(4, 2, 32, 1))
        measured[sp] = (saved, planned, counts.sum().item())
        # strategy.activation_checkpointing=selective on this MoE block under TP (and SP): bytes kept against the
        # planner's selective row, and gradients and counts bit-identical to none's (the same kernels and
        # collectives on the same inputs; the routing from the kept top-k)
        kept, sel_counts, sel_grads, _ = run(sp, "selective")
        planned = selective_block_bytes(T, B, cfg.d_model, cfg.n_heads, cfg.hidden_dim, t, sp, kv_heads=cfg.kv_heads,
                                        mlp=cfg.mlp, moe=(4, 2, 32, 1))
        same = torch.equal(sel_counts, counts) and all(  # None: the head and final norm, outside the block
            (g is None) == (grads[n] is None) and (g is None or torch.equal(g, grads[n])) for n, g in sel_grads.items())
        selective[sp] = (kept, planned, same)
    # Context parallelism over the same 2 ranks: one MoE block on this rank's T/c positions (parallel/context.py),
    # its RoPE tables at those positions, against the planner's block, tables and CPU causal mask.
    from lit_pretrain.parallel.context import install_context_parallel
    from lit_pretrain.planning.memory import context_forward_bytes, context_mask_bytes

    torch.manual_seed(0)
    model = GPT(cfg)
    cp = install_context_parallel(model, dist.group.WORLD)
    part = cp.positions(T)
    with SavedActivations(model) as meter:
        model.blocks[0](model.tok_embeddings(x[:, part]), model.rope_cos[part], model.rope_sin[part])
    cp_planned = (block_activation_bytes(T, B, cfg.d_model, cfg.n_heads, cfg.hidden_dim, moe=(4, 2, 32, 1),
                                         context_parallel=t)
                  + context_forward_bytes(T, B, cfg.head_dim, t) + context_mask_bytes(T, t))
    context = (meter.bytes, cp_planned, model.blocks[0].mlp.load[:4].sum().item())
    plan = memory_plan(ParallelPlan(tensor_parallel=t), cfg, B, precision="32-true")
    # The planner's per-rank count: one block, the embedding (vocab-parallel in its accounting) and the final norm.
    planned_block = plan["params_per_device"] - cfg.vocab_size * cfg.d_model / t - cfg.d_model
    if dist.get_rank() == 0:
        out["planner"] = {"saved": measured, "selective": selective,
                          "block_params": sum(p.numel() for p in block.parameters()),
                          "planned_block_params": planned_block, "tokens": B * T, "context": context}


def moe_worker(rank: int, world: int, port: int, cases: list, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    out = {}
    try:
        for name, plan, variant in cases:
            moe_case(plan, out, name, variant)
            dist.barrier()
        if world == 2:
            planner_case(out)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.update(out)
