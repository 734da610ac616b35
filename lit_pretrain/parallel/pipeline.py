"""Pipeline parallelism: each pipeline rank keeps a contiguous slice of the blocks (balanced by parameter count,
layout.balanced_stages), the embedding on the first stage, the final norm and head on the last, and
torch.distributed.pipelining's schedules (GPipe, 1F1B, interleaved 1F1B) push micro-batches through them.

The GPT is pruned in place, not rebuilt: blocks other ranks hold become nn.Identity, so the parameters this rank
keeps have the single-process names (`blocks.5.attn.wq.weight`), which the checkpoint code relies on. With tied
embeddings the last stage keeps its own copy of the embedding (tied to its head, as in the full model); the two
copies start equal and stay equal because their gradients are summed across the pipeline before each step
(`tied_grad_sync`), as Megatron-LM does for its word embeddings.

The schedule runs forward and backward itself, and its gradients add to those already in the parameters, as
`loss.backward()` adds to them: the loss function here divides by the number of micro-batches and by Lightning's
gradient-accumulation factor, so the sum equals the gradient of the mean loss in one process. The schedules are
built with scale_grads=False, as torchtitan builds them (its loss rescaled for accumulation instead): with the
default, the schedule divides every gradient of its stages in place after its step, including those of the
accumulation's earlier micro-batches, which would then have to be set aside around it. The two give the same bits
when the counts are powers of two (scaling by a power of two is exact in floating point). The loss is broadcast
from the last stage: every rank logs the global one.
"""

import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from lit_pretrain.model.gpt import softcap
from lit_pretrain.model.losses import IGNORE_INDEX, lm_losses
from lit_pretrain.model.mtp import mtp_tokens
from lit_pretrain.parallel.moe_mesh import install_pipeline_losses
from lit_pretrain.parallel.vocab import sequence_slices, split_cross_entropy, vocab_group
from lit_pretrain.planning.layout import balanced_stages, bubble_formula, stage_of_rank

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def block_param_counts(model: nn.Module) -> List[int]:
    return [sum(p.numel() for p in b.parameters()) for b in model.blocks]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def stage_bounds(model: nn.Module, n_stages: int) -> List[Tuple[int, int]]:
    """Blocks [start, end) of each stage, balanced by the parameters of the built modules (so a variant's block
    weighs what it holds); the first also holds the embedding, the last the norm and head (counted even when tied:
    its matmul costs the same)."""
    mtp = getattr(model, "mtp", None)  # model.mtp_depth: its modules run on the last stage, after the head
    return balanced_stages(block_param_counts(model), n_stages, first_extra=_numel(model.tok_embeddings),
                           last_extra=_numel(model.norm) + model.lm_head.weight.numel()
                           + (_numel(mtp) if mtp is not None else 0))


class StageForward(nn.Module):
    """One stage's forward: embedding (first), its blocks, final norm and head (last). Registers only the modules of
    this stage, so the schedule's gradient scaling touches each parameter once."""

    def __init__(self, gpt: nn.Module, start: int, end: int, first: bool, last: bool):
        super().__init__()
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in range(start, end))
        self.tok_embeddings = gpt.tok_embeddings if first else None
        self.norm = gpt.norm if last else None
        self.lm_head = gpt.lm_head if last else None
        # model.mtp_depth: the modules (and the embedding's copy they read) on the last stage, run by its loss
        self.mtp = getattr(gpt, "mtp", None) if last else None
        # registered, so FSDP shards it with the stage, where the head does not hold it (untied)
        self.mtp_embeddings = gpt.tok_embeddings if self.mtp is not None and not first and \
            not gpt.cfg.tie_embeddings else None
        self._gpt = [gpt]  # the RoPE tables, unregistered: the stage does not own them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gpt = self._gpt[0]
        # The whole tables, which attention cuts to its own length: under sequence parallelism x holds T/t
        # positions here while attention sees all T (parallel/sequence.py).
        cos, sin = gpt.rope_cos, gpt.rope_sin
        split = gpt.context_split
        if split is not None:  # context parallelism: this rank's positions of the window (parallel/context.py)
            first = self.tok_embeddings is not None  # the first stage reads the whole window's ids
            part = split.positions(x.shape[1] if first else split.window_of(x.shape[1]), x.device)  # (T/c,)
            cos, sin = cos[part], sin[part]  # (T/c, head_dim)
            x = x[:, part] if first else x
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)  # (B, T) ids -> (B, T, d_model)
        for block in self.blocks:
            x = block(x, cos, sin)  # (B, T, d_model)
        if self.lm_head is not None and not hidden_out(gpt.cfg):  # else the loss function applies the head
            x = softcap(self.lm_head(self.norm(x)), gpt.cfg.logit_softcap)  # (B, T, vocab_size), as GPT.head
        return x


