"""The parallel plan: how one run splits its work, as data, built and checked when the config loads.

Five degrees multiply to the world size (trainer.devices x trainer.num_nodes), outermost first:

    pipeline_parallel x data_parallel_replicate x data_parallel_shard x context_parallel x tensor_parallel

- data_parallel_shard ranks hold 1/shard of the model state at `zero_stage` (1: optimizer state, ZeroRedundancy-
  Optimizer; 2: also gradients; 3: also parameters, both FSDP2);
- data_parallel_replicate ranks hold equal copies (HSDP when shard > 1: FSDP2 shards within a replica group and
  all-reduces gradients across replicas, Zhao et al. 2023 "PyTorch FSDP" §3.2.2);
- tensor_parallel ranks split each block's matrices (Megatron layers, parallel/tensor.py), optionally with sequence
  parallelism over the same group;
- pipeline_parallel ranks hold contiguous slices of the blocks (parallel/pipeline.py);
- context_parallel ranks share one micro-batch and split its sequence (parallel/context.py, Llama 3's all-gather):
  not a data-parallel dimension for the batch (planning/batch.py), but the ZeRO stages shard model state over
  data-parallel shard x context-parallel ranks (FSDP2 at 2/3, ZeroRedundancyOptimizer at 1), and their gradients
  are averaged like data-parallel ones (as torchtitan's dp_shard_cp).

Tensor-parallel ranks are neighbours (innermost), so on GPUs their per-layer collectives stay inside a node, as
torchtitan's ParallelDims orders them. One degree may be -1: the rest of the world. The strategy presets
(experiments/strategy/*.yaml: single, ddp, zero, fsdp, tensor, pipeline) only set these keys; `strategy.name` picks the
defaults of what they leave unset (see `build_plan`).

Pure: no torch.distributed, so `show` and `train` refuse the same layouts with the same message before any process
group exists (a layout that fails inside a collective hangs its peers until the timeout: docs/cpu.md).
"""

from dataclasses import dataclass
from typing import Any, Optional, Union

from lit_pretrain.errors import ConfigError
from lit_pretrain.planning.batch import global_batch
from lit_pretrain.planning.compile_policy import CompileDecision, decide, run_flops

MESH_DIMS = ("pipeline", "data_parallel_replicate", "data_parallel_shard", "context_parallel", "tensor_parallel")
DEGREE_KEYS = ("data_parallel_replicate", "data_parallel_shard", "tensor_parallel", "pipeline_parallel",
               "context_parallel")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# Precisions Lightning's ModelParallelStrategy accepts (lightning/pytorch/trainer/connectors/accelerator_connector.py).
FSDP_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


