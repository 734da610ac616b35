"""Cases (`--cases long_context`): context parallelism 2 (parallel/context.py) against one process on the same
global tokens, one window of SEQ_LEN positions a step, the experiment's model otherwise.

- tokens/s: 2 ranks x 1 thread, each computing half of the window and all-gathering the keys and values, against one
  process with both threads on the whole window; alternated REPEATS times (bench/stats.py). On 2 cores this reports
  what the split and its communication cost, not a speed-up (there are no more cores to spread over).
- saved activation bytes of the blocks per rank (parallel/memory.py SavedActivations over every block's forward,
  the RoPE tables at the rank's positions and the CPU's causal mask included) against one process's: the goal
  about 0.5, above it by the gathered keys and values; and against the planner (planning/memory.py
  block_activation_bytes x n_layers + context_forward_bytes + context_mask_bytes), within 1%.
- bytes per step by collective (bench/parallel/compositions.py's counter) against planning/communication.py:
  `context_parallel` (the keys' and values' all-gather and reduce-scatter, the loss's sums) plus the gradients'
  all-reduce over the group.
"""

import copy
import os
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lit_pretrain.bench import stats
from lit_pretrain.bench.parallel.compositions import CountCollectives, _free_port, _timed

WORLD, SEQ_LEN, STEPS, SKIP = 2, 4096, 2, 1
REPEATS = 3  # a one-process step of 4096 positions takes ~13 s here: 3 alternations keep the group near 2 minutes


def _window(c, T: int):
    g = torch.Generator().manual_seed(c.run.seed)
    w = torch.randint(0, c.model.vocab_size, (1, T + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def _blocks_saved(model, x, part=None) -> int:
    """Bytes every block's forward saves for backward on this rank (the blocks only: embedding and head apart)."""
    from lit_pretrain.parallel.memory import SavedActivations

    cos, sin = (model.rope_cos, model.rope_sin) if part is None else (model.rope_cos[part], model.rope_sin[part])
    # not detached: the first block's input requires grad as in training (its norm then keeps x and rsqrt too)
    h = model.tok_embeddings(x if part is None else x[:, part])
    with SavedActivations(model) as meter:
        for block in model.blocks:
            h = block(h, cos, sin)
    h.float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return meter.bytes


def _worker(rank: int, port: int, c, results) -> None:
    from lit_pretrain.model.gpt import GPT
    from lit_pretrain.optim.optimizers import build_adamw
    from lit_pretrain.parallel.apply import apply_plan
    from lit_pretrain.parallel.context import context_losses
    from lit_pretrain.parallel.mesh import build_mesh
    from lit_pretrain.planning.plan import ParallelPlan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    cfg = replace(c.model, seq_len=SEQ_LEN)
    max_norm = c.optim.grad_clip_norm or 1.0
    torch.manual_seed(c.run.seed)
    base = GPT(cfg)
    x, y = _window(c, SEQ_LEN)
    plan = ParallelPlan(context_parallel=WORLD)
    model = copy.deepcopy(base)
    par = apply_plan(model, plan, build_mesh(plan))
    opt = build_adamw(model, c.optim, kernel="foreach")

    def cp_step():
        opt.zero_grad()
        context_losses(model(x), par.cp.local(y), par.cp.group)[0].backward()
        par.sync_gradients()
        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), max_norm, par.grad_norm())
        opt.step()

    if rank == 0:
        ref = copy.deepcopy(base)
        ref_opt = build_adamw(ref, c.optim, kernel="foreach")

        def ref_step():
            ref_opt.zero_grad()
            F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
            norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
            torch.nn.utils.clip_grads_with_norm_(list(ref.parameters()), max_norm, norm)
            ref_opt.step()

    seconds = {"single": [], "cp2": []}
    try:
        for _ in range(REPEATS):
            if rank == 0:  # rank 0 alone with both threads; the other waits in the barrier
                torch.set_num_threads(2)
                seconds["single"].append(_timed(ref_step, STEPS, SKIP))
                torch.set_num_threads(1)
            dist.barrier()
            seconds["cp2"].append(_timed(cp_step, STEPS, SKIP))
            dist.barrier()
        with CountCollectives() as counter:
            cp_step()
        comm = {"bytes": dict(counter.bytes), "calls": dict(counter.calls)}
        saved = torch.tensor([_blocks_saved(model, x, par.cp.positions(SEQ_LEN))], dtype=torch.float64)
        dist.all_reduce(saved, op=dist.ReduceOp.MAX)  # the most loaded rank (rank 0: the largest causal mask)
        single_saved = _blocks_saved(copy.deepcopy(base), x) if rank == 0 else 0
        params = sum(p.numel() for p in base.parameters())
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.update({"seconds": seconds, "comm": comm, "saved": float(saved), "single_saved": single_saved,
                        "params": params})


