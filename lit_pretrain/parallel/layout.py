"""The device mesh's shape as pure functions: layout checks, pipeline stage balance, the bubble formula.

Everything here runs before any process group exists, so an impossible layout fails at once with the config key
to change, instead of one rank failing inside a collective while its peers wait for the timeout (pipelining a batch
that does not divide into micro-batches hangs the other stage: shared/CPU-DISTRIBUTED.md, pitfall 9).
"""

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from lit_pretrain.errors import ConfigError

MESH_STRATEGIES = ("tensor", "pipeline")
MESH_DIMS = ("pipeline", "data_parallel", "tensor_parallel")  # outermost first: TP ranks are neighbours


@dataclass(frozen=True)
class Layout:
    data_parallel: int
    tensor_parallel: int
    pipeline_parallel: int


def uses_mesh(strategy) -> bool:
    return strategy.name in MESH_STRATEGIES


def check_layout(config, world_size: int) -> Layout:
    """(d, t, p) for `config` on `world_size` processes, or a ConfigError naming the key to change."""
    s, m = config.strategy, config.model
    t, p = s.tensor_parallel, s.pipeline_parallel
    if not uses_mesh(s):
        if t > 1 or p > 1:
            raise ConfigError(f"strategy.tensor_parallel={t} and strategy.pipeline_parallel={p} need "
                              f"strategy.name=tensor or pipeline (it is {s.name}): choose strategy=tensor or "
                              "strategy=pipeline")
        return Layout(world_size, 1, 1)
    if world_size % (t * p):
        raise ConfigError(f"trainer.devices x trainer.num_nodes = {world_size} processes is not a multiple of "
                          f"strategy.tensor_parallel x strategy.pipeline_parallel = {t} x {p}: the world size must "
                          "be data_parallel x tensor_parallel x pipeline_parallel; change trainer.devices")
    if m.n_heads % t:
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by strategy.tensor_parallel={t}: each "
                          "tensor-parallel rank holds whole heads; choose a tensor_parallel that divides n_heads")
    if m.hidden_dim % t:
        raise ConfigError(f"the MLP width (model.d_ff, here {m.hidden_dim}) is not divisible by "
                          f"strategy.tensor_parallel={t}: set model.d_ff to a multiple of {t}")
    if p > 1:
        pc = s.pipeline
        v = pc.stages_per_rank
        if pc.schedule == "interleaved_1f1b" and v < 2:
            raise ConfigError(f"strategy.pipeline.schedule=interleaved_1f1b needs strategy.pipeline.stages_per_rank "
                              f">= 2 (it is {v}): set it to 2, or choose schedule 1f1b")
        if pc.schedule != "interleaved_1f1b" and v != 1:
            raise ConfigError(f"strategy.pipeline.stages_per_rank={v} needs strategy.pipeline.schedule="
                              f"interleaved_1f1b ({pc.schedule} runs one stage per rank): set stages_per_rank=1")
        if pc.schedule != "gpipe" and pc.micro_batches < p:
            raise ConfigError(f"strategy.pipeline.micro_batches={pc.micro_batches} is fewer than the "
                              f"strategy.pipeline_parallel={p} stages, which {pc.schedule} refuses: raise "
                              "micro_batches to at least pipeline_parallel, or choose schedule gpipe")
        if m.n_layers < p * v:
            raise ConfigError(f"model.n_layers={m.n_layers} is fewer than the {p * v} pipeline stages "
                              f"(strategy.pipeline_parallel={p} x strategy.pipeline.stages_per_rank={v}): every "
                              "stage needs a block; lower pipeline_parallel or add layers")
        if config.trainer.micro_batch_size % pc.micro_batches:
            raise ConfigError(f"trainer.micro_batch_size={config.trainer.micro_batch_size} does not divide into "
                              f"strategy.pipeline.micro_batches={pc.micro_batches} equal micro-batches: choose a "
                              "micro_batch_size that is a multiple of micro_batches")
    return Layout(world_size // (t * p), t, p)


def balanced_stages(block_sizes: Sequence[int], n_stages: int, first_extra: int = 0,
                    last_extra: int = 0) -> List[Tuple[int, int]]:
    """Cut blocks into `n_stages` contiguous, non-empty [start, end) ranges minimizing the largest stage.

    A stage's size is its blocks' parameters, plus first_extra on the first stage (the embedding) and last_extra
    on the last (final norm and head). Exact: a dynamic program over (blocks used, stages used) finds the minimax
    value (the "linear partition" problem, Skiena, The Algorithm Design Manual §10.7); among optimal cuts the
    earliest stages take as many blocks as the optimum allows, so the answer is deterministic.
    """
    n = len(block_sizes)
    if not 1 <= n_stages <= n:
        raise ValueError(f"{n_stages} stages for {n} blocks: need 1 <= stages <= blocks")
    prefix = [0]
    for size in block_sizes:
        prefix.append(prefix[-1] + size)

    def cost(stage: int, a: int, b: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == n_stages - 1 else 0)
        return prefix[b] - prefix[a] + extra

    inf = float("inf")
    # best[k][i]: minimax of the first i blocks cut into k stages.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            best[k][i] = min(max(best[k - 1][j], cost(k - 1, j, i)) for j in range(k - 1, i))
    target = best[n_stages][n]
    # Greedy reconstruction: each stage grows while it stays within target and the rest remain feasible.
    # best_suffix[k][j]: minimax of blocks j.. cut into stages k..n_stages-1.
    suffix = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    suffix[n_stages][n] = 0
    for k in range(n_stages - 1, -1, -1):
        for j in range(n - (n_stages - k), -1, -1):
            suffix[k][j] = min(max(cost(k, j, i), suffix[k + 1][i]) for i in range(j + 1, n - (n_stages - k) + 2))
    bounds, start = [], 0
    for k in range(n_stages):
        end = max(i for i in range(start + 1, n - (n_stages - k - 1) + 1)
                  if cost(k, start, i) <= target and suffix[k + 1][i] <= target)
        bounds.append((start, end))
        start = end
    return bounds


def bubble_formula(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipeline step: (p-1)/(v·m + p-1) for p stages, m micro-batches, v stages per rank.

    GPipe (Huang et al. 2019, §2.3) and 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model
    Training on GPU Clusters", §2.2.1): the bubble is (p-1) micro-batch slots of forward and backward against m
    useful ones, so (p-1)/(m+p-1) of the step; interleaving v stages per rank shrinks the slots v-fold (§2.2.2).
    """
    return (p - 1) / (v * m + p - 1)


def stage_of_rank(pp_rank: int, p: int, v: int) -> List[int]:
    """Stage indices a pipeline rank holds: rank r holds r, r+p, r+2p, ... (torch's interleaved layout)."""
    return [pp_rank + k * p for k in range(v)]
