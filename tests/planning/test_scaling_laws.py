"""Published laws, compute-optimal plans and our family's parameter counts: table tests citing their sources."""

import json
import math

import pytest
from scipy.optimize import minimize_scalar

from lit_pretrain.errors import ConfigError
from lit_pretrain.model import shapes
from lit_pretrain.model.config import GPTConfig
from lit_pretrain.model.gpt import GPT
from lit_pretrain.planning import laws
from lit_pretrain.planning.compute_optimal import load_law, plan


@pytest.mark.parametrize("n, flops, tokens", laws.CHINCHILLA_TABLE3)
def test_chinchilla_plan_reproduces_hoffmann_table3(n, flops, tokens):
    # Hoffmann et al. 2022, Table 3 (approach 1): parameters, FLOPs, tokens of compute-optimal models.
    p = plan(load_law("chinchilla"), flops=flops)
    assert p["params"] == pytest.approx(n, rel=1e-9)
    # The table prints tokens rounded to 2-4 significant figures (67B: 1.5T where C / 6N = 1.43T): 5%.
    assert p["tokens"] == pytest.approx(tokens, rel=0.05)
    assert p["predicted_loss"] is None  # approach 1 gives no loss


def test_chinchilla_table3_extrapolates_with_its_power_law():
    # beyond the table: the least-squares power law through its rows, close to N_opt ∝ C^0.5 (Table 2: a = 0.50)
    slope, _ = laws.least_squares_line([math.log(c) for _, c, _ in laws.CHINCHILLA_TABLE3],
                                       [math.log(n) for n, _, _ in laws.CHINCHILLA_TABLE3])
    assert slope == pytest.approx(0.50, abs=0.01)
    ratio = laws.table3_n_opt(1e30) / laws.table3_n_opt(1e29)
    assert ratio == pytest.approx(10**slope, rel=1e-9)


def test_approach3_exponents_match_hoffmann_table2():
    # Hoffmann et al. 2022 Table 2, approach 3: a = 0.46, b = 0.54 (from eq. 10's alpha 0.34, beta 0.28; the
    # rounded coefficients give 0.4516, within the table's rounding of 0.01).
    law = laws.CHINCHILLA_APPROACH3
    assert law.a == pytest.approx(0.46, abs=0.01) and law.b == pytest.approx(0.54, abs=0.01)
    assert law.a + law.b == pytest.approx(1.0)


@pytest.mark.parametrize("law", [laws.CHINCHILLA_APPROACH3, laws.EPOCH], ids=lambda x: x.name)
@pytest.mark.parametrize("flops", [1e18, 5.76e23, 1e26])
def test_closed_form_equals_numeric_minimization(law, flops):
    # Hoffmann et al. eq. 4 against minimizing L(N, C / 6N) over log N numerically (bounded Brent).
    n_closed, d_closed = law.compute_optimal(flops)
    res = minimize_scalar(lambda x: law.loss(math.exp(x), flops / (6 * math.exp(x))), bounds=(0, 80),
                          method="bounded", options={"xatol": 1e-10})
    assert math.exp(res.x) == pytest.approx(n_closed, rel=1e-6)
    assert 6 * n_closed * d_closed == pytest.approx(flops, rel=1e-12)


def test_epoch_plan_gives_about_20_tokens_per_param():
    # Besiroglu et al. 2024: their refit is consistent with Hoffmann et al.'s ~20 tokens per parameter (approaches
    # 1 and 2); at Chinchilla's own budget (Table 3, 5.76e23 FLOPs) it plans 72B parameters on 1.33T tokens.
    p = plan(load_law("epoch"), flops=5.76e23)
    assert 15 < p["tokens_per_param"] < 25
    assert p["predicted_loss"] == pytest.approx(laws.EPOCH.loss(p["params"], p["tokens"]))


def test_kaplan_units_and_convention():
    # Kaplan et al. 2020 §6.1: N(C_min) = 1.3e9 (C_min / PF-day)^0.73, non-embedding parameters; PF-day = 8.64e19.
    assert laws.PF_DAY == 8.64e19
    assert laws.kaplan_n_opt(laws.PF_DAY) == pytest.approx(1.3e9)
    p = plan(load_law("kaplan"), flops=10 * laws.PF_DAY, vocab_size=50257, seq_len=1024)
    assert p["params"] == pytest.approx(1.3e9 * 10**0.73)
    assert p["param_count"] == "non_embedding_params"
    assert p["shape"]["non_embedding_params"] == pytest.approx(p["params"], rel=0.1)


