"""What `lit-pretrain simulate` prints: per simulated rank, the peak bytes by kind, the state it holds after the step,
the collectives of one step by kind and group, and the simulation's time; beside them the memory planner's figures
for the same run (planning/run_plan.py run_memory, what `lit-pretrain memory --run` and the config load's check
print) and the ratio of each."""

from typing import Dict, List

from lit_pretrain.simulate.engine import RankResult

GB = 1e9


def size(n: float) -> str:
    """Bytes in the largest decimal unit that keeps them at 1 or more (GB, MB, kB), as `memory --run` prints GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"
KINDS = {"Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer state",
         "Activation": "activations", "Temp": "temporaries", "Buffer": "buffers", "Other": "other"}


def planner_figures(config) -> dict:
    """The memory planner's per-rank figures of `config` on its plan (run_memory: its most loaded rank), with the
    model states also as FSDP2 lays them out (padded dim-0 shards, memory.per_rank_model_state_bytes) where the
    layout is data parallelism alone (the only layout that function counts)."""
    from lit_pretrain.planning.memory import per_rank_model_state_bytes
    from lit_pretrain.planning.plan import sized_model
    from lit_pretrain.planning.run_plan import run_memory

    plan = config.plan
    out = run_memory(config, plan)
    data_only = plan.tensor_parallel == plan.pipeline_parallel == plan.expert_parallel == plan.context_parallel == 1
    # ZeRO-1's optimizer shares whole tensors among the ranks (ZeroRedundancyOptimizer), not padded dim-0 shards
    if data_only and plan.zero_stage != 1:
        precision = "bf16-mixed-policy" if plan.mixed_precision_policy else config.trainer.precision
        exact = per_rank_model_state_bytes(sized_model(config), plan.data_parallel_shard, plan.zero_stage, precision)
        out["exact"] = {k: exact[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")}
    return out


def comparison(result: RankResult, planner: dict) -> Dict[str, tuple]:
    """{figure: (simulated bytes, planner bytes)}: model states held after the step (against the padded shards where
    the planner counts them, else its ZeRO-paper figure), the peak's activations and temporaries, and the peak."""
    planned_state = planner.get("exact", planner)
    rows = {k: (result.state[k], planned_state[k]) for k in ("param_bytes", "grad_bytes", "optimizer_bytes")}
    peak = result.peak
    rows["activations at the peak"] = (peak.get("Activation", 0), planner["activation_bytes"] + planner["logits_bytes"])
    rows["temporaries at the peak"] = (peak.get("Temp", 0), planner["transient_bytes"])
    rows["peak"] = (peak.get("Total", 0), planner["total_bytes"])
    return rows


def format_rank(result: RankResult, planner: dict) -> str:
    where = ", ".join(f"{k} {v}" for k, v in result.coordinates.items())
    lines = [f"rank {result.rank} ({where}): {result.simulated} of {result.micro_batches} micro-batches a step "
             f"simulated in {result.seconds:.1f} s"]
    peak = result.peak
    kinds = ", ".join(f"{name} {size(peak.get(k, 0))}" for k, name in KINDS.items())
    lines.append(f"  peak {size(peak.get('Total', 0))}: {kinds}")
    lines.append("  held after the step: " + ", ".join(
        f"{k.replace('_bytes', '')} {size(v)}" for k, v in result.state.items()))
    lines.append("  collectives of one optimizer step (calls, bytes this rank sends or receives):")
    for (kind, group), (calls, nbytes) in sorted(result.collectives.items()):
        lines.append(f"    {kind:<15} over {group:<28} {calls:>7} calls {size(nbytes):>12}")
    lines.append("  against the memory planner (lit-pretrain memory --run), simulated / planned:")
    for name, (simulated, planned) in comparison(result, planner).items():
        ratio = f"{simulated / planned:.3f}" if planned else "-"
        lines.append(f"    {name:<26} {size(simulated):>12} / {size(planned):>12} = {ratio}")
    lines.extend(f"  note: {n}" for n in result.notes)
    return "\n".join(lines)


def format_results(config, results: List[RankResult], planner: dict) -> str:
    plan = config.plan
    head = (f"{config.run.name}: {plan.world_size} ranks, {plan.describe()}; fake process group, one rank per "
            f"simulation (--ranks)")
    verdict = planner.get("fits")
    if verdict is not None:
        device = config.trainer.device_memory_gb
        worst = max(r.peak.get("Total", 0) for r in results)
        planned = "fits" if verdict else "does not fit"
        simulated = "fits" if simulated_fits(results, planner, device) else "does not fit"
        head += (f"\nplanner: {planner['total_bytes'] / GB:.1f} GB of {device} GB ({planned}, keeping "
                 f"{planner['min_headroom']:.0%} free); simulated peak {worst / GB:.1f} GB ({simulated})")
    return "\n".join([head] + [format_rank(r, planner) for r in results])


def simulated_fits(results: List[RankResult], planner: dict, device_gb: float) -> bool:
    """The planner's verdict (run_plan.run_memory's `fits`: MIN_HEADROOM of the device left free) for the largest
    simulated peak."""
    worst = max(r.peak.get("Total", 0) for r in results)
    return worst <= device_gb * GB * (1 - planner["min_headroom"])


def as_json(config, results: List[RankResult], planner: dict) -> dict:
    device = config.trainer.device_memory_gb
    fits = {"planner": planner.get("fits"),
            "simulated": simulated_fits(results, planner, device) if planner.get("fits") is not None else None}
    return {"run": config.run.name, "world_size": config.plan.world_size, "layout": config.plan.describe(),
            "fits": fits,
            "ranks": [{"rank": r.rank, "coordinates": r.coordinates, "peak": r.peak, "state": r.state,
                       "collectives": [{"kind": k, "group": g, "calls": c, "bytes": b}
                                       for (k, g), (c, b) in sorted(r.collectives.items())],
                       "micro_batches": r.micro_batches, "simulated": r.simulated, "seconds": r.seconds,
                       "planner": {k: list(v) for k, v in comparison(r, planner).items()}, "notes": r.notes}
                      for r in results]}
