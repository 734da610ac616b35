"""One rank of a run simulated on torch's fake process group: the run's own plan applied by the one `apply_plan` on
the meta device, materialized with tensors that hold no memory, then training steps through the module's own pieces
(ParallelModel.losses, the plan's gradient sync, the step guard's clipping, the run's optimizer) under the memory
tracker and the collective counter.

The Lightning Trainer does not run here (its strategies start real process groups and move the module to a real
device), so this drives what it calls, in its order: PretrainModule.on_train_batch_start's zero_grad, the training
step's `losses`, the backward unless the pipeline schedule ran it, MeshStrategy's `sync_gradients` after the
last micro-batch, configure_gradient_clipping's `step_guard.clip`, the optimizer's step. What differs from a GPU
run is listed in docs/large-runs.md: the step runs on the CPU's autocast op list, without torch.compile.
"""

import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from lit_pretrain.internals import (
    dispatch_mode_class,
    fake_tensor_mode,
    init_fake_process_group,
    memory_tracker,
    peak_by_kind,
)
from lit_pretrain.simulate.collectives import CollectiveCounter


@dataclass
class RankResult:
    rank: int
    coordinates: Dict[str, int]
    """This rank's place on each mesh dimension (pipeline stage, replica, shard, context, tensor rank)."""
    peak: Dict[str, int]
    """Bytes by kind (MemTracker's: Parameter, Buffer, Gradient, Activation, Temp, Optstate, Other; and "Total") at
    the peak of the simulated steps (the memory tracker's snapshot)."""
    state: Dict[str, int]
    """param_bytes, grad_bytes, optimizer_bytes this rank holds after the step (parallel/memory.rank_state_bytes:
    what the memory callback reports on a real run)."""
    collectives: Dict[Tuple[str, str], List[int]]
    """{(kind, group): [calls, bytes]} of one optimizer step, every micro-batch of its accumulation counted."""
    micro_batches: int
    """Micro-batches of one optimizer step (the accumulation); `simulated` of them ran."""
    simulated: int
    seconds: float
    groups: List[str] = field(default_factory=list)
    """The process groups of this rank's mesh that formed: "dimension (ranks)"."""
    checkpoint: Dict[str, tuple] = field(default_factory=dict)
    """{key: (global shape, bytes)} of what this rank's first sharded save writes (simulate/start_check.py)."""
    notes: List[str] = field(default_factory=list)


def accumulation(config) -> int:
    from lit_pretrain.planning.batch import global_batch

    return global_batch(config.trainer, config.model.seq_len, config.plan).accumulation


def mesh_coordinates(plan, rank: int) -> Dict[str, int]:
    """{mesh dimension: index} of global `rank` on the plan's mesh (tensor ranks innermost, parallel/mesh.py)."""
    from lit_pretrain.planning.plan import MESH_DIMS

    out, rest = {}, rank
    for name, size in reversed(list(zip(MESH_DIMS, plan.mesh_shape))):
        out[name] = rest % size
        rest //= size
    return dict(reversed(list(out.items())))


def group_labels(mesh) -> Dict[Tuple[int, ...], str]:
    """{ranks of each group of this rank: the mesh dimension(s) it spans}, for the collective counter's report."""
    labels: Dict[Tuple[int, ...], str] = {}
    if mesh is None:
        return labels
    for name in mesh.mesh_dim_names:
        group = mesh.get_group(name)
        labels.setdefault(tuple(dist.get_process_group_ranks(group)), name)
    labels.setdefault(tuple(range(dist.get_world_size())), "world")
    return labels


