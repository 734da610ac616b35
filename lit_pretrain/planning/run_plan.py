"""The memory plan and token budget of a whole run (a loaded config), as pure functions of its config.

`run_memory` is what every command states a run's memory with: `lit-pretrain memory --run`, `plan --run`, and the
check of trainer.device_memory_gb when a config loads (`show`, `train`), so they cannot disagree. It reads the
parallel plan the config resolves to (planning/plan.py: ZeRO stage, shard group, tensor and pipeline degrees,
activation checkpointing) and hands it to `memory.memory_plan` (ZeRO paper's model states, our block's saved
tensors, autocast's weight copies, logits and transient buffers).
"""

import math
from dataclasses import replace

from lit_pretrain.errors import ConfigError
from lit_pretrain.model import shapes
from lit_pretrain.planning.memory import memory_plan

# Kept free of every device's memory for what the plan does not count: the CUDA context and cuBLAS workspaces
# (~1 GB), NCCL's buffers, the caching allocator's fragmentation (PyTorch's CUDA memory notes: reserved above
# allocated), torch.compile's workspaces. 10%: 14 GB of an H200.
MIN_HEADROOM = 0.10


def run_memory(config, plan) -> dict:
    """Per-device memory of the run `config` (schema.Config) laid out by `plan` (the one config.load built) on its
    most loaded rank, and, with trainer.device_memory_gb, whether it leaves MIN_HEADROOM of the device free (`fits`)
    and how much it leaves."""
    from lit_pretrain.planning.plan import sized_model

    model, trainer = sized_model(config), config.trainer
    # a pipeline cuts each micro-batch into pipeline micro-batches, p of them in flight (memory_plan's 1F1B count)
    micro = trainer.micro_batch_size // plan.micro_batches if plan.pipeline_parallel > 1 else trainer.micro_batch_size
    device = trainer.device_memory_gb * 1e9 if trainer.device_memory_gb else None
    precision = "bf16-mixed-policy" if plan.mixed_precision_policy else trainer.precision

    def plan_with(context: int, fsdp_ranks: int) -> dict:
        # FSDP2 shards over data_parallel_shard x context_parallel (parallel/mesh.py fsdp_dims)
        layout = replace(plan, context_parallel=context, data_parallel_shard=fsdp_ranks // context)
        return memory_plan(layout, model, micro, precision=precision, device_memory=device)

    out = memory_plan(plan, model, micro, precision=precision, device_memory=device)
    out.update(run=config.run.name, layout=plan.describe(), world_size=plan.world_size, shape=shape_of(model))
    if device is not None:
        out["headroom_bytes"] = device - out["total_bytes"]
        out["headroom_fraction"] = out["headroom_bytes"] / device
        out["min_headroom"] = MIN_HEADROOM
        out["fits"] = out["headroom_fraction"] >= MIN_HEADROOM
        out["context_parallel_needed"] = context_parallel_needed(plan, model, device, plan_with)
    return out


def context_parallel_needed(plan, model, device: float, plan_with) -> int | None:
    """The smallest strategy.context_parallel (a power of 2) with which the run leaves MIN_HEADROOM of `device`
    free, the other ranks of each replica sharding the model state (data_parallel_shard = the rest); None when
    none does. `plan_with(context, fsdp_shard)`: the memory plan with those degrees."""
    ranks = plan.world_size // (plan.data_parallel_replicate * plan.tensor_parallel * plan.pipeline_parallel)
    c = 1
    while c <= ranks and ranks % c == 0 and model.seq_len % (2 * c if c > 1 else 1) == 0:
        if plan.sequence_parallel and c > 1 and model.seq_len % (2 * c * plan.tensor_parallel):
            break
        if plan_with(c, ranks)["total_bytes"] <= (1 - MIN_HEADROOM) * device:
            return c
        c *= 2
    return None


def shape_of(model) -> dict:
    return {"n_layers": model.n_layers, "d_model": model.d_model, "n_heads": model.n_heads,
            "vocab_size": model.vocab_size, "tie_embeddings": model.tie_embeddings,
            **{k: getattr(model, k) for k in shapes.VARIANT_KEYS}}


def check_fits(config, plan) -> None:
    """A ConfigError, naming what to change, when the run does not fit trainer.device_memory_gb with its headroom."""
    if config.trainer.device_memory_gb is None:
        return
    r = run_memory(config, plan)
    if not r["fits"]:
        raise ConfigError(
            f"trainer.device_memory_gb={config.trainer.device_memory_gb:g}: the run needs "
            f"{r['total_bytes'] / 1e9:.1f} GB per device ({r['layout']}, activation_checkpointing "
            f"{r['activation_checkpointing']}, micro_batch {r['micro_batch']}), leaving {r['headroom_fraction']:.0%} "
            f"free where {MIN_HEADROOM:.0%} is kept for what the plan does not count: lower "
            "trainer.micro_batch_size, set strategy.activation_checkpointing=full, or shard more "
            f"(strategy.zero_stage=3, strategy.tensor_parallel{needed_hint(r)}); `lit-pretrain memory --run RUN_FILE` "
            "shows the breakdown")


def needed_hint(r: dict) -> str:
    """The context-parallel degree that fits, when one does and the run has fewer (run_memory's figure)."""
    c = r.get("context_parallel_needed")
    if c is None or c <= r.get("context_parallel", 1):
        return ""
    return f", strategy.context_parallel={c}: the smallest context-parallel degree that fits"


def budget_steps(config) -> int:
    """Optimizer steps of trainer.tokens_per_param x parameters tokens at trainer.tokens_per_step tokens a step."""
    from lit_pretrain.planning.plan import sized_model

    trainer = config.trainer
    if trainer.tokens_per_step is None:
        raise ConfigError(f"trainer.tokens_per_param={trainer.tokens_per_param:g} sets the token budget in tokens, "
                          "which needs trainer.tokens_per_step (the global batch in tokens) to become steps: set it")
    tokens = trainer.tokens_per_param * shapes.params(sized_model(config))
    return max(1, math.ceil(tokens / trainer.tokens_per_step))


def run_plan(config, plan, law) -> dict:
    """The run's budget (parameters, tokens, tokens-per-parameter ratio, FLOPs) beside `law`'s compute-optimal
    split of the same compute (planning/compute_optimal.py), and its memory (`run_memory`); `plan`: the run's parallel
    plan."""
    from lit_pretrain.planning.batch import global_batch
    from lit_pretrain.planning.batch_schedule import step_windows
    from lit_pretrain.planning.compute_optimal import plan as law_plan
    from lit_pretrain.planning.plan import sized_model

    model, trainer = sized_model(config), config.trainer
    tokens_per_step = global_batch(trainer, model.seq_len, plan).tokens_per_step
    # trainer.batch_schedule: the steps' own batches (tokens_per_step is then the largest, the planned one).
    n, d = shapes.params(model), step_windows(trainer.batch_schedule, 1, tokens_per_step).before(trainer.max_steps)
    optimum = law_plan(law, flops=6.0 * n * d, vocab_size=model.vocab_size, seq_len=model.seq_len,
                   tokens_per_step=tokens_per_step)
    return {"run": config.run.name, "params": n, "tokens": d, "tokens_per_param": d / n, "steps": trainer.max_steps,
            "tokens_per_step": tokens_per_step, "flops_6nd": 6.0 * n * d,
            "flops": float(shapes.flops_per_token(model)) * d, "optimum": optimum, "memory": run_memory(config, plan)}


def format_run_plan(r: dict) -> str:
    m = r["memory"]
    o = r["optimum"]
    lines = [f"run {r['run']}: {r['params']:,} parameters, {r['steps']:,} steps x {r['tokens_per_step']:,} tokens = "
             f"{r['tokens']:,} tokens, tokens_per_param {r['tokens_per_param']:.2f}",
             f"  compute: 6ND = {r['flops_6nd']:.3g} FLOPs ({r['flops']:.3g} with attention, PaLM appendix B)",
             f"  {o['law']}'s compute-optimal split of 6ND: {o['params']:.3g} parameters x {o['tokens']:.3g} tokens, "
             f"tokens_per_param {o['tokens_per_param']:.2f}",
             f"  memory: {format_fit(m)}"]
    return "\n".join(lines)


def format_fit(m: dict) -> str:
    """One line: the per-device total and, with a stated device memory, the headroom and whether it fits."""
    text = f"{m['total_bytes'] / 1e9:.1f} GB per device ({m['layout']}, activation_checkpointing " \
           f"{m['activation_checkpointing']}, micro_batch {m['micro_batch']} x seq_len {m['seq_len']})"
    if "headroom_fraction" in m:
        text += (f" of {m['device_memory'] / 1e9:g} GB: headroom {m['headroom_bytes'] / 1e9:.1f} GB "
                 f"({m['headroom_fraction']:.0%}, at least {m['min_headroom']:.0%} kept): "
                 f"{'fits' if m['fits'] else 'does NOT fit'}")
        if m.get("context_parallel_needed", 1) not in (None, 1):
            text += f"; context_parallel needed: {m['context_parallel_needed']}"
    return text