@dataclass(frozen=True)
class ParallelPlan:
    data_parallel_replicate: int = 1
    data_parallel_shard: int = 1
    zero_stage: int = 0
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    micro_batches: int = 1
    stages_per_rank: int = 1
    activation_checkpointing: str = "none"
    activation_checkpointing_k: int = 2
    compile: bool = False
    expert_parallel: int = 1
    activation_checkpointing_save_matmuls: str = "all"
    mixed_precision_policy: bool = False  # FSDP2 gathers bf16 parameters and reduces fp32 gradients (zero.py)
    context_parallel: int = 1
    float8: Optional[Any] = None  # trainer.float8 (schema.Float8Config): apply_plan converts the blocks' linears

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.context_parallel * self.tensor_parallel * self.pipeline_parallel

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks (replicas x shards): each reads its own part of the global batch."""
        return self.data_parallel_replicate * self.data_parallel_shard

    @property
    def uses_fsdp(self) -> bool:
        return self.zero_stage in (2, 3)

    @property
    def uses_mesh(self) -> bool:
        """Whether the run needs our own device mesh (parallel/mesh.py) rather than plain DDP or plain FSDP."""
        return self.tensor_parallel > 1 or self.pipeline_parallel > 1 or self.expert_parallel > 1 or (
            self.uses_fsdp and self.data_parallel_replicate > 1) or self.context_parallel > 1

    @property
    def mesh_shape(self):
        return (self.pipeline_parallel, self.data_parallel_replicate, self.data_parallel_shard, self.context_parallel,
                self.tensor_parallel)

    def describe(self) -> str:
        keys = DEGREE_KEYS if self.context_parallel > 1 else DEGREE_KEYS[:4]
        parts = [f"{k}={getattr(self, k)}" for k in keys] + [f"zero_stage={self.zero_stage}"]
        n = len(keys)
        if self.sequence_parallel:
            parts.append("sequence_parallel=true")
        if self.expert_parallel > 1:
            parts.append(f"expert_parallel={self.expert_parallel}")
        return " x ".join(parts[:n]) + ", " + ", ".join(parts[n:])


def context_degree(strategy) -> int:
    """strategy.context_parallel (1 for a section written before it existed)."""
    return getattr(strategy, "context_parallel", 1)


def _resolve(world: int, degrees: dict) -> dict:
    """Fill the one -1 degree with the rest of the world; check the product."""
    free = [k for k, v in degrees.items() if v == -1]
    if len(free) > 1:
        raise ConfigError(f"{' and '.join('strategy.' + k for k in free)} are each -1: at most one degree may be -1 "
                          "(the rest of the world); give the others")
    for k, v in degrees.items():
        if v != -1 and v < 1:
            raise ConfigError(f"strategy.{k}={v}: a degree is a positive number of ranks, or -1 for the rest")
    fixed = 1
    for v in degrees.values():
        fixed *= v if v != -1 else 1
    product = " x ".join(f"{k}={'-1' if v == -1 else v}" for k, v in degrees.items())
    if free:
        if world % fixed:
            raise ConfigError(f"trainer.devices x trainer.num_nodes = {world} processes is not a multiple of "
                              f"{product} without the -1 (= {fixed}): change trainer.devices or the degrees")
        degrees = {**degrees, free[0]: world // fixed}
    elif fixed != world:
        raise ConfigError(f"the degrees multiply to {fixed} ({product}) but trainer.devices x trainer.num_nodes = "
                          f"{world}: their product must be the world size; set one degree to -1 for the rest, or "
                          "change trainer.devices")
    return degrees


def plan_from(strategy, trainer, model=None, compile: Optional[Union[bool, str]] = None,
              vocab_from: Optional[str] = None) -> ParallelPlan:
    """The plan a `strategy` section asks for on trainer.devices x trainer.num_nodes processes, or a ConfigError
    naming the key to change. `model` (a GPTConfig) adds the checks of the model's shape; `compile` defaults to
    trainer.compile, and "auto" is resolved here (compile_policy.decide). `vocab_from`: see check_vocab."""
    world = trainer.devices * trainer.num_nodes
    name = strategy.name
    stage = strategy.zero_stage if strategy.zero_stage is not None else (3 if name in ("zero", "fsdp") else 0)
    if name == "single" and world > 1:
        raise ConfigError(f"strategy.name=single runs one process, but trainer.devices={trainer.devices} and "
                          f"trainer.num_nodes={trainer.num_nodes}: choose strategy=ddp, or set trainer.devices=1")
    replicate, shard = strategy.data_parallel_replicate, strategy.data_parallel_shard
    # What the keys leave unset: the data-parallel ranks shard state when a ZeRO stage is asked for, else replicate;
    # they take the rest of the world unless a tensor or pipeline degree already does.
    if replicate is None and shard is None:
        rest = 1 if -1 in (strategy.tensor_parallel, strategy.pipeline_parallel, context_degree(strategy)) else -1
        replicate, shard = (1, rest) if stage >= 1 else (rest, 1)
    elif replicate is None:
        replicate = -1 if shard != -1 else 1
    elif shard is None:
        shard = -1 if replicate != -1 else 1
    degrees = _resolve(world, {"data_parallel_replicate": replicate, "data_parallel_shard": shard,
                               "tensor_parallel": strategy.tensor_parallel,
                               "pipeline_parallel": strategy.pipeline_parallel,
                               "context_parallel": context_degree(strategy)})
    pc = strategy.pipeline
    plan = ParallelPlan(
        **degrees, zero_stage=stage, sequence_parallel=bool(strategy.sequence_parallel), schedule=pc.schedule,
        micro_batches=pc.micro_batches, stages_per_rank=pc.stages_per_rank,
        activation_checkpointing=getattr(strategy, "activation_checkpointing", "none"),
        activation_checkpointing_k=getattr(strategy, "activation_checkpointing_k", 2),
        compile=compile_decision(trainer, model, degrees, compile).compile,
        expert_parallel=getattr(strategy, "expert_parallel", 1),
        activation_checkpointing_save_matmuls=getattr(strategy, "activation_checkpointing_save_matmuls", "all"),
        mixed_precision_policy=mixed_precision_policy_for(strategy, trainer, stage, degrees),
        float8=getattr(trainer, "float8", None))
    check_plan(plan, trainer, model, vocab_from)
    return plan


def mixed_precision_policy_for(strategy, trainer, stage: int, degrees: dict) -> bool:
    """strategy.mixed_precision_policy resolved: null (the default) turns FSDP2's policy on wherever it is built and
    tested (zero_stage 2/3, HSDP included, under trainer.precision=bf16-mixed, without tensor, pipeline or expert
    parallelism) and leaves the autocast path elsewhere, so a config that trained before still loads; true asks for
    it and is refused where it is not built; false keeps the autocast path."""
    setting = getattr(strategy, "mixed_precision_policy", None)
    eligible = stage in (2, 3) and trainer.precision == "bf16-mixed"
    if setting is True and not eligible:
        raise ConfigError("strategy.mixed_precision_policy=true is FSDP2's policy: it needs strategy.zero_stage 2 or 3 "
                          f"and trainer.precision=bf16-mixed (here zero_stage={stage}, trainer.precision="
                          f"{trainer.precision}): set those, or leave strategy.mixed_precision_policy=null")
    others = (degrees["tensor_parallel"], degrees["pipeline_parallel"], getattr(strategy, "expert_parallel", 1),
              degrees.get("context_parallel", 1))
    if setting is None:
        return eligible and all(d == 1 for d in others)
    return bool(setting) and eligible


def compile_decision(trainer, model, degrees: dict, compile: Optional[Union[bool, str]] = None,
                     missing: Optional[str] = "lookup") -> CompileDecision:
    """trainer.compile (or `compile`) resolved for this run (compile_policy.decide, which `missing` is passed to):
    "auto" weighs each process's training FLOPs, known when `model` is given with its vocabulary size. `degrees`:
    the plan's (or the dict of them plan_from resolves)."""
    setting = trainer.compile if compile is None else compile
    if setting == "auto" and model is not None and model.moe is not None:
        return CompileDecision(False, "model.moe is set: its routing has data-dependent shapes, so "
                                      "trainer.compile=auto runs it eager")
    flops = None
    if model is not None and model.vocab_size is not None:
        from lit_pretrain.model.shapes import flops_per_token  # pure arithmetic, no torch

        # context-parallel ranks split their replica's tokens too
        replicas = degrees["data_parallel_replicate"] * degrees["data_parallel_shard"] * degrees.get(
            "context_parallel", 1)
        # each process's share of the global batch (planning/batch.py: null is one micro-batch of one process)
        tokens = (trainer.tokens_per_step or trainer.micro_batch_size * model.seq_len) // replicas
        flops = run_flops(trainer.max_steps, tokens, flops_per_token(model))
    return decide(setting, flops, degrees["tensor_parallel"], degrees["pipeline_parallel"], missing)


