"""model.moe under data parallelism: DDP, ZeRO-3, and expert parallelism 2 over the 2 data-parallel ranks
(strategy.expert_parallel), alone and with ZeRO-3, on 2 processes (gloo, CPU) against one process,
same global batches, through `python -m lit_pretrain.cli train` (as tests/strategy/test_strategies_parity.py does for
the dense model). Without expert parallelism the experts' stacked (E, out, in) weights are ordinary parameters: DDP
all-reduces their gradients, FSDP2 shards them along dim 0 (the experts). Under it each rank holds its E/2 experts
(lit_pretrain/parallel/expert.py); tests/parallel/test_expert_parallel.py covers its other plans against one process.

model.moe.aux_loss=0 here: the Switch loss is a product of two batch means (f_i · P_i), computed per micro-batch on
each rank as Megatron-LM does by default, so two ranks' 4-window losses are not one process's 8-window loss (a
difference of 6e-4 in its value measured at step 0; see README). The router z-loss is a mean over tokens and the
routing counts are summed over the ranks before DeepSeek-V3's bias update, so both must agree: they are on.
"""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_pretrain.resume.weights import load_gpt
from lit_pretrain.runs.folder import read_metrics, series
from tests.conftest import free_port, run_module, train_args
from tests.helpers.global_sizes import assert_global_sizes

pytestmark = pytest.mark.slow

STEPS = 4
BASE = [f"trainer.max_steps={STEPS}", f"trainer.val_every_n_steps={STEPS}", "trainer.log_every_n_steps=1",
        "schedule.warmup_steps=2", "optim.grad_clip_norm=0.1", "model.vocab_size=513", "trainer.progress_bar=false",
        "strategy.timeout_seconds=60"]
MOE = ("model.moe={num_experts: 4, top_k: 2, d_ff_expert: 64, aux_loss: 0.0, router_z_loss: 0.001, "
       "bias_update_rate: 0.001}")
COMMON = [*BASE, MOE]
# ZeRO-1 (ZeroRedundancyOptimizer over DDP) passed this test too; left out to keep the slow suite short.
STRATEGIES = {"ddp": ["strategy=ddp"],
              "zero3": ["strategy=zero", "strategy.zero_stage=3", "strategy.activation_checkpointing=full"],
              # expert parallelism 2 over the 2 data-parallel ranks (parallel/expert.py), with activation
              # checkpointing (the dispatch's all-to-alls run again in the recomputation), and with ZeRO-3
              "ep2": ["strategy=ddp", "strategy.expert_parallel=2", "strategy.activation_checkpointing=full"],
              "ep2_zero3": ["strategy=zero", "strategy.zero_stage=3", "strategy.expert_parallel=2"]}
# model.moe.aux_loss_scope=global (parallel/moe_mesh.py): f_i of the Switch loss from both ranks' counts, so the
# auxiliary loss trains as one process's: against one process with the same coefficient, under EP 2 with activation
# checkpointing (the counts' all-reduce runs again in the recomputation, inside the backward). Plain DDP passed too;
# left out to keep the slow suite short (tests/model/test_moe.py checks the arithmetic in one process).
AUX = ["model.moe.aux_loss=0.01", "model.moe.aux_loss_scope=global"]
AUX_STRATEGIES = {"ep2_aux_global": ["strategy=ddp", "strategy.expert_parallel=2",
                                     "strategy.activation_checkpointing=full"]}


# The default model.moe (8 experts, top 2, aux_loss 0.01 with aux_loss_scope sequence): one process in micro-batches
# of 4 windows accumulated twice (tiny.yaml's own split) against DDP 2 x EP 2 in micro-batches of 4, whose ranks hold
# other windows each (rank r the global order's r, r + 2, ...): with the loss per window, the same experiment.
DEFAULT_LAYOUTS = {"single_default": ["trainer.micro_batch_size=4"],
                   "ep2_default": ["strategy=ddp", "strategy.expert_parallel=2", "trainer.devices=2",
                                   "trainer.micro_batch_size=4"]}