def build(config, plan, device: str = "meta"):
    """(gpt, ParallelModel, mesh) of this process's rank (its process group initialized), built on `device` ("meta":
    no memory, made fake afterwards; "cpu": a real run's, tests/simulate/) and wrapped by `apply_plan` as
    PretrainModule.configure_model wraps it (our mesh, or the data-parallel mesh Lightning's FSDP strategy builds)."""
    from torch.distributed.device_mesh import init_device_mesh

    from lit_pretrain.model.gpt import GPT
    from lit_pretrain.parallel.apply import apply_plan
    from lit_pretrain.parallel.mesh import build_mesh
    from lit_pretrain.planning.plan import sized_model

    torch.manual_seed(0)
    with torch.device(device):
        gpt = GPT(sized_model(config))
        if config.trainer.precision == "bf16-true":  # Lightning's bf16-true converts the module before the step
            gpt = gpt.to(torch.bfloat16)
    # The mesh's index tensors are real: built outside the fake mode (it refuses them), as is the wrapping.
    if plan.uses_mesh or (plan.world_size > 1 and not plan.uses_fsdp):
        # Without FSDP our mesh gives sync_gradients its data-parallel all-reduce, the bytes DDP's buckets move.
        mesh = build_mesh(plan, "cpu")
        par = apply_plan(gpt, plan, mesh)
    else:
        mesh = init_device_mesh("cpu", (plan.world_size,), mesh_dim_names=("data_parallel",)) \
            if plan.uses_fsdp else None
        par = apply_plan(gpt, plan, fsdp_mesh=mesh)
    if par.runner is not None:  # the stages' shapes from the config: the fake backend cannot carry their exchange
        par.runner.fix_stage_shapes(*pipeline_shapes(config, plan))
    return gpt, par, mesh