def check_plan(plan: ParallelPlan, trainer, model=None, vocab_from: Optional[str] = None) -> None:
    t, p = plan.tensor_parallel, plan.pipeline_parallel
    if plan.data_parallel_shard > 1 and plan.zero_stage == 0:
        raise ConfigError(f"strategy.data_parallel_shard={plan.data_parallel_shard} shards model state across "
                          "data-parallel ranks, but strategy.zero_stage=0 shards nothing: set strategy.zero_stage "
                          "to 1, 2 or 3, or data_parallel_shard=1")
    if plan.zero_stage == 1 and (t > 1 or p > 1 or plan.data_parallel_replicate > 1):
        raise ConfigError("strategy.zero_stage=1 is PyTorch's ZeroRedundancyOptimizer, which partitions whole tensors "
                          "over one group of data-parallel (x context-parallel) ranks and cannot see tensor-parallel "
                          "shards, pipeline stages or replica groups: with tensor_parallel, pipeline_parallel or "
                          "data_parallel_replicate > 1 use zero_stage=2 (FSDP2 shards the same optimizer state, "
                          "and gradients too)")
    if plan.uses_fsdp and trainer.precision not in FSDP_PRECISIONS:
        raise ConfigError(f"trainer.precision={trainer.precision} is not supported with strategy.zero_stage="
                          f"{plan.zero_stage} (FSDP2 under Lightning's ModelParallelStrategy): choose one of "
                          f"{', '.join(FSDP_PRECISIONS)}")
    if plan.mixed_precision_policy and (t > 1 or p > 1 or plan.expert_parallel > 1):
        raise ConfigError("strategy.mixed_precision_policy=true (FSDP2 gathering bf16 parameters) is built and "
                          "tested for ZeRO-2/3 and HSDP only, not yet with tensor, pipeline or expert parallelism: "
                          "leave strategy.mixed_precision_policy=null (the autocast path there) or set it to false")
    if plan.sequence_parallel and t == 1:
        raise ConfigError("strategy.sequence_parallel=true shards the norms along the sequence across the "
                          "tensor-parallel group: it needs strategy.tensor_parallel > 1")
    if plan.compile and (t > 1 or p > 1):
        raise ConfigError("trainer.compile=true is not supported with tensor or pipeline parallelism (our tensor-"
                          "parallel layers call process-group collectives inside the block, which a fullgraph "
                          "compile of the block cannot trace; pipeline stages run under torch's schedule): set "
                          "trainer.compile=false, or use data parallelism and ZeRO stages, which compile")
    if p > 1:
        _check_pipeline(plan, trainer, model)
    if plan.expert_parallel > 1:
        _check_expert_parallel(plan, model)
    if plan.context_parallel > 1:
        _check_context_parallel(plan, model)
    if model is not None:
        _check_model(plan, trainer, model, vocab_from)