@pytest.fixture(scope="session")  # built once per worker, whatever the order: tests/helpers/longest_first.py
def runs(tmp_path_factory, tiny_data_dir):
    root = tmp_path_factory.mktemp("moe_runs")
    done = {}

    def get(name):
        if name not in done:
            if name in DEFAULT_LAYOUTS:
                run_module(*train_args(tiny_data_dir, root, name), *BASE, "model.moe={}", *DEFAULT_LAYOUTS[name])
                done[name] = root / name
                return done[name]
            if name in ("single", "single_aux"):
                overrides = ["trainer.micro_batch_size=8", *(AUX if name == "single_aux" else [])]
            elif name in AUX_STRATEGIES:
                overrides = [*AUX_STRATEGIES[name], *AUX, "trainer.devices=2", "trainer.micro_batch_size=4"]
            else:
                overrides = [*STRATEGIES[name], "trainer.devices=2", "trainer.micro_batch_size=4"]
            run_module(*train_args(tiny_data_dir, root, name), *COMMON, *overrides)
            done[name] = root / name
        return done[name]

    return get


@pytest.mark.parametrize("name", [*STRATEGIES, *AUX_STRATEGIES])
def test_moe_under_data_parallelism_and_expert_parallelism_matches_one_process(runs, name):
    reference = "single_aux" if name in AUX_STRATEGIES else "single"
    single, other = read_metrics(runs(reference) / "metrics.csv"), read_metrics(runs(name) / "metrics.csv")
    # As the dense parity matrix: float summation order only, so 1e-5 on losses and clipped gradient norms.
    for key, tol in (("train/loss", 1e-5), ("train/grad_norm", 1e-5)):
        a, b = series(single, key), series(other, key)
        assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, STEPS + 1)), key
        for (step, x), (_, y) in zip(a, b):
            assert x == pytest.approx(y, abs=tol), f"{key} at step {step}"
    # Routing: the same tokens per expert (summed over the ranks), the same bias after every step. Exact: a count
    # is an integer, and the bias moves by ±rate from the counts alone.
    for layer in (0, 1):
        for key in ("tokens_min", "tokens_max", "bias_norm", "dropped_fraction"):
            k = f"moe/layer{layer}/{key}"
            assert series(single, k) == series(other, k), k
        z = f"moe/layer{layer}/z_loss"  # a mean over tokens: 2 ranks' means averaged = one mean, to rounding
        assert [v for _, v in series(single, z)] == pytest.approx([v for _, v in series(other, z)], abs=1e-5)
        if name in AUX_STRATEGIES:  # the ranks' auxiliary losses averaged: one process's, with the global f_i
            aux = f"moe/layer{layer}/aux_loss"
            assert [v for _, v in series(single, aux)] == pytest.approx([v for _, v in series(other, aux)], abs=1e-5)
    a, b = load_gpt(runs(reference)), load_gpt(runs(name))
    for (key, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        # The dense matrix's bound (1% of one step's update at lr 1e-3); the expert biases are equal exactly.
        tol = 0 if key.endswith("expert_bias") else 1e-5
        assert torch.allclose(p, q, rtol=0, atol=tol), f"{name}: {key} differs by {(p - q).abs().max():.2e}"
    # summary.json's sizes and the logged MFU: the whole model's (under EP 2 each rank holds half of the experts)
    assert_global_sizes(runs(name))


def test_the_default_moe_trains_the_same_experiment_under_accumulation_and_expert_parallelism(runs):
    """On main (aux_loss_scope micro_batch by default) the two layouts' auxiliary losses covered other windows: the
    train loss 4.7e-5 apart at step 2, 1.1e-4 by step 19 (global: 2.7e-4, its one process's f still per
    micro-batch)."""
    single, ep = read_metrics(runs("single_default") / "metrics.csv"), read_metrics(runs("ep2_default") / "metrics.csv")
    # Float summation order only (as the dense parity matrix and the cases above): 1e-5 on losses and norms.
    for key in ("train/loss", "train/grad_norm", "moe/layer0/aux_loss", "moe/layer1/aux_loss"):
        a, b = series(single, key), series(ep, key)
        assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, STEPS + 1)), key
        for (step, x), (_, y) in zip(a, b):
            assert x == pytest.approx(y, abs=1e-5), f"{key} at step {step}"