def planned(cfg, c: int) -> dict:
    """The planner's figures for one window of cfg.seq_len on c context-parallel ranks (fp32)."""
    from lit_pretrain.planning import communication as cm
    from lit_pretrain.planning.memory import block_activation_bytes, context_forward_bytes, context_mask_bytes

    def blocks(context: int) -> float:
        return cfg.n_layers * block_activation_bytes(
            cfg.seq_len, 1, cfg.d_model, cfg.n_heads, cfg.hidden_dim, kv_heads=cfg.kv_heads, mlp=cfg.mlp,
            norm=cfg.norm, qk_norm=cfg.qk_norm, context_parallel=context)

    saved = blocks(c) + context_forward_bytes(cfg.seq_len, 1, cfg.head_dim, c) + context_mask_bytes(cfg.seq_len, c)
    comm = cm.context_parallel(cfg.n_layers, 1, cfg.seq_len, cfg.kv_heads * cfg.head_dim)
    return {"saved": saved, "single_saved": blocks(1), "comm": comm}


def run(c) -> list:
    import torch.multiprocessing as mp

    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(_free_port(), c, results), nprocs=WORLD, join=True, start_method="spawn")
        results = dict(results)
    cfg = replace(c.model, seq_len=SEQ_LEN)
    plan = planned(cfg, WORLD)
    detail = {"seq_len": SEQ_LEN, "global_tokens_per_step": SEQ_LEN, "context_parallel": WORLD,
              "timed_steps": STEPS - SKIP, "repeats": REPEATS,
              "model": {k: getattr(cfg, k) for k in ("n_layers", "d_model", "n_heads", "kv_heads", "hidden_dim",
                                                      "vocab_size")}}
    seconds = results["seconds"]
    cases = [{"case": "long_context_tokens_per_s_cp2", "unit": "tokens/s",
              **stats.summary([SEQ_LEN / s for s in seconds["single"]], [SEQ_LEN / s for s in seconds["cp2"]]),
              "goal": "report (2 ranks x 1 thread vs 1 process x 2 threads, one window of 4096 a step)",
              "detail": detail}]
    saved, single_saved = results["saved"], results["single_saved"]
    cases.append({"case": "long_context_saved_activation_bytes_cp2", "value": saved, "reference": single_saved,
                  "ratio": saved / single_saved, "unit": "bytes/rank",
                  "goal": "about 0.5 of one process's; planner within 1%",
                  "detail": {**detail, "planned": plan["saved"], "planned_ratio": saved / plan["saved"],
                             "single_planned": plan["single_saved"]}})
    measured = results["comm"]["bytes"]
    # the gradients' all-reduce over the group (sync_gradients, no FSDP): every parameter once, fp32
    expected = {**plan["comm"], "all_reduce": plan["comm"]["all_reduce"] + 4 * results["params"]}
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        value = measured.get(kind, 0)
        cases.append({"case": f"comm_bytes_long_context_cp2_{kind}", "value": value, "reference": expected[kind],
                      "ratio": value / expected[kind], "goal": "0.95-1.05 (formula: planning/communication.py)",
                      "unit": "bytes/rank/step",
                      "detail": {**detail, "calls": results["comm"]["calls"], "all_bytes": measured}})
    return cases