def _check_pipeline(plan: ParallelPlan, trainer, model) -> None:
    p, v, m = plan.pipeline_parallel, plan.stages_per_rank, plan.micro_batches
    if plan.schedule == "interleaved_1f1b" and v < 2:
        raise ConfigError(f"strategy.pipeline.schedule=interleaved_1f1b needs strategy.pipeline.stages_per_rank >= 2 "
                          f"(it is {v}): set it to 2, or choose schedule 1f1b")
    if plan.schedule != "interleaved_1f1b" and v != 1:
        raise ConfigError(f"strategy.pipeline.stages_per_rank={v} needs strategy.pipeline.schedule=interleaved_1f1b "
                          f"({plan.schedule} runs one stage per rank): set stages_per_rank=1")
    if plan.schedule != "gpipe" and m < p:
        raise ConfigError(f"strategy.pipeline.micro_batches={m} is fewer than the strategy.pipeline_parallel={p} "
                          f"stages, which {plan.schedule} refuses: raise micro_batches to at least pipeline_parallel, "
                          "or choose schedule gpipe")
    if trainer.micro_batch_size % m:
        raise ConfigError(f"trainer.micro_batch_size={trainer.micro_batch_size} does not divide into "
                          f"strategy.pipeline.micro_batches={m} equal micro-batches: choose a micro_batch_size that "
                          "is a multiple of micro_batches")
    if model is not None and model.n_layers < p * v:
        raise ConfigError(f"model.n_layers={model.n_layers} is fewer than the {p * v} pipeline stages "
                          f"(strategy.pipeline_parallel={p} x strategy.pipeline.stages_per_rank={v}): every stage "
                          "needs a block; lower pipeline_parallel or add layers")


def _check_context_parallel(plan: ParallelPlan, model) -> None:
    """What strategy.context_parallel composes with (tests/parallel/test_mesh_parallel.py checks each against one
    process): DDP replicas, ZeRO 1/2/3 (ZeRO-1: ZeroRedundancyOptimizer over data_parallel_shard x context_parallel, the
    gradients all-reduced over both as DDP's; its refusals with replicas, tensor, pipeline and expert parallelism
    hold here too), HSDP, tensor parallelism with and without sequence parallelism, pipeline parallelism,
    document masking; model.moe, dropless, with and without expert parallelism (tests/parallel/test_moe_mesh.py: the
    routing counts summed over the group, parallel/moe_mesh.py install_global_counts; experts split over
    data-parallel x context-parallel ranks, parallel/expert.py)."""
    c = plan.context_parallel
    if plan.compile:
        raise ConfigError(f"trainer.compile=true is not supported with strategy.context_parallel={c} (the compiled "
                          "forward and loss run the whole window on one process): set trainer.compile=false")
    if plan.activation_checkpointing == "selective":
        raise ConfigError(f"strategy.activation_checkpointing=selective with strategy.context_parallel={c} is not "
                          "supported yet (neither its op policy over the gathered keys and values nor its planner "
                          "rows are tested under context parallelism): use full, which is")
    if plan.mixed_precision_policy:
        raise ConfigError(f"strategy.mixed_precision_policy=true with strategy.context_parallel={c} is not tested "
                          "yet: leave strategy.mixed_precision_policy=null (the autocast path there) or false")
    if model is None:
        return
    if plan.float8 is not None:
        raise ConfigError(f"trainer.float8 with strategy.context_parallel={c} is not supported (not validated: no fp8 "
                          "parity test under context parallelism): set trainer.float8=null or "
                          "strategy.context_parallel=1")
    if model.moe is not None and model.moe.capacity_factor is not None:
        raise ConfigError(f"model.moe.capacity_factor={model.moe.capacity_factor} with strategy.context_parallel={c} "
                          "is not supported: each rank would cap its experts over its own part of the window, so "
                          "which tokens are dropped would depend on the chunking (measured: the routing parts from "
                          "one process's after a step); set model.moe.capacity_factor=null (dropless)")
    split = 2 * c * (plan.tensor_parallel if plan.sequence_parallel else 1)
    if model.seq_len % split:
        under = f" x strategy.tensor_parallel={plan.tensor_parallel} (sequence_parallel)" \
            if plan.sequence_parallel else ""
        raise ConfigError(f"model.seq_len={model.seq_len} is not divisible by 2 x strategy.context_parallel={c}"
                          f"{under} = {split}: each context-parallel rank computes 2 of 2c equal chunks of the "
                          f"window; choose a model.seq_len that is a multiple of {split}")