def pipeline_shapes(config, plan):
    """((B, T) of a batch, (shape, dtype) of one pipeline micro-batch's residual stream between stages, (shape,
    dtype) of its logits) for PipelineRunner.fix_stage_shapes: B/m rows of T/c positions (context parallelism), T/c/t
    under sequence parallelism (parallel/sequence.py), d_model wide; bf16 where the blocks' parameters are (bf16-true,
    or FSDP2's policy, whose cast_forward_inputs casts the stream: parallel/zero.py), else fp32 (the residual sum
    promotes autocast's bf16 outputs). The logits: V/t columns (parallel/vocab.py), bf16 under any bf16 precision."""
    model, rows = config.model, config.trainer.micro_batch_size
    vocab = model.vocab_size or config.data.vocab_size
    seq = model.seq_len // plan.context_parallel
    stream_seq = seq // plan.tensor_parallel if plan.sequence_parallel else seq
    bf16 = config.trainer.precision == "bf16-true" or plan.mixed_precision_policy
    stream = ((rows // plan.micro_batches, stream_seq, model.d_model), torch.bfloat16 if bf16 else torch.float32)
    logits_dtype = torch.bfloat16 if config.trainer.precision.startswith("bf16") else torch.float32
    return (rows, model.seq_len), stream, ((rows // plan.micro_batches, seq, vocab // plan.tensor_parallel),
                                           logits_dtype)


def batch_of(config, fake) -> Tuple[torch.Tensor, torch.Tensor]:
    model = config.model
    vocab = model.vocab_size or config.data.vocab_size
    with fake:  # (B, T) inputs and targets that hold no memory
        x = torch.randint(0, vocab, (config.trainer.micro_batch_size, model.seq_len))
        return x, torch.randint(0, vocab, x.shape)


def simulate_rank(config, rank: int = 0, steps: int = 1, max_micro_batches: int = 2) -> RankResult:
    """Simulate `steps` optimizer steps of global rank `rank` of `config` (config.Loaded, its plan) and return what
    it held and sent. Of each step's micro-batches `max_micro_batches` run: the first allocates what the later ones
    reuse (the gradients), the second is every later one's twin (step_collectives counts it for the rest)."""
    from lit_pretrain.optim.optimizers import build_optimizer

    started = time.perf_counter()
    plan = replace(config.plan, compile=False)
    notes = []
    if config.plan.compile:
        notes.append("trainer.compile: simulated eager (compile fuses temporaries; see docs/large-runs.md)")
    init_fake_process_group(rank, plan.world_size)
    try:
        gpt, par, mesh = build(config, plan)
        from lit_pretrain.simulate.routing import balance_routing

        if balance_routing(gpt):
            notes.append("model.moe: routing simulated balanced, N·k/E copies per expert (docs/large-runs.md)")
        fake = fake_tensor_mode()
        with fake:
            to_empty_keeping_ties(gpt)
            optimizer = build_optimizer(gpt, config.optim, plan.zero_stage, layout=par)
        x, y = batch_of(config, fake)
        accumulate = accumulation(config)
        run = min(accumulate, max_micro_batches)
        labels = group_labels(mesh)
        tracker = memory_tracker()
        tracker.track_external(gpt, optimizer)
        try:
            with fake, valueless(), tracker:
                parts = run_steps(config, par, gpt, optimizer, (x, y), steps, run, labels, tracker)
        except Exception as err:  # fake tensors hold no values: a shape that depends on them cannot be made
            if type(err).__name__ not in ("DynamicOutputShapeException", "DataDependentOutputException"):
                raise
            from lit_pretrain.errors import ConfigError

            raise ConfigError(f"{plan.describe()}: this layout cannot be simulated: {type(err).__name__} in "
                              f"{err.args[0] if err.args else err} (a shape that depends on tensor values, such as "
                              "the copies model.moe.capacity_factor keeps, which fake tensors do not hold; routing "
                              "itself is simulated balanced); check it with `lit-pretrain memory --run`") from None
        collectives = step_collectives(parts, accumulate, run)
        state = state_bytes(gpt, optimizer)
        peak = peak_by_kind(tracker)
        from lit_pretrain.simulate.start_check import save_layout

        checkpoint = save_layout(gpt, par, optimizer)
        groups = [f"{name} ({len(ranks)})" for ranks, name in labels.items()]
    finally:
        dist.destroy_process_group()
    return RankResult(rank, mesh_coordinates(plan, rank), peak, state, collectives, accumulate, run,
                      time.perf_counter() - started, groups, checkpoint, notes)


def to_empty_keeping_ties(gpt) -> None:
    """`to_empty` on the CPU, then every parameter shared by several modules (the tied embedding and head, which
    apply_plan may leave as one parameter in two places) shared again: to_empty replaces it in each module apart,
    and two copies would count its bytes, gradient and optimizer state twice."""
    owners: Dict[int, list] = {}
    for module in gpt.modules():
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module, name))
    gpt.to_empty(device="cpu")
    for places in owners.values():
        first, name = places[0]
        for module, other in places[1:]:
            setattr(module, other, getattr(first, name))


def valueless():
    """A dispatch mode answering a read of a tensor's value on the host (`.item()`, `float(t)`: aten's
    _local_scalar_dense) that the fake mode cannot answer with 1: fake tensors hold no values but the constants they
    were made from (AdamW's step count is one, and answered as it is). What the step reads there is a logged
    figure, never a shape (the MoE's split sizes are balanced before: simulate/routing.py). And fp32 grouped
    matmuls (`grouped_mm_like`)."""
    base = dispatch_mode_class()

    class Valueless(base):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._grouped_mm.default and args[0].dtype == torch.float32:
                return grouped_mm_like(*args, **(kwargs or {}))
            try:
                return func(*args, **(kwargs or {}))
            except Exception as err:
                if func is not torch.ops.aten._local_scalar_dense.default or \
                        type(err).__name__ != "DataDependentOutputException":
                    raise
                return True if args[0].dtype == torch.bool else 1

    return Valueless()


def grouped_mm_like(a: torch.Tensor, b: torch.Tensor, *rest, offs=None, **kwargs) -> torch.Tensor:
    """The output of `_grouped_mm(a, b, offs)` in fp32, which the CPU kernel computes (the routed experts,
    model/moe_kernels.py) and whose meta function refuses (it checks CUDA's bf16-only rule): a (M, K) @ b (L, K, N)
    -> (M, N); a (K, M) @ b (M, N), grouped along M -> (L, K, N), L = len(offs)."""
    offs = rest[0] if offs is None and rest else offs
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


def state_bytes(gpt, optimizer) -> Dict[str, int]:
    """parallel/memory.rank_state_bytes of fake tensors: the same distinct storages (a DTensor's local shard), told
    apart by their storage's identity, as fake storages have no address."""
    from lit_pretrain.internals import untyped_storage_identity
    from lit_pretrain.parallel.memory import is_fsdp, optimizer_state_tensors
    from lit_pretrain.parallel.mesh import local

    def size(tensors) -> int:
        seen = {}
        for t in tensors:
            storage = local(t).untyped_storage()
            seen[untyped_storage_identity(storage)] = storage.nbytes()
        return sum(seen.values())

    params, sharded = list(gpt.parameters()), is_fsdp(gpt)
    from torch.distributed.tensor import DTensor

    return {"param_bytes": size(p for p in params if isinstance(p, DTensor) or not sharded),
            "grad_bytes": size(p.grad for p in params if p.grad is not None),
            "optimizer_bytes": size(optimizer_state_tensors(optimizer))}


def run_steps(config, par, gpt, optimizer, batch, steps: int, run: int, labels, tracker=None) -> list:
    """`steps` optimizer steps of `run` micro-batches each, as the Trainer drives the module (the module docstring);
    returns the last step's CollectiveCounters: one per micro-batch, then the optimizer step's. On the fake backend
    under the simulation's modes, or on a real process group (tests/simulate/: the same counts)."""
    from lit_pretrain.optim.step_guard import StepGuard

    accumulate = accumulation(config)
    if par.runner is not None:
        par.runner.scale = 1.0 / accumulate  # MeshStrategy.setup
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.trainer.precision == "bf16-mixed")
    eod = 0 if config.data.document_masking else None  # the mask's bytes are the same for any end-of-document id
    guard = StepGuard(par.grad_norm)  # the module's guard, its norm the plan's (PretrainModule.on_fit_start)
    parts: List[CollectiveCounter] = []
    for step in range(steps):
        guard.begin(step)
        parts = []
        optimizer.zero_grad()  # PretrainModule.on_train_batch_start, an accumulation's first micro-batch
        for _ in range(run):
            if tracker is not None:
                tracker.reset_mod_stats()  # its per-module stats allow one forward each; the peak is kept
            with CollectiveCounter(labels) as counter, autocast:
                out = par.losses(batch, config.optim.z_loss, eod, training=True)
                if not par.runs_backward:
                    (out.trained / accumulate).backward()  # Lightning's backward of an accumulated micro-batch
            parts.append(counter)
        with CollectiveCounter(labels) as counter:
            par.sync_gradients()  # MeshStrategy.optimizer_step's closure (a no-op without our mesh)
            guard.clip(gpt.parameters(), config.optim.grad_clip_norm)  # configure_gradient_clipping
            optimizer.step()
        parts.append(counter)
    return parts


