"""The global batch: tokens per optimizer step, fixed by the config and only split by the layout.

    tokens_per_step = micro_batch_size x seq_len x data-parallel degree x accumulation

The data-parallel degree is the plan's data_parallel_replicate x data_parallel_shard: tensor- and pipeline-parallel
ranks share their replica's batch, and expert-parallel groups are made of data-parallel ranks (planning/plan.py).
trainer.tokens_per_step=null means micro_batch_size x seq_len, one micro-batch of one process, whatever the layout:
so `strategy=fsdp trainer.devices=2` trains the tokens one process does, and gradient accumulation (a whole number
>= 1) absorbs the rest, as in torchtitan's `global_batch_size` / `local_batch_size` and Megatron-LM's
`--global-batch-size`. A layout that cannot split the batch into whole micro-batches is refused when the config
loads (build_plan), naming the micro_batch_size and tokens_per_step nearest to the given ones that work.

Pure: no torch, so `show` refuses what `train` would.
"""

from dataclasses import dataclass
from typing import List

from lit_pretrain.errors import ConfigError


@dataclass(frozen=True)
class GlobalBatch:
    micro_batch_size: int
    seq_len: int
    data_parallel: int
    accumulation: int
    tokens_per_step: int


def global_batch(trainer, seq_len: int, plan) -> GlobalBatch:
    """The run's global batch on `plan` (a ParallelPlan), or a ConfigError naming the keys and what works."""
    micro, d = trainer.micro_batch_size, plan.data_parallel
    tokens = trainer.tokens_per_step if trainer.tokens_per_step is not None else micro * seq_len
    if getattr(trainer, "batch_schedule", None):  # the planned batch: the largest (planning/batch_schedule.py)
        tokens = max(change.tokens_per_step for change in trainer.batch_schedule)
    per_micro_step = micro * seq_len * d
    if tokens % per_micro_step == 0:
        return GlobalBatch(micro, seq_len, d, tokens // per_micro_step, tokens)
    given = (f"trainer.tokens_per_step={tokens}" if trainer.tokens_per_step is not None else
             f"trainer.tokens_per_step=null (micro_batch_size x model.seq_len = {micro} x {seq_len} = {tokens} "
             "tokens, one micro-batch of one process whatever the layout)")
    raise ConfigError(
        f"{given} does not split into whole micro-batches of this layout: trainer.micro_batch_size={micro} x "
        f"model.seq_len={seq_len} x data-parallel degree {d} ({degree_keys(plan)}) = {per_micro_step} tokens per "
        f"micro-batch step, which must divide tokens_per_step (accumulation = the quotient, a whole number >= 1): "
        f"set {', or '.join(fixes(trainer, seq_len, plan, tokens))}")


def degree_keys(plan) -> str:
    """Where the data-parallel degree comes from, in config keys."""
    return (f"strategy.data_parallel_replicate={plan.data_parallel_replicate} x data_parallel_shard="
            f"{plan.data_parallel_shard}, the {plan.world_size} processes of trainer.devices x trainer.num_nodes over "
            f"strategy.tensor_parallel={plan.tensor_parallel} x pipeline_parallel={plan.pipeline_parallel}")


def fixes(trainer, seq_len: int, plan, tokens: int) -> List[str]:
    """What works, nearest to the config: the micro-batch size that splits `tokens` (the largest one not above
    trainer.micro_batch_size, else the smallest above; under pipeline parallelism a multiple of its micro-batches),
    and the multiple of the current micro-batch step nearest to `tokens`."""
    micro, d = trainer.micro_batch_size, plan.data_parallel
    step = 1 if plan.pipeline_parallel == 1 else plan.micro_batches
    keep = "" if trainer.tokens_per_step is not None else f"trainer.tokens_per_step={tokens} with "
    out = []
    if tokens % (seq_len * d) == 0:
        fits = [m for m in range(step, tokens // (seq_len * d) + 1, step) if tokens % (m * seq_len * d) == 0]
        below = [m for m in fits if m <= micro]
        if fits:
            m = max(below) if below else min(fits)
            out.append(f"{keep}trainer.micro_batch_size={m} (accumulation {tokens // (m * seq_len * d)})")
    per_micro_step = micro * seq_len * d
    k = max(1, (2 * tokens + per_micro_step) // (2 * per_micro_step))  # nearest whole multiple, halves up
    out.append(f"trainer.tokens_per_step={k * per_micro_step} (accumulation {k})")
    return out


def layout_line(plan) -> str:
    """Every degree of the layout a run applies, in the glossary's words (the plan line's first half; memory.json's
    strategy)."""
    data = f"data parallel {plan.data_parallel_replicate} replicate x {plan.data_parallel_shard} shard"
    if plan.zero_stage:
        policy = ", bf16 parameters gathered, fp32 gradients reduced" if plan.mixed_precision_policy else ""
        data += f" (ZeRO stage {plan.zero_stage}{policy})"
    tensor = f"tensor parallel {plan.tensor_parallel}" + (" with sequence parallelism" if plan.sequence_parallel
                                                         else "")
    pipeline = f"pipeline parallel {plan.pipeline_parallel}"
    if plan.pipeline_parallel > 1:
        pipeline += f" ({plan.schedule}, {plan.micro_batches} pipeline micro-batches)"
    return (f"{data}, context parallel {plan.context_parallel}, {tensor}, {pipeline}, expert parallel "
            f"{plan.expert_parallel}")


def plan_line(plan, batch: GlobalBatch) -> str:
    """The layout and batch a run applies, in one line (train prints it before the first step)."""
    b = batch
    return (f"plan: {layout_line(plan)}; micro-batch {b.micro_batch_size} x seq_len {b.seq_len} x data-parallel "
            f"degree {b.data_parallel} x accumulation {b.accumulation} = {b.tokens_per_step:,} tokens per step")