def _check_model(plan: ParallelPlan, trainer, model, vocab_from: Optional[str] = None) -> None:
    t = plan.tensor_parallel
    if model.moe is not None:
        _check_moe(plan, model)
    if model.qk_norm and model.qk_norm_scope == "projection" and t > 1:
        raise ConfigError(f"model.qk_norm_scope=projection normalizes over all heads of q and k, which "
                          f"strategy.tensor_parallel={t} splits across ranks: set qk_norm_scope=head or "
                          "tensor_parallel=1")
    if model.attention == "mla" and plan.sequence_parallel:
        raise ConfigError("strategy.sequence_parallel=true with model.attention=mla: the latent attention's "
                          "replicated down-projections would see only this rank's heads' gradient (not tested); set "
                          "strategy.sequence_parallel=false")
    if model.n_heads % t:
        raise ConfigError(f"model.n_heads={model.n_heads} is not divisible by strategy.tensor_parallel={t}: each "
                          "tensor-parallel rank holds whole heads; choose a tensor_parallel that divides n_heads")
    if model.kv_heads % t:
        raise ConfigError(f"model.n_kv_heads={model.kv_heads} is not divisible by strategy.tensor_parallel={t}: each "
                          "tensor-parallel rank holds whole key/value heads (those its query heads read); choose a "
                          "tensor_parallel that divides n_kv_heads, or more n_kv_heads")
    if model.hidden_dim % t:
        raise ConfigError(f"the MLP width (model.d_ff, here {model.hidden_dim}) is not divisible by "
                          f"strategy.tensor_parallel={t}: set model.d_ff to a multiple of {t}")
    check_vocab(model.vocab_size, t, vocab_from)
    if plan.sequence_parallel and model.seq_len % t:
        raise ConfigError(f"model.seq_len={model.seq_len} is not divisible by strategy.tensor_parallel={t}: "
                          "sequence parallelism gives each tensor-parallel rank seq_len / tensor_parallel positions; "
                          "choose a seq_len that is a multiple of tensor_parallel")
    if plan.float8 is not None:
        from lit_pretrain.planning.float8_policy import check_float8

        check_float8(plan, trainer, model)