def step_collectives(parts: List[CollectiveCounter], accumulate: int, run: int) -> Dict[Tuple[str, str], List[int]]:
    """One step's collectives from its counted parts: the `run` micro-batches simulated, the last standing for
    itself and the accumulation's other accumulate - run, then the optimizer step's own."""
    out: Dict[Tuple[str, str], List[int]] = {}
    weights = [1] * (run - 1) + [accumulate - run + 1] + [1]
    for counter, weight in zip(parts, weights):
        for key, (calls, size) in counter.counts.items():
            entry = out.setdefault(key, [0, 0])
            entry[0] += weight * calls
            entry[1] += weight * size
    return out


def ranks_to_simulate(plan, choice: str) -> List[int]:
    """--ranks: "0" (one rank: the data-parallel ranks are symmetric), "corners" (one rank per pipeline stage and
    per expert-parallel group position, whose layers and experts differ, and the last rank), "all", or a comma
    list of ranks."""
    world = plan.world_size
    if choice == "all":
        return list(range(world))
    if choice == "corners":
        per_stage = world // plan.pipeline_parallel
        ranks = {stage * per_stage for stage in range(plan.pipeline_parallel)}
        ranks |= {stage * per_stage + per_stage - 1 for stage in range(plan.pipeline_parallel)}
        if plan.expert_parallel > 1:  # expert groups run along the data-parallel ranks (parallel/expert.py)
            step = plan.context_parallel * plan.tensor_parallel
            ranks |= {i * step for i in range(min(plan.expert_parallel, per_stage // step))}
        return sorted(ranks)
    ranks = [int(r) for r in choice.split(",")]
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        from lit_pretrain.errors import ConfigError

        raise ConfigError(f"--ranks {choice}: rank(s) {bad} are outside the world of {world} ranks; give ranks in "
                          f"0..{world - 1}, 'corners' or 'all'")
    return ranks