def prune_to_stages(gpt: nn.Module, bounds: List[Tuple[int, int]], stages: List[int]) -> List[StageForward]:
    """Keep in `gpt` only what `stages` need (in place); return their forwards, in stage order."""
    n = len(bounds)
    keep = {i for s in stages for i in range(*bounds[s])}
    for i in range(len(gpt.blocks)):
        if i not in keep:
            gpt.blocks[i] = nn.Identity()
    first, last = 0 in stages, n - 1 in stages
    if last_holds_embedding(gpt.cfg) and last and not first:
        # The last stage's own copy of the embedding, kept tied to its head or read by model.mtp_depth's modules
        # (names and weight decay as in the full model).
        gpt.tok_embeddings.weight = nn.Parameter(gpt.tok_embeddings.weight.detach().clone())
        if gpt.cfg.tie_embeddings:
            gpt.lm_head.weight = gpt.tok_embeddings.weight
    elif not first:
        gpt.tok_embeddings = None
    if not last:
        gpt.norm = None
        if getattr(gpt, "mtp", None) is not None:
            gpt.mtp = None
        if not (gpt.cfg.tie_embeddings and first):
            gpt.lm_head = None
    return [StageForward(gpt, *bounds[s], first=s == 0, last=s == n - 1) for s in stages]


