"""Spawned workers for tests/parallel/test_mesh_parallel.py: each parallel plan against a single-process reference built
from the same weights, inside one spawn per world size.

Each case returns, from global rank 0, the largest differences it measured; the test asserts them.
"""

import contextlib
import copy
import dataclasses
import functools
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT, document_ids
from lit_pretrain.model.losses import IGNORE_INDEX, lm_losses
from lit_pretrain.optim.optimizers import build_adamw, build_optimizer, clip_by_global_norm
from lit_pretrain.parallel.apply import apply_plan
from lit_pretrain.parallel.context import context_losses
from lit_pretrain.parallel.memory import SavedActivations
from lit_pretrain.parallel.mesh import build_mesh, like
from lit_pretrain.parallel.tensor import apply_tensor_parallel, plain_name, shard, style_of
from lit_pretrain.parallel.vocab import split_cross_entropy, whole_logits
from lit_pretrain.planning.plan import ParallelPlan
from lit_pretrain.schema import Float8Config, OptimConfig

CFG = dict(vocab_size=64, n_layers=4, d_model=32, n_heads=4, d_ff=64, seq_len=16, tie_embeddings=True)
BATCH, STEPS, LR, MAX_NORM = 8, 3, 1e-2, 0.05


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, CFG["vocab_size"], (STEPS, BATCH, CFG["seq_len"]), generator=g)
    return x, torch.roll(x, -1, dims=-1)


def adamw(model, zero_stage=None):
    # torch's default betas (0.9, 0.999); foreach, the kernel that works on every layout's tensors. zero_stage=1:
    # inside ZeroRedundancyOptimizer, as the module builds it (optim.build_optimizer).
    return build_adamw(model, OptimConfig(lr_peak=LR, weight_decay=0.1, beta2=0.999), zero_stage, kernel="foreach")


def reference(model, xs, ys, make_opt=adamw, eod_id=None):
    """One process: losses, pre-clip norms, first-step gradients by name, final weights and optimizer state.
    eod_id: document masking (ys then hold IGNORE_INDEX after each EOD, `with_documents`)."""
    opt = make_opt(model)
    losses, norms, grads0 = [], [], None
    for x, y in zip(xs, ys):
        opt.zero_grad()
        logits = model(x) if eod_id is None else model(x, document_ids=document_ids(x, eod_id))
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), MAX_NORM, norm)
        if grads0 is None:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms, grads0, opt


def float8_reference(model, xs, ys, make_opt=adamw, f8=None):
    """`reference` with the model's linears converted as apply_plan converts them (trainer.float8, `f8`)."""
    from lit_pretrain.parallel.float8 import convert_float8

    convert_float8(model, f8)
    return reference(model, xs, ys, make_opt)


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


def data_parallel_rank(par) -> int:
    """This rank's data-parallel index (replica-major, as MeshStrategy.distributed_sampler_kwargs)."""
    return dist.get_rank(par.replicate) * par.plan.data_parallel_shard + dist.get_rank(par.shard_group)


def with_documents(xs, eod_id: int):
    """xs with EODs planted at positions 2, 6 and 11 of every window, so documents cross the chunk edges of
    context parallelism 2 (4, 8, 12) and 4 (2, 4, 6, ...); targets rolled and masked after each EOD, as
    module.loss_targets does."""
    xs = xs.clone()
    xs[..., [2, 6, 11]] = eod_id
    ys = torch.roll(xs, -1, dims=-1).masked_fill(xs == eod_id, IGNORE_INDEX)
    return xs, ys


