"""`lit-pretrain simulate` (lit_pretrain/simulate/): the collective counter on the fake backend, a simulated step's
model states and collectives against the planners (exact: they are counts), the refusals (train's line for a
refused layout; the layouts fake tensors cannot run), and, on gloo, the same counts and state bytes as a real step.
"""

import pytest
import torch
import torch.distributed as dist

from lit_pretrain import config
from lit_pretrain.errors import ConfigError

RUN = "experiments/runs/tiny.yaml"  # 2 layers, d_model 64, seq 64, vocab 512; 512 tokens a step


@pytest.fixture
def fake_world():
    from lit_pretrain.internals import init_fake_process_group

    init_fake_process_group(0, 4)
    yield
    dist.destroy_process_group()


def test_counter_counts_c10d_and_dtensor_collectives_by_group(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lit_pretrain.simulate.collectives import CollectiveCounter

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    labels = {tuple(dist.get_process_group_ranks(mesh.get_group(n))): n for n in ("a", "b")}
    t = distribute_tensor(torch.ones(4, 6), mesh["b"], [Shard(0)], src_data_rank=None)  # (2, 6) here
    with CollectiveCounter(labels) as counter:
        dist.all_reduce(torch.ones(3), group=mesh.get_group("a"))  # a c10d op: 12 bytes
        t.full_tensor()  # DTensor's functional all-gather: its output, (4, 6) fp32 = 96 bytes
    assert dict(counter.counts) == {("all_reduce", "a"): [1, 12], ("all_gather", "b"): [1, 96]}


def simulated(overrides, steps=1):
    from lit_pretrain.simulate.engine import simulate_rank

    return simulate_rank(config.load(RUN, overrides, check_inputs=False), 0, steps)


def test_zero3_step_matches_the_planners_exactly(capsys):
    """Through the command (--json): 2 steps of a 2-micro-batch accumulation at ZeRO-3 over 2 ranks."""
    import json

    from lit_pretrain.cli import main
    from lit_pretrain.model import shapes
    from lit_pretrain.planning.communication import fsdp_step
    from lit_pretrain.planning.memory import per_rank_model_state_bytes
    from lit_pretrain.planning.plan import sized_model

    overrides = ["strategy=fsdp", "trainer.devices=2", "trainer.micro_batch_size=2"]  # accumulation 2
    assert main(["simulate", RUN, *overrides, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    result = out["ranks"][0]
    assert out["start_check"]["ok"] and result["micro_batches"] == result["simulated"] == 2
    cfg = config.load(RUN, overrides, check_inputs=False)
    model = sized_model(cfg)
    planned = per_rank_model_state_bytes(model, 2, 3, cfg.trainer.precision)
    param_shapes = shapes.param_shapes(model)
    # + AdamW's step: one fp32 scalar per parameter (its state["step"]), which the planner leaves out: 4 bytes a
    # tensor, 1e-9 of an 8B model's state (docs/large-runs.md)
    planned["optimizer_bytes"] += 4 * len(param_shapes)
    assert result["state"] == {k: planned[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")}
    # Lightning's FSDP path (no mesh of ours): optim.grad_norm reduces one fp32 norm per parameter
    expected = fsdp_step(param_shapes, 2, 3, micro_batches=2, norm_values=len(param_shapes))
    assert {c["kind"]: (c["calls"], c["bytes"]) for c in result["collectives"]} == expected
    assert {c["group"] for c in result["collectives"]} == {"data_parallel"}
    # The second step holds AdamW's state through its forward. At the peak the tracker counts it with at most one
    # transient of the largest shard (foreach's sqrt of exp_avg_sq), never the unsharded model's state, which
    # DTensor's shape inference would have added (internals.memory_tracker).
    largest = 4 * (512 // 2) * 64  # the (512, 64) embedding's fp32 shard: the largest parameter
    optimizer = result["state"]["optimizer_bytes"]
    assert optimizer <= result["peak"]["Optstate"] <= optimizer + largest


def test_refused_layout_is_refused_with_trains_line(capsys):
    from lit_pretrain.cli import main

    bad = [RUN, "strategy=tensor", "trainer.devices=3"]  # 3 ranks cannot hold 2-way tensor parallelism
    assert main(["train", *bad]) == 2
    train_line = capsys.readouterr().err.strip().split("error: ", 1)[1]
    assert main(["simulate", *bad]) == 2
    simulate_line = capsys.readouterr().err.strip().split("error: ", 1)[1]
    assert simulate_line == train_line and "\n" not in train_line


def test_value_dependent_shapes_are_refused_in_one_line():
    """Routing is simulated balanced (simulate/routing.py), but the copies a capacity keeps are a shape made from
    the routing's values: refused in one line naming the layout, not guessed."""
    overrides = ["strategy=ddp", "strategy.expert_parallel=2", "trainer.devices=2", "model.moe.num_experts=4",
                 "model.moe.top_k=2", "model.moe.capacity_factor=1.0"]
    with pytest.raises(ConfigError, match="cannot be simulated") as err:
        simulated(overrides)
    assert "expert_parallel=2" in str(err.value) and "capacity_factor" in str(err.value)
    assert "\n" not in str(err.value)


def test_pipeline_stages_held_to_the_planners(monkeypatch):
    """1F1B over 2 stages (tiny: one block each, 4 pipeline micro-batches, accumulation 2), both stages: the sends
    and receives of planning/communication.pipeline_p2p exactly; the first stage's model states equal to the memory
    planner's (its most loaded rank by model state; + AdamW's step scalars), the last stage's larger by its final
    norm (d fp32 values a state kind: the planner leaves the last stage out, docs/large-runs.md). A stated stream
    the stages do not compute fails the step: the shapes are checked, not trusted."""
    from torch.distributed.pipelining._utils import PipeliningMetadataError

    from lit_pretrain.planning.communication import pipeline_p2p
    from lit_pretrain.simulate import engine
    from lit_pretrain.simulate.report import planner_figures

    cfg = config.load(RUN, ["strategy=pipeline", "trainer.devices=2"], check_inputs=False)
    planner = planner_figures(cfg)
    stream = (4 // 4) * 64 * 64 * 4  # B/m rows x T x d_model, fp32 (bf16-mixed autocast: the residual sum is fp32)
    for rank in (0, 1):
        result = engine.simulate_rank(cfg, rank)
        sends = {kind: tuple(v) for (kind, _), v in result.collectives.items() if kind in ("send", "recv")}
        # + the warm-up vote of the schedule's first step (stated or exchanged shapes): one int32 each way
        assert sends == {k: (calls + 1, size + 4) for k, (calls, size) in
                         pipeline_p2p([rank], 2, 4, result.micro_batches, stream).items()}
        norm = 4 * 64 * rank
        tensors = 10 + rank  # the parameters: 9 of a block, the embedding; the last stage also the final norm
        assert result.state == {"param_bytes": planner["param_bytes"] + norm,
                                "grad_bytes": planner["grad_bytes"] + norm,
                                "optimizer_bytes": planner["optimizer_bytes"] + 2 * norm + 4 * tensors}
    shapes = engine.pipeline_shapes
    monkeypatch.setattr(engine, "pipeline_shapes", lambda c, p: (*shapes(c, p)[:1], ((1, 64, 64), torch.float64),
                                                                 shapes(c, p)[2]))
    with pytest.raises(PipeliningMetadataError, match="dtype mismatch"):
        engine.simulate_rank(cfg, 0)


def test_ranks_choice():
    from lit_pretrain.planning.plan import ParallelPlan
    from lit_pretrain.simulate.engine import mesh_coordinates, ranks_to_simulate

    plan = ParallelPlan(data_parallel_shard=4, tensor_parallel=2, pipeline_parallel=2, zero_stage=3)  # 16 ranks
    assert ranks_to_simulate(plan, "corners") == [0, 7, 8, 15]  # each stage's first and last
    assert ranks_to_simulate(plan, "all") == list(range(16))
    assert mesh_coordinates(plan, 11) == {"pipeline": 1, "data_parallel_replicate": 0, "data_parallel_shard": 1,
                                          "context_parallel": 0, "tensor_parallel": 1}
    with pytest.raises(ConfigError, match="--ranks 16"):
        ranks_to_simulate(plan, "16")


CASES = {  # name: overrides; each also runs for real on 2 gloo processes
    "zero3": ["strategy=fsdp", "trainer.devices=2"],
    "tp2": ["strategy=tensor", "trainer.devices=2"],  # accumulation 2
    "cp2": ["strategy=ddp", "strategy.context_parallel=2", "trainer.devices=2"],
    # 1F1B over 2 stages, 4 pipeline micro-batches, accumulation 2: the stages' shapes given, not exchanged
    "pp2": ["strategy=pipeline", "trainer.devices=2"],
    # 4 experts, top-2, over 2 ranks (2 MoE layers): the real router routes as its weights say, the simulation
    # balanced, so the all-to-alls' calls are compared and their bytes held to the planner's balanced figure
    "ep2": ["strategy=ddp", "strategy.expert_parallel=2", "trainer.devices=2", "model.moe.num_experts=4",
            "model.moe.top_k=2"],
}


@pytest.mark.slow
def test_simulation_counts_what_a_real_gloo_step_counts():
    import torch.multiprocessing as mp

    from tests.conftest import free_port
    from tests.helpers.simulate_workers import worker

    cases = [(name, RUN, overrides) for name, overrides in CASES.items()]
    with mp.get_context("spawn").Manager() as manager:
        results = manager.dict()
        mp.start_processes(worker, args=(2, free_port(), cases, results), nprocs=2, join=True,
                           start_method="forkserver")
        real = dict(results)
    for name, overrides in CASES.items():
        cfg = config.load(RUN, overrides, check_inputs=False)
        from lit_pretrain.simulate.engine import simulate_rank

        for rank in (0, 1):
            sim = simulate_rank(cfg, rank, steps=1)
            measured = dict(real[(name, rank)]["collectives"])
            if name == "ep2":  # routed rows: the simulation's are balanced (expert_all_to_all), the real router's not
                from lit_pretrain.planning.communication import expert_all_to_all

                key = next(k for k in sim.collectives if k[0] == "all_to_all")
                tokens = cfg.trainer.micro_batch_size * cfg.model.seq_len
                assert tuple(sim.collectives[key]) == expert_all_to_all(2, tokens, 2, cfg.model.d_model, 4,
                                                                        sim.micro_batches)
                assert sim.collectives[key][0] == measured[key][0]
                measured[key] = sim.collectives[key]
            # Counts and bytes are integers of shapes: equal, call for call, or the simulation is wrong.
            assert sim.collectives == measured, (name, rank)
            assert sim.state == real[(name, rank)]["state"], (name, rank)


@pytest.mark.slow
@pytest.mark.parametrize("run_file", ["experiments/runs/llama3_1_8b_h200x8.yaml",  # ZeRO-3 over 8
                                      "experiments/runs/llama3_1_8b_h200x32.yaml"])  # HSDP 4 x 8
def test_shipped_run_files_hold_the_planners_to_the_simulation(run_file):
    """The shipped 8B files at their world size, one block (the others repeat it: every count below is linear in
    the blocks) and 2 of their micro-batches: model states equal to the memory planner's padded shards (+ AdamW's
    step scalars) and every collective equal to planning/communication.fsdp_step, calls and bytes."""
    from lit_pretrain.model import shapes
    from lit_pretrain.planning.communication import fsdp_step
    from lit_pretrain.planning.memory import per_rank_model_state_bytes
    from lit_pretrain.planning.plan import sized_model
    from lit_pretrain.simulate.engine import simulate_rank

    cfg = config.load(run_file, ["model.n_layers=1"], check_inputs=False)
    plan = cfg.plan
    result = simulate_rank(cfg, 0, steps=1)
    model = sized_model(cfg)
    param_shapes = shapes.param_shapes(model)
    planned = per_rank_model_state_bytes(model, plan.data_parallel_shard, 3, "bf16-mixed-policy")
    planned["optimizer_bytes"] += 4 * len(param_shapes)  # AdamW's step scalars (see the ZeRO-3 test above)
    assert result.state == {k: planned[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")}
    # FSDP2's policy: bf16 gathers, fp32 reduce-scatters; our mesh (HSDP) reduces one norm, Lightning's FSDP path one
    # per parameter
    norms = 1 if plan.uses_mesh else len(param_shapes)
    expected = fsdp_step(param_shapes, plan.data_parallel_shard, 3, micro_batches=result.micro_batches,
                         replicas=plan.data_parallel_replicate, gather_e=2, reduce_e=4, norm_values=norms)
    measured = {}
    for (kind, _), (calls, size) in result.collectives.items():
        measured[kind] = (measured.get(kind, (0, 0))[0] + calls, measured.get(kind, (0, 0))[1] + size)
    assert measured == expected