def tied_grad_sync(gpt: nn.Module, pp_group, fsdp_shard: Optional[Tuple[int, int]] = None,
                   tensor_parallel: int = 1) -> None:
    """Sum the tied embedding's gradient over the first and last stages (the other stages add zeros).

    Under tensor parallelism each rank sums its vocabulary rows (V/t of them, the same on both stages for the same
    tensor-parallel rank); under FSDP each rank its own shard of those (`fsdp_shard` = (rank, size) in the shard
    group): both stages' copies are sharded alike (dim 0, torch.chunk's split) over the same coordinates."""
    if not last_holds_embedding(gpt.cfg) or pp_group is None or dist.get_world_size(pp_group) == 1:
        return
    cfg = gpt.cfg
    emb = gpt.tok_embeddings
    if emb is not None:
        if emb.weight.grad is None:
            emb.weight.grad = torch.zeros_like(emb.weight)
        grad = emb.weight.grad
        grad = grad.to_local() if hasattr(grad, "to_local") else grad
    else:  # a middle stage: zeros shaped like this rank's share of the (vocab_size, d_model) matrix
        grad = torch.zeros(cfg.vocab_size // tensor_parallel, cfg.d_model)
        if fsdp_shard is not None:
            rank, size = fsdp_shard
            rows = grad.chunk(size, dim=0)
            grad = rows[rank].contiguous() if rank < len(rows) else grad[:0]
    dist.all_reduce(grad, group=pp_group)


def is_tied_copy(name: str, gpt: nn.Module, holds_first_stage: bool) -> bool:
    """The last stage's copy of the tied embedding: counted once (on the first stage) in global norms."""
    return bool(last_holds_embedding(gpt.cfg) and not holds_first_stage and name.endswith("tok_embeddings.weight"))


def last_holds_embedding(cfg) -> bool:
    """Whether the last stage holds a copy of the embedding: tied to its head (model.tie_embeddings), or read by
    model.mtp_depth's modules (DeepSeek-V3 §2.2: the embedding shared with the main model)."""
    return bool(cfg.tie_embeddings or cfg.mtp_depth)


def hidden_out(cfg) -> bool:
    """Whether the last stage returns its last block's output, the loss function applying the head: in chunks
    (model.loss_chunk_size) or with model.mtp_depth's modules after it."""
    return cfg.loss_chunk_size is not None or bool(cfg.mtp_depth)


class PipelineRunner:
    """Drives one schedule for one pipeline rank; `loss(batch)` runs forward (and backward when training)."""

    def __init__(self, gpt: nn.Module, pp_group, schedule: str, micro_batches: int, stages_per_rank: int = 1,
                 device: Optional[torch.device] = None):
        from torch.distributed.pipelining import PipelineStage

        if schedule not in SCHEDULES:
            raise ValueError(f"strategy.pipeline.schedule={schedule!r}: expected one of {', '.join(SCHEDULES)}")
        self.gpt, self.group, self.schedule_name = gpt, pp_group, schedule
        self.p, self.rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        self.m, self.v = micro_batches, stages_per_rank
        n_stages = self.p * self.v
        self.bounds = stage_bounds(gpt, n_stages)
        self.stage_ids = stage_of_rank(self.rank, self.p, self.v)
        self.holds_first, self.holds_last = 0 in self.stage_ids, n_stages - 1 in self.stage_ids
        self.forwards = prune_to_stages(gpt, self.bounds, self.stage_ids)
        device = device or torch.device("cpu")
        self.stages = [PipelineStage(f, s, n_stages, device, group=pp_group)
                       for f, s in zip(self.forwards, self.stage_ids)]
        self.scale = 1.0  # 1 / gradient-accumulation micro-batches, set by the strategy
        self.z_loss = 0.0  # optim.z_loss, set by PretrainModule.losses
        self.last_z_loss = torch.zeros(())  # the z-loss of the last `loss` call (0 with z_loss = 0)
        self.last_mtp_loss = torch.zeros(())  # model.mtp_depth's loss of the last training `loss` call
        self.training = True  # the MTP modules run in training only
        self._parts: list = []
        self.busy = 0.0
        for stage in self.stages:
            self._time(stage, "forward_one_chunk")
            self._time(stage, "backward_one_chunk")
            self._count_routing_in(stage)
        # model.moe: the auxiliary and z losses of this rank's MoE layers enter backward through their outputs
        # (parallel/moe_mesh.py, Megatron-LM's MoEAuxLossAutoScaler), scaled as the task loss is.
        install_pipeline_losses(gpt, lambda: self.scale / self.m)
        self._schedules = {}
        self.last_idle_fraction: Optional[float] = None

    def refresh_blocks(self) -> None:
        """Point each stage's modules at the GPT's current ones (activation checkpointing replaces block objects in
        `gpt.blocks` by their wrappers after the split; tensor parallelism the embedding and head by their
        vocabulary-parallel versions)."""
        n_stages = self.p * self.v
        for forward, s in zip(self.forwards, self.stage_ids):
            start, end = self.bounds[s]
            for j, i in enumerate(range(start, end)):
                forward.blocks[j] = self.gpt.blocks[i]
            if s == 0:
                forward.tok_embeddings = self.gpt.tok_embeddings
            if s == n_stages - 1:
                forward.lm_head = self.gpt.lm_head

    def _count_routing_in(self, stage) -> None:
        """model.moe: only the micro-batches' forwards add to the routing counts (the bias update, the MoE monitor),
        not torch's shape-inference forward of the schedule's first step, which runs the first stage on a real
        micro-batch and the others on uninitialized tensors."""
        from lit_pretrain.model.moe import moe_layers

        layers = moe_layers(stage.submod)
        if not layers:
            return
        for layer in layers:
            layer.count_routing = False
        inner = stage.forward_one_chunk

        def counted(*args, **kwargs):
            for layer in layers:
                layer.count_routing = True
            try:
                return inner(*args, **kwargs)
            finally:
                for layer in layers:
                    layer.count_routing = False

        stage.forward_one_chunk = counted

    def _time(self, stage, method: str) -> None:
        """Count the seconds this rank computes (stage forward and backward); the rest of a step is waiting."""
        inner = getattr(stage, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - start

        setattr(stage, method, timed)

    def _loss_fn(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # fp32 cross-entropy (and optim.z_loss) as in PretrainModule.losses; scaled so gradients match Lightning's
        # accumulation. The parts are kept apart for logging: the schedule sees only their sum.
        # Under tensor parallelism logits are this rank's vocabulary columns: the loss reduces over the group.
        split = self.gpt.context_split
        cfg, mtp_loss = self.gpt.cfg, None
        if hidden_out(cfg):  # `logits` is the last block's output: the head (in chunks) and the MTP modules here
            from lit_pretrain.parallel.batch_losses import output_losses

            T = target.shape[1]  # the window's (the stages have no document masking: positions 0..T-1)
            part = slice(0, T) if split is None else split.positions(T, target.device)
            rope = (self.gpt.rope_cos[part], self.gpt.rope_sin[part], None)
            mtp = [mtp_tokens(None, target, k) for k in range(1, cfg.mtp_depth + 1)] if self.training else []
            out = output_losses(self.gpt, logits, rope, target, self.z_loss, mtp,
                                split_cross_entropy(vocab_group(self.gpt)), split, cfg.loss_chunk_size,
                                sequence_slices(self.gpt))
            (task, z), mtp_loss = out[:2], (out[2] if mtp else None)
            target = target if split is None else split.local(target)
        elif split is not None:  # context parallelism: this rank's positions, the group's count (parallel/context.py)
            from lit_pretrain.parallel.context import context_losses

            task, z = context_losses(logits, split.local(target), split.group, self.z_loss,
                                     split_cross_entropy(vocab_group(self.gpt)))
            target = split.local(target)
        else:
            task, z = lm_losses(logits, target, self.z_loss, split_cross_entropy(vocab_group(self.gpt)))
        predicted = (target != IGNORE_INDEX).sum().to(task.dtype)  # validation weighs micro-batches by it
        zero = torch.zeros(())
        self._parts.append(torch.stack([task.detach(), z.detach() if z is not None else zero, predicted,
                                        mtp_loss.detach() if mtp_loss is not None else zero]))
        trained = task if z is None else task + z
        if mtp_loss is not None:  # DeepSeek-V3 eq. 25, as batch_losses.forward_then_loss adds it
            trained = trained + cfg.mtp_loss_weight * mtp_loss
        return trained * (self.scale / self.m)  # the mean over micro-batches (see above)

    def _schedule(self):
        if self.scale not in self._schedules:
            from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

            if self.schedule_name == "interleaved_1f1b":
                sched = ScheduleInterleaved1F1B(self.stages, self.m, loss_fn=self._loss_fn, scale_grads=False)
            else:
                cls = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
                sched = cls(self.stages[0], self.m, loss_fn=self._loss_fn, scale_grads=False)
            self._schedules[self.scale] = sched
        return self._schedules[self.scale]

    def loss(self, batch, training: bool = True) -> torch.Tensor:
        """The global mean loss of `batch` on every pipeline rank; when training, gradients are accumulated into
        this rank's parameters (the caller must not call backward)."""
        x, y = batch
        losses: list = []
        args = (x,) if self.holds_first else ()
        target = y if self.holds_last else None
        sched = self._schedule()
        self.busy = 0.0
        self._parts = []
        self.training = training
        start = time.perf_counter()
        if training:
            sched.step(*args, target=target, losses=losses)
        else:
            with torch.no_grad():
                sched.eval(*args, target=target, losses=losses)
        wall = time.perf_counter() - start
        out = torch.zeros(4)
        if self.holds_last:
            # The schedule's first step also calls the loss once for shape inference, before the micro-batches:
            # only the last len(losses) parts are the micro-batches' (task loss and z-loss, unscaled).
            parts = torch.stack(self._parts[-len(losses):])  # (micro-batches, 4): task, z-loss, predicted, MTP
            out[0], out[2] = parts[:, :2].mean(0)  # training: the mean of the micro-batches' means, as accumulation
            out[3] = parts[:, 3].mean()
            if not training:
                # Validation: the mean over the batch's predicted targets, as one process computes it (a padding
                # micro-batch of data/validation.py predicts nothing, and its NaN mean weighs 0).
                n = parts[:, 2]
                out[0] = (torch.where(n > 0, parts[:, 0], 0.0) * n).sum() / n.sum()
        out[1] = 1.0 - self.busy / wall if wall > 0 else 0.0
        # One all-reduce for all: the losses live on the last stage only (others add 0); the idle fraction is
        # averaged over the pipeline ranks.
        dist.all_reduce(out, group=self.group)
        if training:
            self.last_idle_fraction = float(out[1]) / self.p
        self.last_z_loss, self.last_mtp_loss = out[2], out[3]
        return out[0]

    def fix_stage_shapes(self, batch: Tuple[int, int], stream, logits) -> None:
        """Tell each stage the tensors it receives and sends (so the schedule's first step skips its shape exchange,
        internals.pipeline_stage_shapes): the first stage takes a micro-batch's ids, (B/m, T) int64; every other
        stage takes the residual stream, `stream` = (shape, dtype) of one micro-batch's (B/m, T', d_model) between
        blocks; the last stage gives `logits` = (shape, dtype), the others the stream."""
        from lit_pretrain.internals import pipeline_stage_shapes

        n_stages = self.p * self.v
        rows, seq = batch
        ids = torch.empty(rows // self.m, seq, dtype=torch.int64, device="meta")
        between = torch.empty(*stream[0], dtype=stream[1], device="meta", requires_grad=True)
        out = torch.empty(*logits[0], dtype=logits[1], device="meta", requires_grad=True)
        for stage, s in zip(self.stages, self.stage_ids):
            pipeline_stage_shapes(stage, (ids if s == 0 else between,), (out if s == n_stages - 1 else between,))

    @property
    def bubble_formula(self) -> float:
        return bubble_formula(self.p, self.m, self.v)