def ep_worker(rank: int, world: int, port: int, results):
    """Rank r's tokens through one MoE layer with and without expert parallelism (same weights)."""
    from lit_pretrain.model.config import GPTConfig, MoEConfig
    from lit_pretrain.model.moe import MoE
    from lit_pretrain.parallel.expert import apply_expert_parallel
    from lit_pretrain.planning.plan import ParallelPlan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        cfg = GPTConfig(vocab_size=64, n_layers=1, d_model=32, n_heads=4,
                        moe=MoEConfig(num_experts=4, top_k=2, d_ff_expert=16))
        torch.manual_seed(0)
        plain, ep = MoE(cfg, 0), MoE(cfg, 0)
        for p in plain.parameters():
            torch.nn.init.normal_(p, std=0.3)
        ep.load_state_dict(plain.state_dict())
        apply_expert_parallel(ep, ParallelPlan(data_parallel_replicate=world, expert_parallel=world))
        x = torch.randn(2, 8 + 5 * rank, 32, generator=torch.Generator().manual_seed(rank))  # uneven per rank
        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + rank))
        outs = {}
        for name, layer in (("plain", plain), ("ep", ep)):
            y = layer(x)
            (y * g).sum().backward()
            outs[name] = (y.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()})
        plain_grads = outs["plain"][1]
        for t in plain_grads.values():  # summed over the ranks, as data parallelism does
            dist.all_reduce(t)
        diffs = {}
        for n, t in outs["ep"][1].items():
            if ".experts." in f".{n}":  # the owner's gradient is already the sum over both ranks' token copies
                ref = plain_grads[n][2 * rank:2 * rank + 2]
            else:
                dist.all_reduce(t)
                ref = plain_grads[n]
            diffs[n] = ((ref - t).abs().max() / ref.abs().max()).item()
        results[rank] = {"out": (outs["plain"][0] - outs["ep"][0]).abs().max().item(), "grads": max(diffs.values()),
                         "held": ep.experts["w_up"].weight.shape[0]}
    finally:
        dist.destroy_process_group()


def test_expert_parallel_layer_equals_the_plain_layer_and_each_rank_computes_only_its_experts():
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(ep_worker, args=(2, free_port(), results), nprocs=2, join=True, start_method="forkserver")
        results = dict(results)
    for rank in (0, 1):
        r = results[rank]
        # Same products per token copy (the outputs came out bitwise equal); the owner's grouped matmul sums a
        # weight's gradient over both ranks' copies in another order: fp32 rounding, relative to the largest entry.
        assert r["out"] <= 1e-6 and r["grads"] <= 1e-6, r
        assert r["held"] == 2, r  # each rank holds its 2 of the 4 experts, and computed every token routed to them


def test_expert_parallel_resumes_bitwise_after_sigkill_mid_accumulation(tmp_path, tiny_data_dir):
    """EP 2 killed (SIGKILL, every rank) in the second micro-batch of step 4, resumed from the step-2 checkpoint:
    losses and final weights, the experts' balancing biases included, bitwise those of the uninterrupted run."""
    import signal

    from lit_pretrain.resume.weights import read_checkpoint

    common = [*COMMON, "strategy=ddp", "strategy.expert_parallel=2", "trainer.devices=2",
              "trainer.micro_batch_size=4", "trainer.tokens_per_step=1024", "trainer.checkpoint_every_n_steps=2"]
    fault = ("callbacks.extra=[{class_path: 'tests.helpers.resume_helpers:Fault', "
             "init_args: {step: 3, micro_batch: 1}}]")
    run_module(*train_args(tiny_data_dir, tmp_path, "ref"), *common)
    run_module(*train_args(tiny_data_dir, tmp_path, "killed"), *common, fault, rc=-signal.SIGKILL,
               start_new_session=True)  # its own process group: the SIGKILL takes both ranks, not pytest
    out = run_module(*train_args(tiny_data_dir, tmp_path, "killed"), *common, "run.resume=auto")
    assert "(step 2)" in out.stdout  # resumed from the step-2 checkpoint, the kill having lost step 3's
    ref, resumed = read_metrics(tmp_path / "ref" / "metrics.csv"), read_metrics(tmp_path / "killed" / "metrics.csv")
    assert series(resumed, "train/loss")[-2:] == series(ref, "train/loss")[-2:]  # exact floats (repr in the CSV)
    assert series(resumed, "moe/layer1/bias_norm")[-2:] == series(ref, "moe/layer1/bias_norm")[-2:]
    a, b = read_checkpoint(tmp_path / "ref")["state_dict"], read_checkpoint(tmp_path / "killed")["state_dict"]
    assert a.keys() == b.keys() and any(k.endswith("expert_bias") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