def run_layout(plan: ParallelPlan, init, xs, ys, make_opt=None, eod_id=None):
    """`make_opt(model, par)`: the layout's optimizer (default: adamw, at the plan's ZeRO stage). eod_id: document
    masking."""
    model = copy.deepcopy(init)
    par = apply_plan(model, plan, build_mesh(plan))
    opt = make_opt(model, par) if make_opt else adamw(model, plan.zero_stage)
    d = plan.data_parallel
    dp_rank = data_parallel_rank(par)
    per = BATCH // d
    losses, norms, grads0 = [], [], None
    for step, (x, y) in enumerate(zip(xs, ys)):
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        opt.zero_grad()
        if par.runner is not None:
            loss = par.runner.loss((x, y))
        else:  # under tensor parallelism the logits are this rank's vocabulary columns (parallel/vocab.py)
            loss = layout_loss(par, model, x, y, None if eod_id is None else document_ids(x, eod_id))
            loss.backward()
            loss = loss.detach()
        par.sync_gradients()
        norm = par.grad_norm()
        clip_by_global_norm(model.parameters(), MAX_NORM, norm)
        if step == 0:  # every rank gathers (a collective); rank 0 gets the result
            grads0 = par._gather_named({plain_name(n): p.grad for n, p in model.named_parameters()})
        opt.step()
        for group in (par.replicate, par.shard_group):  # the logged loss: mean over data-parallel ranks
            dist.all_reduce(loss, group=group)
        losses.append(loss.item() / d)
        norms.append(norm.item())
    return par, model, opt, losses, norms, grads0


def layout_loss(par, model, x, y, docs=None):
    """The task loss of this layout's forward: under context parallelism of this rank's positions, normalized over
    the group (parallel/context.py), else lm_losses."""
    logits = model(x) if docs is None else model(x, document_ids=docs)
    split = split_cross_entropy(par.vocab_group)
    if par.cp is not None:
        return context_losses(logits, par.cp.local(y), par.cp.group, split_cross_entropy=split)[0]
    return lm_losses(logits, y, split_cross_entropy=split)[0]


def dist_broadcast(obj):
    """Rank 0's object on every rank (the gathered state exists on rank 0 only, as a checkpoint file would)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def case(plan: ParallelPlan, out: dict, name: str, variant: dict, train=None):
    """`variant`: model keys over CFG (the architecture variants: n_kv_heads, qk_norm, logit_softcap, norm, mlp; `moe`
    as a dict of MoEConfig fields). `train`: the (reference, run_layout) loops to use instead of this module's
    (tests/helpers/moe_mesh_workers.py adds model.moe's losses and bias update)."""
    train_reference, train_layout = train or (reference, run_layout)
    variant = dict(variant)
    eod = variant.pop("eod_id", None)  # document masking, with documents across chunk edges (with_documents)
    masking = {} if eod is None else {"eod_id": eod}
    cfg = GPTConfig(**{**CFG, **variant})
    torch.manual_seed(0)
    init = GPT(cfg)
    xs, ys = data() if eod is None else with_documents(data()[0], eod)
    ref_model = copy.deepcopy(init)
    ref_losses, ref_norms, ref_grads, ref_opt = train_reference(ref_model, xs, ys, **masking)
    par, model, opt, losses, norms, grads0 = train_layout(plan, init, xs, ys, **masking)
    # Cloned: where gathering is the identity (replicated tensors: DDP, norms under tensor parallelism) the gathered
    # state holds the live weights, which load_full_state below overwrites with the reference's: the comparison
    # of `full` with the reference would then compare the reference with itself.
    full = clone(par.full_state())
    full_opt = clone(par.full_optimizer_state(opt))
    # The gathered AdamW state sliced into a fresh optimizer of this layout, and gathered again.
    fresh = adamw(model, plan.zero_stage)
    par.load_full_optimizer_state(fresh, dist_broadcast(full_opt))
    opt_back = par.full_optimizer_state(fresh)
    # Round trip: the reference's (single-process) weights into this layout, and gathered back.
    par.load_full_state(ref_model.state_dict())
    back = par.full_state()
    tp_logits = None
    if par.runner is None:  # the layout's own forward (TP, DP×TP) on the reference weights
        with torch.no_grad():
            tp_logits = model(xs[0])  # (B, T, V/t) under tensor parallelism: this rank's vocabulary columns
            if par.vocab_group is not None:
                tp_logits = whole_logits(tp_logits, par.vocab_group)
    part = None if par.cp is None else par.cp.positions(xs.shape[-1])  # rank 0's positions under context parallelism
    rows = vocab_rows(model)
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
        "layout_logits": None if tp_logits is None else (tp_logits - (ref_logits if part is None else
                                                                       ref_logits[:, part])).abs().max().item(),
        "sequence_parallel": any(getattr(m, "sequence_parallel", False) for m in par.gpt.modules()),
        "vocab_rows": rows, "t": par.t,
    }


