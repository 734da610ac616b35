"""Published scaling laws with their coefficients, and the compute-optimal allocation each implies.

Parameter count conventions differ between papers and must match the runs a law is applied to:
- Hoffmann et al. 2022 (Chinchilla) and Besiroglu et al. 2024 (Epoch) count every parameter, embeddings included
  (our `params`, `GPT.num_params(non_embedding=False)`).
- Kaplan et al. 2020 counts non-embedding parameters (our `non_embedding_params`; their §2.1).
All laws here use C = 6·N·D for the compute of a plan (Kaplan eq. 2.2 counts C = 6NBS the same way; Hoffmann §3.3).
Losses are in nats per token on each paper's own data and tokenizer: they transfer to other data only as shapes.
"""

import math
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Optional, Tuple

PF_DAY = 1e15 * 24 * 3600  # FLOPs in one petaflop/s-day, Kaplan et al.'s unit of compute (8.64e19)


@dataclass(frozen=True)
class ParametricLaw:
    """L(N, D) = E + A / N^alpha + B / D^beta (Hoffmann et al. 2022, eq. 2), with N counting all parameters."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    name: str = "fitted"
    source: str = ""

    def loss(self, n: float, d: float) -> float:
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    @property
    def a(self) -> float:
        """Exponent of N_opt ∝ C^a: beta / (alpha + beta) (Hoffmann et al. eq. 4)."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Exponent of D_opt ∝ C^b: alpha / (alpha + beta) (Hoffmann et al. eq. 4)."""
        return self.alpha / (self.alpha + self.beta)

    @property
    def G(self) -> float:
        """G = (alpha·A / (beta·B))^(1/(alpha+beta)) (Hoffmann et al. eq. 4); nan where it is not a number: a fit's
        A or B can underflow to 0.0 (e^a with a below -745), or alpha + beta be 0."""
        try:
            return (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
        except (ZeroDivisionError, OverflowError):
            return math.nan

    def compute_optimal(self, flops: float) -> Tuple[float, float]:
        """(N_opt, D_opt) minimizing L(N, D) subject to 6·N·D = flops, in closed form (Hoffmann et al. eq. 4):
        N_opt = G·(C/6)^a, D_opt = G⁻¹·(C/6)^b."""
        return self.G * (flops / 6) ** self.a, (flops / 6) ** self.b / self.G

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ParametricLaw":
        return cls(**{k: data[k] for k in ("E", "A", "B", "alpha", "beta")}, name=data.get("name", "fitted"),
                   source=data.get("source", ""))


# Hoffmann et al. 2022 §3.3, eq. 10 (approach 3): fitted with Huber loss on their runs.
CHINCHILLA_APPROACH3 = ParametricLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28, name="chinchilla-approach3",
                                     source="Hoffmann et al. 2022, eq. 10 (approach 3), closed form eq. 4")
# Besiroglu et al. 2024 ("Chinchilla Scaling: A replication attempt"), their refit of approach 3 to the 240 points
# extracted from Hoffmann et al.'s Figure 4 (the estimates quoted in tests/fixtures/README.md).
EPOCH = ParametricLaw(E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658, name="epoch",
                      source="Besiroglu et al. 2024, refit of Hoffmann et al.'s approach 3")
# Their stated standard errors (Besiroglu et al. 2024, Table 1; bootstrap): A ±124.58, B ±1293.23, E ±0.03,
# alpha ±0.02, beta ±0.02.
EPOCH_STANDARD_ERRORS = {"A": 124.58, "B": 1293.23, "E": 0.03, "alpha": 0.02, "beta": 0.02}

# Hoffmann et al. 2022, Table 3: compute-optimal (parameters, training FLOPs, training tokens) projected with
# approach 1. Rows obey C = 6·N·D up to the paper's rounding of tokens.
CHINCHILLA_TABLE3 = (
    (400e6, 1.92e19, 8.0e9),
    (1e9, 1.21e20, 20.2e9),
    (10e9, 1.23e22, 205.1e9),
    (67e9, 5.76e23, 1.5e12),
    (175e9, 3.85e24, 3.7e12),
    (280e9, 9.90e24, 5.9e12),
    (520e9, 3.43e25, 11.0e12),
    (1e12, 1.27e26, 21.2e12),
    (10e12, 1.30e28, 216.2e12),
)

# Kaplan et al. 2020: compute-efficient model size N(C_min) = 1.3e9 · (C_min / PF-day)^0.73 (§6.1, Figure 14),
# N non-embedding; and the joint loss L(N, D) = [(N_c/N)^(alpha_N/alpha_D) + D_c/D]^alpha_D (eq. 4.1, fitted
# values in Table 2: alpha_N 0.076, alpha_D 0.103, N_c 6.4e13, D_c 1.8e13).
KAPLAN_N_COEFFICIENT, KAPLAN_N_EXPONENT = 1.3e9, 0.73
KAPLAN_LND = {"alpha_N": 0.076, "alpha_D": 0.103, "N_c": 6.4e13, "D_c": 1.8e13}


def kaplan_loss(n_non_embedding: float, tokens: float) -> float:
    k = KAPLAN_LND
    return ((k["N_c"] / n_non_embedding) ** (k["alpha_N"] / k["alpha_D"]) + k["D_c"] / tokens) ** k["alpha_D"]


def kaplan_n_opt(flops: float) -> float:
    return KAPLAN_N_COEFFICIENT * (flops / PF_DAY) ** KAPLAN_N_EXPONENT


def table3_n_opt(flops: float) -> float:
    """N_opt(C) from Hoffmann et al. Table 3: log-log interpolation between rows (it reproduces each row), and
    beyond the table the least-squares power law through all rows."""
    logc = [math.log(c) for _, c, _ in CHINCHILLA_TABLE3]
    logn = [math.log(n) for n, _, _ in CHINCHILLA_TABLE3]
    x = math.log(flops)
    if logc[0] <= x <= logc[-1]:
        for i in range(len(logc) - 1):
            if x <= logc[i + 1]:
                t = (x - logc[i]) / (logc[i + 1] - logc[i])
                return math.exp(logn[i] + t * (logn[i + 1] - logn[i]))
    slope, intercept = least_squares_line(logc, logn)
    return math.exp(intercept + slope * x)


def least_squares_line(x, y) -> Tuple[float, float]:
    """(slope, intercept) of the ordinary least-squares line through the points."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((xi - mx) ** 2 for xi in x)
    slope = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y)) / sxx
    return slope, my - slope * mx


@dataclass(frozen=True)
class PlanLaw:
    """What a plan needs from a law: N_opt(C) (increasing in C) and, where the law gives one, the loss L(N, D)."""

    name: str
    source: str
    param_count: str  # "params" (all parameters) or "non_embedding_params" (Kaplan)
    n_opt: Callable[[float], float]
    loss: Optional[Callable[[float, float], float]]


def from_parametric(law: ParametricLaw) -> PlanLaw:
    return PlanLaw(law.name, law.source, "params", lambda c: law.compute_optimal(c)[0], law.loss)


PUBLISHED: Dict[str, PlanLaw] = {
    "chinchilla": PlanLaw("chinchilla", "Hoffmann et al. 2022, Table 3 (approach 1)", "params", table3_n_opt, None),
    "chinchilla-approach3": from_parametric(CHINCHILLA_APPROACH3),
    "epoch": from_parametric(EPOCH),
    "kaplan": PlanLaw("kaplan", "Kaplan et al. 2020, §6.1 (N(C_min)) and eq. 4.1 with Table 2 (L(N, D))",
                      "non_embedding_params", kaplan_n_opt, kaplan_loss),
}