@pytest.mark.parametrize("name", ["chinchilla", "chinchilla-approach3", "epoch", "kaplan"])
def test_plan_from_params_or_tokens_inverts_plan_from_flops(name):
    law = load_law(name)
    p = plan(law, flops=3e21)
    assert plan(law, params=p["params"])["flops"] == pytest.approx(3e21, rel=1e-9)
    assert plan(law, tokens=p["tokens"])["flops"] == pytest.approx(3e21, rel=1e-9)


def test_plan_json_has_shape_steps_and_ratio():
    p = plan(load_law("chinchilla-approach3"), flops=1e21, tokens_per_step=2**20)
    for key in ("law", "flops", "params", "tokens", "tokens_per_param", "predicted_loss", "shape", "steps"):
        assert key in p
    assert p["steps"] == math.ceil(p["tokens"] / 2**20)
    assert p["tokens_per_param"] == pytest.approx(p["tokens"] / p["params"])
    assert p["shape"]["params"] == pytest.approx(p["params"], rel=0.05)  # shape_near's 5% tolerance


def test_plan_rejects_bad_requests(tmp_path):
    with pytest.raises(ConfigError, match="exactly one"):
        plan(load_law("epoch"), flops=1e20, params=1e9)
    with pytest.raises(ConfigError, match="positive"):
        plan(load_law("epoch"), flops=-1.0)
    with pytest.raises(ConfigError, match="neither a published law"):
        load_law(str(tmp_path / "missing.json"))
    bad = tmp_path / "law.json"
    bad.write_text(json.dumps({"frontier": {}}))
    with pytest.raises(ConfigError, match="not a law file"):
        load_law(str(bad))


def test_fitted_law_file_plans_with_its_coefficients(tmp_path):
    path = tmp_path / "law.json"
    path.write_text(json.dumps({"chinchilla": laws.EPOCH.to_dict()}))
    assert plan(load_law(str(path)), flops=1e22)["params"] == pytest.approx(laws.EPOCH.compute_optimal(1e22)[0])


@pytest.mark.parametrize("layers, d, heads, vocab, tie", [(2, 64, 4, 512, True), (3, 96, 3, 1024, False),
                                                         (4, 256, 4, 8192, True), (1, 48, 2, 300, False)])
def test_shape_counts_match_the_model(layers, d, heads, vocab, tie):
    cfg = GPTConfig(vocab_size=vocab, n_layers=layers, d_model=d, n_heads=heads, seq_len=32, tie_embeddings=tie)
    model = GPT(cfg)
    assert shapes.params(cfg) == model.num_params(non_embedding=False)
    assert shapes.non_embedding_params(cfg) == model.num_params(non_embedding=True)
    assert shapes.flops_per_token(cfg) == model.flops_per_token()
    assert list(shapes.param_shapes(cfg).items()) == [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def test_default_model_counts_as_its_comment_says():
    # experiments/model/small.yaml: 3.2M non-embedding + 2.1M embedding parameters; 35.0 MFLOPs per token
    cfg = GPTConfig(vocab_size=8192, n_layers=4, d_model=256, n_heads=4, seq_len=256)
    assert round(shapes.non_embedding_params(cfg) / 1e6, 1) == 3.2
    assert round((shapes.params(cfg) - shapes.non_embedding_params(cfg)) / 1e6, 1) == 2.1
    assert round(shapes.flops_per_token(cfg) / 1e6, 1) == 35.0


def test_shape_near_respects_count_and_aspect_ratio():
    s = shapes.shape_near(1e9, 32000, 2048)
    assert abs(s.params / 1e9 - 1) <= 0.05
    assert 32 <= s.d_model / s.n_layers <= 128 and s.d_model == 64 * s.n_heads
    k = shapes.shape_near(1e9, 32000, 2048, count="non_embedding_params")
    assert abs(k.non_embedding_params / 1e9 - 1) <= 0.05
    with pytest.raises(ValueError, match="positive"):
        shapes.shape_near(0, 32000, 2048)