def vocab_rows(model) -> list:
    """(module, rows, vocab-parallel) of the embedding and head on every rank that holds them, gathered to every
    rank (an object gather over the world: a collective)."""
    held = [(name, module.weight.shape[0], getattr(module, "tensor_parallel", None) == "vocab"
             and hasattr(module, "group")) for name in ("tok_embeddings", "lm_head")
            if (module := getattr(model, name, None)) is not None]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, held)
    return [h for rank in out for h in rank]


def vocab_cross_entropy_case(out: dict) -> None:
    """losses.lm_losses over logits split along the vocabulary across the world (as the tensor-parallel group)
    against the whole logits' F.cross_entropy path: task loss, z-loss, and the logits' gradient, with ignored
    targets, targets on every rank, and a batch that predicts nothing."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(11)
    V = 16 * world
    logits = torch.randn(3, 5, V, generator=g) * 3  # (B, T, V): spread, so the softmax is far from uniform
    targets = torch.randint(0, V, (3, 5), generator=g)
    targets[0, :2] = targets[2, 4] = IGNORE_INDEX
    ref = logits.clone().requires_grad_(True)
    task, z = lm_losses(ref, targets, 1e-2)
    (task + z).backward()
    part = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    group = dist.group.WORLD
    p_task, p_z = lm_losses(part, targets, 1e-2, split_cross_entropy(group))
    (p_task + p_z).backward()
    grad = whole_logits(part.grad, group)
    none = lm_losses(part, torch.full_like(targets, IGNORE_INDEX), 1e-2, split_cross_entropy(group))
    if rank == 0:
        out["vocab_ce"] = {"task": (p_task - task).abs().item(), "z": (p_z - z).abs().item(),
                           "grad": (grad - ref.grad).abs().max().item(), "grad_scale": ref.grad.abs().max().item(),
                           "none": [none[0].isnan().item(), none[1].item()],
                           "ref_none": lm_losses(logits, torch.full_like(targets, IGNORE_INDEX))[0].isnan().item()}


def saved_block_bytes(tp_group, sequence_parallel: bool, checkpointing: str = "none") -> int:
    """Bytes the first block saves for backward on this rank under tensor parallelism over `tp_group`, with or
    without sequence parallelism (collectives inside: every rank of the group calls it), under
    strategy.activation_checkpointing=`checkpointing` (applied after tensor parallelism, as apply_plan does)."""
    from lit_pretrain.parallel.activation_checkpointing import apply_activation_checkpointing

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    apply_tensor_parallel(model, tp_group, sequence_parallel=sequence_parallel)
    apply_activation_checkpointing(model, checkpointing)
    h = model.tok_embeddings(data()[0][0])  # (B, T, d), or this rank's (B, T/t, d) under sequence parallelism
    with SavedActivations(model) as meter:
        out = model.blocks[0](h, model.rope_cos, model.rope_sin)
    out.float().pow(2).mean().backward()  # the saved tensors are usable (and released)
    return meter.bytes


def saved_context_block_bytes(group) -> int:
    """Bytes the first block saves for backward on this rank under context parallelism over `group`, its RoPE
    tables at this rank's positions included (as GPT.forward passes them)."""
    from lit_pretrain.parallel.context import install_context_parallel

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    cp = install_context_parallel(model, group)
    part = cp.positions(CFG["seq_len"])
    h = model.tok_embeddings(data()[0][0][:, part])  # (B, T/c, d)
    with SavedActivations(model) as meter:
        out = model.blocks[0](h, model.rope_cos[part], model.rope_sin[part])
    out.float().pow(2).mean().backward()
    return meter.bytes


