"""What a ladder's law is fitted in: the parameter-count conventions (N), the second variable (tokens D or optimizer
steps S: grid.law_variables), each fit's name (fit_key) and a rung's N and D or S under it, and the law's loss
without overflow. Shared by ladder_report.py (fit, predictions, report) and ladder_picture.py (the figure).
"""

import math

from lit_pretrain.scaling.laws import ParametricLaw

CONVENTIONS = ("total", "non_embedding", "non_embedding_plus_head")
CONVENTION_TEXT = {
    "total": "every parameter, the tied embedding/head matrix once (Hoffmann et al. 2022)",
    "non_embedding": "parameters without the tied embedding/head matrix (Kaplan et al. 2020, OLMo-core)",
    "non_embedding_plus_head": "non-embedding plus the head, the tied matrix counted once as the head (OLMo 2024, "
                               "nanochat); equal to total where the embedding is tied",
}
COMPUTE = "C = 6·N·D, N every parameter (the head's matmul included), D training tokens"
VARIABLE_TEXT = {"tokens": "D, training tokens (the anchors' L(N, D))",
                 "steps": "S, optimizer steps (D / tokens a step): L(N, S) = E + A/N^alpha + B/S^beta"}


def fit_key(convention: str, variable: str) -> str:
    """The name of one fit: the N convention, with ", steps" where the law's second variable is steps."""
    return convention if variable == "tokens" else f"{convention}, {variable}"


def split_key(key: str):
    """(convention, variable) of a fit's name (fit_key)."""
    convention, _, variable = key.partition(", ")
    return convention, variable or "tokens"


def symbol(key: str) -> str:
    """The law's second variable's letter under a fit (fit_key): S for optimizer steps, D for tokens; also its key in
    report.json's conventions, so a law in steps never reads as one in tokens."""
    return "S" if split_key(key)[1] == "steps" else "D"


def x_of(row: dict, key: str) -> float:
    """A rung's second variable under a fit (fit_key): its training tokens D, or its optimizer steps S."""
    return row["steps"] if split_key(key)[1] == "steps" else row["tokens"]


def n_of(row: dict, key: str) -> float:
    """A rung's parameter count under a fit's convention (CONVENTIONS; fit_key); an untied model's head is a second
    V×d matrix."""
    convention = split_key(key)[0]
    if convention == "non_embedding":
        return row["non_embedding_params"]
    if convention == "non_embedding_plus_head":
        return row["non_embedding_params"] + row["head_params"]
    return row["params"]


def safe_loss(law: ParametricLaw, n: float, d: float) -> float:
    """law.loss(n, d) in logs: a resampled law's exponent can be large enough that n**alpha overflows a float, and
    its A or B (e^a, e^b) small enough to be 0.0 (its term is then 0 or inf, never an error). Where law.loss is
    defined it is the value, to the bit (the sweep's prediction is this one: tests/test_scaling_cli.py)."""
    try:
        return law.loss(n, d)
    except (OverflowError, ZeroDivisionError):
        pass
    terms = [(math.log(c) if c > 0 else -math.inf) - power * math.log(x)
             for c, power, x in ((law.A, law.alpha, n), (law.B, law.beta, d))]
    return law.E + sum(math.exp(t) if t < 700 else math.inf for t in terms)