def check_vocab(vocab_size, t: int, vocab_from: Optional[str] = None) -> None:
    """The embedding and head split their rows over the tensor-parallel ranks (parallel/vocab.py): V divides by t.
    Checked when the config loads, and again for model.vocab_size=null once the tokenizer gives the size.
    `vocab_from` says where a null model.vocab_size took V: "data.vocab_size" (the tokenizer's target, at load) or
    "tokenizer" (the prepared tokenizer's own size, in train); None: model.vocab_size itself."""
    if vocab_size is not None and t > 1 and vocab_size % t:
        padded = -(-vocab_size // t) * t
        given = {None: f"model.vocab_size={vocab_size}",
                 "data.vocab_size": f"model.vocab_size=null takes data.vocab_size={vocab_size} (the tokenizer's "
                                    "target size), which",
                 "tokenizer": f"model.vocab_size=null takes the tokenizer's {vocab_size} tokens, which"}[vocab_from]
        raise ConfigError(f"{given} is not divisible by strategy.tensor_parallel={t}: the embedding and output head "
                          "are split along the vocabulary across tensor-parallel ranks; set model.vocab_size to a "
                          f"multiple of {t} at least as large, such as {padded} (the extra rows are never a target; "
                          f"Megatron-LM pads to a multiple of 128 x {t})")


def _check_expert_parallel(plan: ParallelPlan, model) -> None:
    ep, d = plan.expert_parallel, plan.data_parallel * plan.context_parallel
    if model is not None and model.moe is None:
        raise ConfigError(f"strategy.expert_parallel={ep} splits a mixture of experts, but model.moe is null: set "
                          "model.moe or strategy.expert_parallel=1")
    if d % ep:
        raise ConfigError(f"strategy.expert_parallel={ep} does not divide the {d} data-parallel ranks "
                          f"(data_parallel_replicate x data_parallel_shard x context_parallel): expert groups are "
                          f"made of the ranks that route different tokens; choose an expert_parallel that divides {d}")
    if plan.zero_stage == 1:
        raise ConfigError(f"strategy.zero_stage=1 (ZeroRedundancyOptimizer) partitions whole tensors over all "
                          "data-parallel ranks and broadcasts each from its owner, which would overwrite the experts "
                          f"that strategy.expert_parallel={ep} keeps apart on each rank: use zero_stage=2 (FSDP2 "
                          "shards the same optimizer state, the experts' over their own data-parallel group) or 0")
    if model is not None and model.moe.num_experts % ep:
        raise ConfigError(f"model.moe.num_experts={model.moe.num_experts} is not divisible by "
                          f"strategy.expert_parallel={ep}: each rank owns an equal share of the experts")




def _check_moe(plan: ParallelPlan, model) -> None:
    """What model.moe composes with: one process, DDP, ZeRO 1-3, HSDP, tensor parallelism (with sequence
    parallelism) and pipeline parallelism (parallel/moe_mesh.py; tests/parallel/test_moe_parallel.py and
    tests/parallel/test_moe_mesh.py check parity with one process). Under tensor parallelism the router is replicated,
    each routed expert split along its hidden size and the shared experts like the dense MLP, whole units per rank."""
    t, moe = plan.tensor_parallel, model.moe
    shared = moe.num_shared_experts * model.d_ff_expert
    if t > 1 and shared % t:
        raise ConfigError(f"model.moe.num_shared_experts x d_ff_expert = {shared} shared-expert units do not divide "
                          f"over strategy.tensor_parallel={t} ranks (they are split like the dense MLP): choose a "
                          f"model.moe.d_ff_expert or num_shared_experts whose product is a multiple of {t}")
    width = model.d_ff_expert
    if t > 1 and (width % t or width // t % 8):
        # 8: the grouped matmul's 16-byte rows (GPTConfig.check), now of each rank's slice
        raise ConfigError(f"model.moe.d_ff_expert={width} (null: model.d_ff) does not split over strategy."
                          f"tensor_parallel={t} ranks into slices of a multiple of 8 units (each rank holds a slice "
                          f"of every routed expert's hidden size, and the grouped matmul needs 16-byte rows): choose "
                          f"a d_ff_expert that is a multiple of {8 * t}")
    if plan.compile:
        raise ConfigError("model.moe with trainer.compile=true is not supported yet (the routing's data-dependent "
                          "shapes, argsort and bincount break the block's full graph): set trainer.compile=false")


def sized_model(config):
    """config.model with its vocabulary size, taken from data.vocab_size (the tokenizer's target size) until the
    prepared tokenizer's own replaces it (train.resolve_vocab): what the run's FLOPs are estimated with."""
    from dataclasses import replace

    model = config.model
    return model if model.vocab_size is not None else replace(model, vocab_size=config.data.vocab_size)


def build_plan(config) -> ParallelPlan:
    """The plan of a whole config (schema.Config): `show` and `train` both call this when the config loads. It
    refuses a layout that cannot split the global batch (planning/batch.py) as well."""
    plan = plan_from(config.strategy, config.trainer, sized_model(config), config.trainer.compile,
                     vocab_from=None if config.model.vocab_size is not None else "data.vocab_size")
    if config.data.document_masking and plan.pipeline_parallel > 1:
        raise ConfigError(f"data.document_masking=true is not supported with strategy.pipeline_parallel="
                          f"{plan.pipeline_parallel}: the pipeline stages call the blocks without the document mask "
                          "and per-document positions; set data.document_masking=false or pipeline_parallel=1")
    global_batch(config.trainer, config.model.seq_len, plan)
    return plan
