"""apply_plan: the parallel plan (plan.py) applied to the plain GPT from outside, in one function."""

from typing import Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lit_pretrain.parallel.mesh import ParallelModel, fsdp_dims
from lit_pretrain.planning.plan import ParallelPlan


def apply_plan(gpt: nn.Module, plan: ParallelPlan, mesh: Optional[DeviceMesh] = None,
               fsdp_mesh: Optional[DeviceMesh] = None, device_type: Optional[str] = None) -> ParallelModel:
    """Wrap the GPT in place for this rank, in this order, and return it with its step collectives:

    1. pipeline split: keep this rank's stages' blocks (the rest become nn.Identity), so every later step touches
       only what this rank holds;
    2. tensor parallelism (and sequence parallelism): swap the planned linears for our column/row layers, on the
       plain module names (before any wrapper prefixes them), and split each routed expert along its width
       (parallel/expert_tensor.py); then expert parallelism: keep this rank's experts (of those slices) and give the
       MoE layers their all-to-all dispatch (parallel/expert.py); then context parallelism: the positions this rank
       computes and the attention over the group's gathered keys and values (parallel/context.py);
    3. activation checkpointing: wrap whole blocks (the TP layers' collectives are recomputed inside them), under
       the op policy when selective;
    4. compile (parallel/compile.py, `par.forward_losses`): on one process the whole forward and loss as one graph;
       with data parallelism, FSDP or checkpointing each block's forward (torchtitan's regional compile, inside its
       checkpoint wrapper) and the loss apart;
    5. FSDP2 (ZeRO stages 2 and 3; HSDP with replicas): each block, then the root — the GPT, or each pipeline
       stage's forward, whose hooks are the ones the schedule calls. Last, because it shards whatever parameters
       the steps before left (TP slices included) and its hooks must sit outside checkpointing and compile; under
       expert parallelism the experts apart, over their own data-parallel group; under context parallelism over
       data_parallel_shard x context_parallel (the ranks that hold the same weights). With
       plan.mixed_precision_policy (ZeRO 2/3 under bf16-mixed) FSDP2 gathers bf16 parameters and reduces fp32
       gradients (zero.py).

    `mesh`: our (pipeline, replicate, shard, tensor) mesh when plan.uses_mesh; else `fsdp_mesh`, the data-parallel
    mesh of Lightning's FSDP strategy (plain ZeRO 2/3). DDP and ZeRO-1 wrap later, in Lightning's DDPStrategy and
    the optimizer (under context parallelism: ParallelModel.sync_gradients on our mesh, and the optimizer).
    Idempotent: Lightning may call configure_model again (trainer.validate after fit).
    plan.float8 (trainer.float8) converts the blocks' linears to torchao's Float8Linear (parallel/float8.py) between
    steps 2 and 3, before any wrapper sees them, as torchtitan converts before parallelizing; `device_type`: where
    the step runs ("cuda": fp8 matmuls on the GPU; else emulated).
    """
    from lit_pretrain.parallel.activation_checkpointing import apply_activation_checkpointing
    from lit_pretrain.parallel.zero import shard_model

    existing = getattr(gpt, "_lit_pretrain_parallel", None)
    if existing is not None:
        return existing
    par = ParallelModel(gpt, plan, mesh)
    if plan.pipeline_parallel > 1:
        from lit_pretrain.parallel.pipeline import PipelineRunner

        par.runner = PipelineRunner(gpt, par.pp, plan.schedule, plan.micro_batches, plan.stages_per_rank)
    if plan.tensor_parallel > 1:
        from lit_pretrain.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(gpt, par.tp, sequence_parallel=plan.sequence_parallel)
        from lit_pretrain.parallel.expert_tensor import apply_expert_tensor_parallel

        apply_expert_tensor_parallel(gpt, par.tp)  # model.moe: each routed expert along its width
    if plan.expert_parallel > 1:  # after the pipeline split (this stage's layers), before checkpointing and FSDP
        from lit_pretrain.parallel.expert import apply_expert_parallel

        par.ep = apply_expert_parallel(gpt, plan, mesh.device_type if mesh is not None else "cpu")
    if plan.context_parallel > 1:  # after the pipeline split and tensor parallelism: the blocks this rank runs
        from lit_pretrain.parallel.context import install_context_parallel

        par.cp = install_context_parallel(gpt, par.cp_group, plan.tensor_parallel if plan.sequence_parallel else 1)
    if plan.float8 is not None:
        from lit_pretrain.parallel.float8 import convert_float8

        convert_float8(gpt, plan.float8, device_type or (mesh.device_type if mesh is not None else "cpu"))
    # model.moe: the counts' all-reduce (aux_loss_scope=global; context parallelism): a collective, all call it
    if plan.data_parallel > 1 or plan.context_parallel > 1:
        from lit_pretrain.parallel.moe_mesh import install_global_counts

        install_global_counts(gpt, plan)
    apply_activation_checkpointing(gpt, plan.activation_checkpointing, plan.activation_checkpointing_k,
                                   plan.activation_checkpointing_save_matmuls)
    if plan.compile:
        from lit_pretrain.parallel.compile import check_toolchain, compile_model

        check_toolchain()
        # One graph where nothing works per block: no FSDP2 (its hooks gather each block), no peers to overlap
        # with, no checkpoint wrappers (regional compile inside them is the composition torchtitan uses and tests).
        whole = plan.world_size == 1 and not plan.uses_fsdp and plan.activation_checkpointing == "none"
        par.forward_losses = compile_model(gpt, whole)
    if par.runner is not None:
        par.runner.refresh_blocks()
    if plan.uses_fsdp:
        if mesh is not None:
            fsdp_mesh = mesh[fsdp_dims(plan)]  # over data_parallel_shard x context_parallel under the latter
        if fsdp_mesh is None:
            raise ValueError(f"strategy.zero_stage={plan.zero_stage} needs a device mesh: run it under the strategy "
                             "build_strategy returns")
        roots = par.runner.forwards if par.runner is not None else [gpt]
        from lit_pretrain.parallel.zero import mixed_precision_policy

        policy = mixed_precision_policy() if plan.mixed_precision_policy else None
        for root in roots:
            shard_model(root, fsdp_mesh, plan.zero_stage, par.ep, policy)
        _retie(gpt)
    par.choose_losses()  # how a batch becomes losses on this layout (parallel/batch_losses.py)
    gpt._lit_pretrain_parallel = par
    return par


def one_process(gpt: nn.Module) -> ParallelModel:
    """The plain GPT as one process runs it, before any plan is applied (not registered on `gpt`, so apply_plan
    still applies the real one): the module's parallel model until configure_model runs, and for good where nothing
    calls that hook (load_from_checkpoint, a module used without a Trainer)."""
    return ParallelModel(gpt, ParallelPlan())


def _retie(gpt: nn.Module) -> None:
    """FSDP2 replaces a parameter on the modules under the root it shards; under pipeline parallelism a stage's
    root holds only one of the tied embedding and head, so point the other at the same (sharded) parameter."""
    if not gpt.cfg.tie_embeddings or gpt.tok_embeddings is None or gpt.lm_head is None:
        return
    if gpt.tok_embeddings.weight is not gpt.lm_head.weight:
        from torch.distributed.tensor import DTensor

        if isinstance(gpt.lm_head.weight, DTensor):
            gpt.tok_embeddings.weight = gpt.lm_head.weight
        else:
            gpt.lm_head.weight = gpt.tok_embeddings.weight
