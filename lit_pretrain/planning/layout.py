"""Pipeline shapes as pure functions: stage balance, which stages a rank holds, the bubble formula. (The layout
checks are the plan's: planning/plan.py.)"""

from typing import List, Sequence, Tuple


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
