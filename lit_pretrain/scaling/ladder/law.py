"""What a ladder's law is fitted in: the parameter-count conventions (N), the second variable (tokens D or optimizer
steps S: grid.law_variables), each fit's name (fit_key) and a rung's N and D or S under it, and the law's loss
without overflow. Shared by report.py (fit, predictions, report) and picture.py (the figure).
"""

import math
from typing import List, Optional

from lit_pretrain.planning.laws import ParametricLaw

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
    defined it is the value, to the bit (the sweep's prediction is this one: tests/scaling/test_scaling_cli.py)."""
    try:
        return law.loss(n, d)
    except (OverflowError, ZeroDivisionError):
        pass
    terms = [(math.log(c) if c > 0 else -math.inf) - power * math.log(x)
             for c, power, x in ((law.A, law.alpha, n), (law.B, law.beta, d))]
    return law.E + sum(math.exp(t) if t < 700 else math.inf for t in terms)


# A fitted law is a law of the ladder only within these bounds; outside them the fit found a curve through the
# rungs' noise, not a scaling law (the smoke grid's 5-step rungs gave alpha -34 and a predicted loss of 4.75e12),
# and it is reported as failed: never chosen, never predicting.
# - alpha and beta in (0, MAX_EXPONENT]: loss falls as N and D grow (with an exponent <= 0 more parameters or data
#   never help, and the law has no compute-optimal split: Hoffmann et al. 2022, eq. 4). 2 is the top of Hoffmann et
#   al.'s grid of starting exponents (appendix D.2) and over 5x every published fit (Hoffmann et al. eq. 10: 0.34,
#   0.28; Besiroglu et al. 2024: 0.35, 0.37; Kaplan et al. 2020 Table 2: 0.076, 0.103).
# - its loss at every rung of the grid (fitted, development, held out) finite, positive and below ln(V), V the
#   vocabulary size: a uniform prediction over V tokens scores ln(V) nats untrained, so a law that predicts more
#   for a trained rung says training made it worse than no model.
MAX_EXPONENT = 2.0


def law_failure(law: ParametricLaw, rungs: List[dict], key: str, vocab_size: int) -> Optional[str]:
    """Why `law` (fitted under fit_key `key`) is not a law of these rungs, or None when it is within the bounds."""
    for name, value, of in (("alpha", law.alpha, "N"), ("beta", law.beta, symbol(key))):
        if not 0 < value <= MAX_EXPONENT:  # nan too
            return (f"{name} = {value:.4g} is outside (0, {MAX_EXPONENT:g}]: loss would not fall as a power of {of} "
                    "as published laws do")
    uniform = math.log(vocab_size)
    for r in rungs:
        loss = safe_loss(law, n_of(r, key), x_of(r, key))
        if not 0 < loss < uniform:  # nan and inf too
            return (f"its loss at rung {r['name']} is {loss:.4g}, outside (0, ln({vocab_size}) = {uniform:.4f}), "
                    "the loss of a uniform prediction")
    return None
