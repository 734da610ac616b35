"""The compute-optimal ratio of a law in optimizer steps under a batch rule (scaling/steps_optimum.py), against the
closed form of the same minimization.

With the three parameter counts equal and T(N) = t0·N^gamma tokens a step, L(N, C) = E + A·N^-alpha +
B·(6·t0/C)^beta·N^((1+gamma)·beta); setting dL/dN = 0 gives
N* = (alpha·A / ((1+gamma)·beta·B·(6·t0/C)^beta))^(1/(alpha + (1+gamma)·beta)), and D*/N* = C / (6·N*^2). With
gamma = 0 and t0 = 1 (a step of one token, S = D) it is Hoffmann et al. 2022's eq. 4, ParametricLaw.compute_optimal.
"""

import math

import numpy as np
import pytest

from lit_pretrain.planning.laws import CHINCHILLA_APPROACH3, ParametricLaw
from lit_pretrain.scaling.steps_optimum import (
    batch_rule_tokens,
    grid_sizes,
    loss_along,
    optimal_tokens_per_param_in_steps,
    size_family,
)

LAW = ParametricLaw(E=0.6, A=57.5, B=19.7, alpha=0.29, beta=0.42)  # close to the fifth CPU grid's law in steps
SIZES = [(n, n, n) for n in (6.6e4, 1.3e5, 2.8e5, 5.2e5)]  # one count: total = law's N = non-embedding


def closed_form(law: ParametricLaw, flops: float, t0: float, gamma: float) -> float:
    k = (1 + gamma) * law.beta
    n = (law.alpha * law.A / (k * law.B * (6 * t0 / flops) ** law.beta)) ** (1 / (law.alpha + k))
    return flops / 6 / n / n


def test_a_step_of_one_token_is_hoffmanns_closed_form():
    # S = D: the law in steps is a law in tokens, and its optimum is eq. 4's, for Chinchilla's own law at 1e19 and
    # 1e21 FLOPs (two sizes whose three counts agree: the family is the identity there and past its ends)
    for flops in (1e19, 1e21):
        n, d = CHINCHILLA_APPROACH3.compute_optimal(flops)
        got = optimal_tokens_per_param_in_steps(CHINCHILLA_APPROACH3, flops, [(1e9, 1e9, 1e9), (7e10, 7e10, 7e10)],
                                                lambda n_ne: np.ones_like(np.asarray(n_ne, dtype=float)))
        assert got == pytest.approx(d / n, rel=1e-6)  # the refinement stops at |log N| within 1e-10


@pytest.mark.parametrize("flops,t0,gamma", [(1e13, 1024.0, 0.0), (1e13, 1.7, 2 / 3), (1e14, 1.7, 2 / 3),
                                            (3e12, 12.0, 0.4)])
def test_a_batch_that_grows_with_n_moves_the_optimum_as_the_closed_form_says(flops, t0, gamma):
    got = optimal_tokens_per_param_in_steps(LAW, flops, SIZES, lambda n: t0 * np.asarray(n, dtype=float) ** gamma)
    assert got == pytest.approx(closed_form(LAW, flops, t0, gamma), rel=1e-6)


def test_a_growing_batch_asks_for_more_tokens_per_parameter():
    # at equal C, a batch rule with gamma 2/3 makes a larger model take fewer steps, so the optimum is smaller and
    # trains on more tokens per parameter than under a fixed batch of the same size at the smallest model
    fixed = optimal_tokens_per_param_in_steps(LAW, 1e14, SIZES, lambda n: np.full_like(n, 1024.0))
    grows = optimal_tokens_per_param_in_steps(LAW, 1e14, SIZES, batch_rule_tokens(8, 6.6e4, 2 / 3, 128))
    assert grows > 2 * fixed


def test_the_optimum_minimizes_the_loss_along_a_family_whose_counts_differ():
    # total = non-embedding + a 1,024 x d tied embedding along d = 16 * layers, the law in non-embedding N: no closed
    # form; the returned ratio is the minimum of L along the interpolated family (1% either way in N is worse)
    sizes = [(0.75 * d ** 3 + 1024 * d, 0.75 * d ** 3, 0.75 * d ** 3) for d in (32, 48, 64, 80)]
    rule = batch_rule_tokens(8, 0.75 * 32 ** 3, 2 / 3, 128)
    flops = 1e14
    ratio = optimal_tokens_per_param_in_steps(LAW, flops, sizes, rule)
    n_opt = math.sqrt(flops / 6 / ratio)
    family = size_family(sizes)
    around = loss_along(LAW, flops, np.array([n_opt * 0.99, n_opt, n_opt * 1.01]), family, rule)
    assert around[1] < around[0] and around[1] < around[2]


def test_the_family_passes_through_the_sizes_and_extends_their_end_segments():
    family = size_family([(100.0, 50.0, 10.0), (400.0, 100.0, 40.0)])
    n_law, n_ne = family(np.array([100.0, 400.0, 1600.0, 25.0]))
    np.testing.assert_allclose(n_law, [50.0, 100.0, 200.0, 25.0])  # N_law ∝ N_total^(1/2) along the segment
    np.testing.assert_allclose(n_ne, [10.0, 40.0, 160.0, 2.5])
    with pytest.raises(ValueError, match="expected at least one"):
        size_family([(100.0, 0.0, 10.0)])


def test_no_interior_optimum_is_none():
    flat = ParametricLaw(E=1.0, A=1.0, B=1.0, alpha=0.0, beta=0.3)
    assert optimal_tokens_per_param_in_steps(flat, 1e14, SIZES, lambda n: 1024.0 + 0 * n) is None
    # an N term so weak that the optimum lies more than 10^3 beyond the smallest size: the loss rises from the first
    # point searched, reported as no optimum rather than the search's edge
    weak = ParametricLaw(E=1.0, A=1e-30, B=1e3, alpha=0.3, beta=0.3)
    assert optimal_tokens_per_param_in_steps(weak, 1e14, SIZES, lambda n: 1024.0 + 0 * n) is None


def test_grid_sizes_reads_each_size_once_under_the_laws_convention():
    rows = [{"params": 200, "non_embedding_params": 150, "head_params": 50},
            {"params": 200, "non_embedding_params": 150, "head_params": 50},
            {"params": 90, "non_embedding_params": 60, "head_params": 30}]
    assert grid_sizes(rows, lambda r: r["non_embedding_params"]) == [(90.0, 60.0, 60.0), (200.0, 150.0, 150.0)]