def activation_case(out: dict) -> None:
    """TP-only and TP + sequence parallelism, saved bytes per block, over the whole world as the TP group; and
    context parallelism over the whole world."""
    plan = ParallelPlan(tensor_parallel=dist.get_world_size())
    tp = build_mesh(plan).get_group("tensor_parallel")
    measured = {sp: saved_block_bytes(tp, sp) for sp in (False, True)}
    selective = {sp: saved_block_bytes(tp, sp, "selective") for sp in (False, True)}
    context = saved_context_block_bytes(dist.group.WORLD)
    if dist.get_rank() == 0:
        out["activations"] = {"tp": measured[False], "tp_sp": measured[True], "selective_tp": selective[False],
                              "selective_tp_sp": selective[True], "cp": context, "c": dist.get_world_size(),
                              "shape": dict(batch=BATCH, **CFG)}


MUON = OptimConfig(name="muon", lr_peak=LR, weight_decay=0.1, beta2=0.999)


def muon(model, par=None, zero_stage=None):
    # optim.name=muon as the module builds it: the layout given, for Muon's whole-matrix gather where it shards.
    return build_optimizer(model, MUON, zero_stage, kernel="foreach", layout=par)


def named_state(par, opt, zero_stage):
    """The whole optimizer state by single-process name on rank 0 (None elsewhere): ParallelModel's gather, or, for
    ZeRO-1, ZeroRedundancyOptimizer's own consolidation (what Lightning's DDPStrategy saves)."""
    if zero_stage != 1:
        return par.full_optimizer_state(opt)
    opt.consolidate_state_dict(to=0)
    if dist.get_rank() != 0:
        return None
    names = {id(p): n for n, p in par.gpt.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    return {order[i]: s for i, s in opt.state_dict()["state"].items()}


_MUON_REFERENCE: list = []


def clone(tree):
    """A deep copy of a state (None on ranks that hold none): gathered states on one process share storage with
    the live weights and optimizer state, which the rest of a case goes on to change."""
    return copy.deepcopy(tree)


def muon_case(plan: ParallelPlan, out: dict, name: str, zero_stage=None):
    """optim.name=muon under `plan` (ZeRO-1 when zero_stage=1) against one process running torch.optim.Muon.

    Training: K steps with clipping, as `case`. Then the step alone: the one-process weights and optimizer state
    loaded into the layout (the one-file checkpoint's path), the same whole gradient given to both (sliced into
    the layout), one step each: the same bf16 Newton-Schulz on the same whole matrices."""
    if not _MUON_REFERENCE:  # the same for every muon case of a spawn: trained once per process
        torch.manual_seed(0)
        init = GPT(GPTConfig(**CFG))
        ref_model = copy.deepcopy(init)
        ref_losses, _, _, ref_opt = reference(ref_model, *data(), muon)
        _MUON_REFERENCE.extend([init, ref_model, ref_losses, clone(ref_opt.state_dict())])
    init, ref_model, ref_losses, ref_saved = clone(_MUON_REFERENCE)
    ref_opt = muon(ref_model)
    ref_opt.load_state_dict(ref_saved)
    xs, ys = data()
    par, model, opt, losses, _, _ = run_layout(plan, init, xs, ys, lambda m, p: muon(m, p, zero_stage))
    trained, trained_opt = clone(par.full_state()), clone(named_state(par, opt, zero_stage))
    ref_names = {id(p): n for n, p in ref_model.named_parameters()}
    ref_state = {ref_names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in ref_opt.state.items()}
    ref_trained = {k: v.clone() for k, v in ref_model.state_dict().items()}
    # Same weights, state and whole gradients on both sides.
    par.load_full_state(ref_model.state_dict())
    if zero_stage == 1:
        # Single-process indices are ZeRO's too (the same groups, the same order); cloned, as a file would be:
        # state_dict() holds the reference's live tensors, which its own step would then move.
        opt.load_state_dict(dist_broadcast(clone(ref_opt.state_dict())))
    else:
        par.load_full_optimizer_state(opt, ref_state)
    g = torch.Generator().manual_seed(5)
    grads = {n: torch.randn(p.shape, generator=g) * 1e-2 for n, p in ref_model.named_parameters()}
    for n, p in ref_model.named_parameters():
        p.grad = grads[n].clone()
    ref_opt.step()
    for n, p in model.named_parameters():
        n = plain_name(n)
        p.grad = like(shard(grads[n], style_of(n, par.tp_plan), par.tp_rank, par.t), p).clone()
    opt.step()
    stepped, stepped_opt = par.full_state(), named_state(par, opt, zero_stage)
    if dist.get_rank() != 0:
        return
    ref_after = {ref_names[id(p)]: s for p, s in ref_opt.state.items()}
    muon_names = {n for n, p in ref_model.named_parameters() if "momentum_buffer" in ref_after[n]}

    def state_diff(a, b):
        return max((a[n][k] - v).abs().max().item() for n, s in b.items() for k, v in s.items())

    out[name] = {
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "weights": max_diff(trained, ref_trained),
        "trained_keys": sorted(trained_opt) == sorted(ref_state)
        and all(trained_opt[n].keys() == ref_state[n].keys() for n in ref_state),
        "momentum": max((trained_opt[n]["momentum_buffer"] - ref_state[n]["momentum_buffer"]).abs().max().item()
                        for n in muon_names),
        "muon_matrices": len(muon_names),
        "step_weights": max_diff(stepped, ref_model.state_dict()),
        "step_state": state_diff(stepped_opt, ref_after),
    }


def hsdp_policy_case(out: dict) -> None:
    """HSDP 2 x 2 at ZeRO-3 with FSDP2's mixed-precision policy (strategy.mixed_precision_policy) against without:
    one AdamW step after a first, the bytes of each kind of collective (the bench's counter), and the dtypes."""
    from lit_pretrain.bench.parallel.compositions import CountCollectives
    from lit_pretrain.optim.optimizers import build_adamw

    xs, ys = data()
    counted = {}
    for policy in (False, True):
        plan = ParallelPlan(data_parallel_replicate=2, data_parallel_shard=2, zero_stage=3,
                            mixed_precision_policy=policy)
        torch.manual_seed(0)
        model = GPT(GPTConfig(**CFG))
        par = apply_plan(model, plan, build_mesh(plan))
        opt = build_adamw(model, OptimConfig(), kernel="foreach")
        dtypes = set()
        model.blocks[0].attn.wq.register_forward_hook(lambda m, i, o, seen=dtypes: seen.add(str(o.dtype)))
        per = BATCH // 4
        rank = data_parallel_rank(par)
        x, y = xs[0][rank * per:(rank + 1) * per], ys[0][rank * per:(rank + 1) * per]
        for step in range(2):
            with CountCollectives() if step else contextlib.nullcontext() as counter:
                opt.zero_grad()
                F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
                par.sync_gradients()
                opt.step()
        counted[policy] = {"bytes": dict(counter.bytes), "matmul": sorted(dtypes),
                           "master": sorted({str(p.dtype) for p in model.parameters()} |
                                            {str(p.grad.dtype) for p in model.parameters()})}
    out["hsdp_policy"] = counted


def worker(rank: int, world: int, port: int, cases: list, results, measure_activations: bool = False,
           hsdp_policy: bool = False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=20))
    out = {}
    try:
        for name, plan, *variant in cases:
            variant = variant[0] if variant else {}
            if variant.get("optim") == "muon":
                muon_case(plan, out, name, variant.get("zero_stage"))
            elif "float8" in variant:  # against one process converted the same way
                f8 = Float8Config(**variant["float8"])
                rest = {k: v for k, v in variant.items() if k != "float8"}
                case(dataclasses.replace(plan, float8=f8), out, name, rest,
                     train=(functools.partial(float8_reference, f8=f8), run_layout))
            else:
                case(plan, out, name, variant)
            dist.barrier()
        if measure_activations:
            activation_case(out)
            vocab_cross_entropy_case(out)
        if hsdp_policy:
            hsdp_policy_case(out)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.update(out)
