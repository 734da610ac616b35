"""The approach-3 fitter: its optimizer, recovery of a known law, the Chinchilla data as Epoch fitted it, frontier."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import approx_fprime

from lit_pretrain.errors import DataError
from lit_pretrain.planning import laws
from lit_pretrain.scaling import fit
from lit_pretrain.scaling.fit_runs import fit_sources
from lit_pretrain.scaling.lbfgs import minimize_rows
from lit_pretrain.scaling.points import load_points

CHINCHILLA_CSV = Path(__file__).parents[1] / "fixtures" / "chinchilla_svg_extracted_data.csv"


def test_batched_lbfgs_solves_rosenbrock_from_every_start():
    def rosenbrock(x, rows):
        f = 100 * (x[:, 1] - x[:, 0] ** 2) ** 2 + (1 - x[:, 0]) ** 2
        g = np.stack([-400 * x[:, 0] * (x[:, 1] - x[:, 0] ** 2) - 2 * (1 - x[:, 0]), 200 * (x[:, 1] - x[:, 0] ** 2)],
                     axis=1)
        return f, g

    starts = np.array([[-1.2, 1.0], [2.0, 2.0], [0.0, 0.0], [-3.0, -4.0]])
    x, f = minimize_rows(rosenbrock, starts, gtol=1e-10)
    np.testing.assert_allclose(x, 1.0, atol=1e-5)
    assert (f < 1e-10).all()


def test_objective_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    log_n, log_d = rng.uniform(15, 23, 50), rng.uniform(20, 27, 50)
    log_l = np.log(laws.EPOCH.loss(np.exp(log_n), np.exp(log_d))) + rng.normal(0, 2e-3, 50)
    theta = np.array([6.0, 7.5, 0.6, 0.33, 0.36])
    _, grad = fit.objective(theta, log_n, log_d, log_l, 1e-3)
    numeric = approx_fprime(theta, lambda t: fit.objective(t, log_n, log_d, log_l, 1e-3)[0], 1e-8)
    np.testing.assert_allclose(grad, numeric, rtol=1e-4, atol=1e-9)


def _synthetic(law, noise, seed=0):
    rng = np.random.default_rng(seed)
    n = np.exp(rng.uniform(math.log(1e7), math.log(1e10), 150))
    tokens_per_param = np.exp(rng.uniform(math.log(2), math.log(200), 150))
    d = n * tokens_per_param
    loss = law.loss(n, d) * np.exp(rng.normal(0, noise, n.size))
    return n, d, loss


def test_fitter_recovers_known_coefficients_from_noisy_points():
    known = laws.ParametricLaw(E=1.7, A=400.0, B=1500.0, alpha=0.34, beta=0.37)
    n, d, loss = _synthetic(known, noise=1e-3)  # 0.1% multiplicative noise, the size of Huber's delta
    got = fit.fit_parametric(n, d, loss, starts=fit.grid_starts()[::25])  # every 25th of Hoffmann et al.'s grid
    # Tolerances from the noise: with 150 points of 0.1% noise the bootstrap spread of alpha and beta is ~0.01
    # and of E ~0.01; A and B trade off against the exponents, so compare the compute-optimal split instead.
    assert got["alpha"] == pytest.approx(known.alpha, abs=0.03)
    assert got["beta"] == pytest.approx(known.beta, abs=0.03)
    assert got["E"] == pytest.approx(known.E, abs=0.03)
    assert got["a"] == pytest.approx(known.a, abs=0.02)
    fitted = laws.ParametricLaw.from_dict(got)
    assert fitted.loss(3e10, 6e11) == pytest.approx(known.loss(3e10, 6e11), rel=0.005)  # extrapolated 3x in N


@pytest.fixture(scope="module")
def chinchilla_fit():
    points = sorted(load_points([str(CHINCHILLA_CSV)]), key=lambda p: p["loss"])[:-5]  # Epoch drop the 5 highest
    n, d, loss = (np.array([p[k] for p in points]) for k in ("N", "D", "loss"))
    return n, d, loss, fit.fit_parametric(n, d, loss)  # Hoffmann et al.'s whole grid of 4,500 starts


def test_chinchilla_data_recovers_epoch_coefficients_within_their_uncertainty(chinchilla_fit):
    *_, got = chinchilla_fit
    assert got["runs"] == 240
    # Besiroglu et al. 2024: A 482.01, B 2085.43, E 1.8172, alpha 0.3478, beta 0.3658, with standard errors
    # A 124.58, B 1293.23, E 0.03, alpha 0.02, beta 0.02 (laws.EPOCH_STANDARD_ERRORS).
    for key, se in laws.EPOCH_STANDARD_ERRORS.items():
        assert abs(got[key] - getattr(laws.EPOCH, key)) <= se, key
    # Chinchilla's own procedure on the same 240 points (tests/fixtures/README.md): A 477.84, B 2143.86, E 1.8172,
    # alpha 0.3473, beta 0.3672. E, alpha, beta agree to the figures quoted (abs 6e-5 covers their rounding); A and
    # B lie along the objective's flattest direction (B's standard error is 60% of B), where two L-BFGS runs with
    # other stopping rules part by ~2e-4 relative: 1e-3 there.
    expected = {"E": 1.8172, "alpha": 0.3473, "beta": 0.3672}
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=6e-5), key
    assert got["A"] == pytest.approx(477.84, rel=1e-3) and got["B"] == pytest.approx(2143.86, rel=1e-3)


def test_bootstrap_spread_matches_epochs_standard_errors(chinchilla_fit):
    n, d, loss, best = chinchilla_fit
    boot = fit.bootstrap(n, d, loss, best, resamples=60, seed=1)
    # Bootstrap standard errors from 60 resamples carry ~9% sampling error themselves; Epoch's are rounded and
    # came from their own resampling: agreement within a factor of 1.6 either way.
    for key in ("E", "alpha", "beta", "A"):
        ratio = boot["coefficients"][key]["standard_error"] / laws.EPOCH_STANDARD_ERRORS[key]
        assert 1 / 1.6 < ratio < 1.6, (key, ratio)
    lo, hi = boot["coefficients"]["alpha"]["interval_90"]
    assert lo < best["alpha"] < hi


def test_residual_bootstrap_covers_a_known_law_and_is_narrower_than_resampling_points():
    # A synthetic ladder shaped like experiments/ladder/short.yaml's 9 fitted points (3 sizes with 4, 3 and 2
    # budgets, 3-40 tokens per parameter) under a known law, each log loss with Normal(0, 1%) noise (about the seed
    # spread measured at these sizes, 1.27%), in 40 trials; each trial is fitted, then bootstrapped 30 times by each
    # method, each resample also jittered by the 1% "measured seed noise", and the 90% interval of the loss at a
    # held-out point (2x the largest N at 18 tokens per parameter: 12x the largest fitted compute) is checked against
    # the law. The trials are refitted at once (fit.refit_rows, bootstrap's own refit) from each trial's fit: 3 s.
    # Coverage here: residuals 37/40, points 40/40; median interval width 11.6% of the loss (residuals), 13.0%
    # (points). Without the jitter the residuals alone cover 30/40 (width 7.6%): an L1-like Huber fit leaves
    # residuals below the noise, and the jitter restores it. At exactly 90% coverage the chance of 32 or fewer of 40
    # is 4%: at least 33 is asserted, and a narrower median than the points method's.
    theta = np.array([math.log(20.0), math.log(40.0), math.log(2.0), 0.3, 0.3])  # A 20, B 40, E 2, alpha = beta = 0.3
    n = np.array([33e3] * 4 + [83e3] * 3 + [214e3] * 2)
    log_n, log_d = np.log(n), np.log(n * np.array([5, 10, 20, 40, 5, 10, 20, 3, 6]))
    target_n, target_d = math.log(436e3), math.log(436e3 * 18)
    trials, resamples, sigma = 40, 30, 0.01
    rng = np.random.default_rng(0)
    observed = fit.log_law(theta, log_n, log_d)[None] + rng.normal(0, sigma, (trials, len(n)))
    starts = np.stack([theta, theta + [0.5, -0.5, 0.1, 0.05, -0.05]])
    fits = fit.refit_rows(log_n[None], log_d[None], observed, starts)
    truth = fit.log_law(theta, target_n, target_d)
    results = {}
    for method in ("residuals", "points"):
        if method == "residuals":
            drawn = np.concatenate([fit.residual_draws(fit.log_law(fits[i], log_n, log_d), observed[i], resamples, rng)
                                    for i in range(trials)])
            sn, sd = log_n[None], log_d[None]
            assert drawn.shape == (trials * resamples, len(n))
        else:
            idx = rng.integers(0, len(n), (trials * resamples, len(n)))
            sn, sd = log_n[idx], log_d[idx]
            drawn = np.concatenate([observed[i][idx[i * resamples:(i + 1) * resamples]] for i in range(trials)])
        drawn = drawn + rng.normal(0, sigma, drawn.shape)
        refit = fit.refit_rows(sn, sd, drawn, np.repeat(fits, resamples, axis=0)[:, None, :])
        with np.errstate(all="ignore"):
            predicted = np.array([fit.log_law(t, target_n, target_d) for t in refit]).reshape(trials, resamples)
            lo, hi = np.nanpercentile(predicted, 5, axis=1), np.nanpercentile(predicted, 95, axis=1)
        covered = int(((lo <= truth) & (truth <= hi)).sum())
        results[method] = (covered, float(np.median(np.exp(hi) - np.exp(lo)) / math.exp(truth)))
    assert results["residuals"][0] >= 33, results
    assert results["residuals"][1] < results["points"][1], results
    # residual_draws' residuals are centred and scaled by sqrt(runs / (runs - 5)): here sqrt(9/4) = 1.5
    base = np.zeros(9)
    residuals = np.array([1.0, -1.0] * 4 + [0.0]) * 1e-2
    draws = fit.residual_draws(base, residuals, 2000, np.random.default_rng(1))
    np.testing.assert_allclose(np.unique(draws), np.unique(1.5 * (residuals - residuals.mean())))
    with pytest.raises(ValueError, match="bootstrap method"):
        fit.bootstrap(n, np.exp(log_d), np.exp(observed[0]), {"theta": fits[0]}, 2, method="cases")


def test_frontier_of_isoflop_groups_recovers_the_laws_exponent():
    law = laws.EPOCH
    n_all, d_all, c_all = [], [], []
    for c in (1e18, 1e19, 1e20, 1e21):
        n_opt = law.compute_optimal(c)[0]
        for k in np.linspace(-0.6, 0.6, 7):  # sizes within a factor 4 of the optimum: the parabola is a good fit
            n = n_opt * math.exp(k)
            n_all.append(n), d_all.append(c / (6 * n)), c_all.append(c)
    loss = [law.loss(a, b) for a, b in zip(n_all, d_all)]
    fr = fit.frontier(n_all, d_all, c_all, loss)
    assert fr["method"].startswith("isoflop") and len(fr["points"]) == 4
    # Approach 2's parabola in log N is a second-order approximation of the law's valley: its vertex and slope land
    # within 0.01 of the closed form's exponent a here.
    assert fr["N_opt"]["exponent"] == pytest.approx(law.a, abs=0.01)
    assert fr["D_opt"]["exponent"] == pytest.approx(law.b, abs=0.01)
    assert fr["L"]["exponent"] < 0


def test_points_from_runs_and_bad_inputs(tmp_path):
    for i in range(5):
        run = tmp_path / "runs" / f"r{i}"
        run.mkdir(parents=True)
        run.joinpath("summary.json").write_text(json.dumps(
            {"params": 1000 * (i + 1), "flops_per_token": 7000 * (i + 1), "tokens_seen": 5000, "final_val_loss": 4.0}))
    points = load_points([str(tmp_path / "runs")])
    assert [p["C"] for p in points] == [7000 * (i + 1) * 5000 for i in range(5)]  # C = flops_per_token × tokens
    (tmp_path / "runs" / "r0" / "summary.json").write_text(json.dumps({"params": 1, "final_val_loss": None}))
    with pytest.raises(DataError, match="r0.*lacks"):
        load_points([str(tmp_path / "runs")])
    # A preempted run has every number, but of a partial run: never a point (runs/state.py)
    (tmp_path / "runs" / "r0" / "summary.json").write_text(json.dumps(
        {"status": "preempted", "steps": 4, "max_steps": 10, "params": 1000, "flops_per_token": 7000,
         "tokens_seen": 2000, "final_val_loss": 4.5}))
    with pytest.raises(DataError, match="r0.*preempted at step 4 of 10, not finished"):
        load_points([str(tmp_path / "runs")])
    bad = tmp_path / "bad.csv"
    bad.write_text("size,loss\n1,2\n")
    with pytest.raises(DataError, match="lack parameters"):
        load_points([str(bad)])
    with pytest.raises(DataError, match="neither a run folder"):
        load_points([str(tmp_path / "nothing.txt")])


def test_fit_sources_writes_law_and_plots(tmp_path):
    n, d, loss = _synthetic(laws.EPOCH, noise=2e-3, seed=3)
    csv = tmp_path / "runs.csv"
    csv.write_text("N,D,loss\n" + "".join(f"{a},{b},{c}\n" for a, b, c in zip(n[:30], d[:30], loss[:30])))
    result = fit_sources([str(csv)], out=tmp_path / "law.json", plots_dir=tmp_path / "plots", bootstrap=4,
                         log=lambda *_: None, starts=fit.grid_starts()[::25])
    saved = json.loads((tmp_path / "law.json").read_text())
    assert saved["chinchilla"]["alpha"] == pytest.approx(result["chinchilla"]["alpha"])
    assert len(saved["chinchilla"]["bootstrap_samples"]) == 4 and len(saved["points"]) == 30
    for name in ("loss_vs_compute.png", "isoflop.png", "residuals.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
