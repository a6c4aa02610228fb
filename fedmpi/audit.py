"""A privacy audit in one training run (Steinke, Nasr and Jagielski, "Privacy Auditing with
One (1) Training Run", NeurIPS 2023): the statistics.

m canaries are each included in the run independently with probability 1/2. After the
run an auditor scores every canary (fedmpi: the final model's movement along the canary's
direction, fedmpi.runtime.dp.Canaries), guesses "included" for the k highest scores and
"excluded" for the k lowest, and counts v correct guesses of r = 2k. Under
(epsilon, delta)-DP the count is at most what randomised response with
epsilon would give, up to a delta term (the paper's Theorem 3.1 and its Algorithm 2):

    P[v or more correct] <= P[Binomial(r, e^eps / (1 + e^eps)) >= v] + 2 m delta alpha,
    alpha = max over i = 1..v of P[v - i <= Binomial(r, .) < v] / i.

The empirical lower bound is the largest epsilon this p-value rejects at the confidence
level: the run is then not (epsilon, delta)-DP, unless the guesses were that lucky.

fedmpi guesses at a few fixed k (``GUESS_FRACTIONS`` of m) and reports the largest bound
over them, each at the level (1 - confidence) / (number of k) (a union bound), so the
reported bound holds at the stated confidence as it is, without a choice after the fact.
"""

from __future__ import annotations

import math

import numpy as np

GUESS_FRACTIONS = (0.05, 0.1, 0.25, 0.5)   # k / m: guesses on each side
CONFIDENCE = 0.95


def _log_binomial(r: int) -> np.ndarray:
    """log C(r, k) for k = 0..r."""
    lg = np.array([math.lgamma(k + 1) for k in range(r + 1)])
    return lg[r] - lg - lg[::-1]


def p_value(m: int, r: int, v: int, eps: float, delta: float,
            log_binomial: np.ndarray | None = None) -> float:
    """The chance of v or more correct guesses of r (m canaries) under (eps, delta)-DP."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    lb = _log_binomial(r) if log_binomial is None else log_binomial
    k = np.arange(r + 1)
    # log q and log (1 - q) for q = e^eps / (1 + e^eps), stable for large eps
    log_q, log_1q = -math.log1p(math.exp(-eps)), -eps - math.log1p(math.exp(-eps))
    pmf = np.exp(lb + k * log_q + (r - k) * log_1q)
    tail = float(pmf[v:].sum())
    below = np.cumsum(pmf[:v][::-1])       # P[v - i <= B < v] for i = 1..v
    alpha = float(np.max(below / np.arange(1, v + 1))) if v else 0.0
    return min(1.0, tail + 2 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, level: float) -> float:
    """The largest epsilon whose p-value for v correct of r is below ``level`` (0 where
    none is): with confidence 1 - level the run is not (epsilon, delta)-DP for any
    smaller epsilon. Bisection to 1e-6 in epsilon."""
    lb = _log_binomial(r)

    def rejects(eps):
        return p_value(m, r, v, eps, delta, lb) < level

    if not rejects(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while rejects(high):
        low, high = high, 2 * high
        if high > 1e4:          # every guess right at a level no epsilon explains
            return math.inf
    while high - low > 1e-6:
        mid = (low + high) / 2
        low, high = (mid, high) if rejects(mid) else (low, mid)
    return low


def audit(scores: np.ndarray, included: np.ndarray, delta: float,
          confidence: float = CONFIDENCE) -> dict:
    """The one-run audit of m canaries' ``scores`` (higher: more likely included) against
    whether each was ``included``: epsilon's lower bound and the guesses it came from."""
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    m = len(scores)
    ks = sorted({max(1, int(f * m)) for f in GUESS_FRACTIONS if 2 * max(1, int(f * m)) <= m})
    if not ks:
        return {"audit_epsilon": 0.0, "audit_guesses": 0, "audit_correct": 0}
    order = np.argsort(-scores, kind="stable")
    level = (1 - confidence) / len(ks)
    best = {"audit_epsilon": -1.0}
    for k in ks:
        v = int(included[order[:k]].sum() + (~included[order[m - k:]]).sum())
        eps = epsilon_lower_bound(m, 2 * k, v, delta, level)
        if eps > best["audit_epsilon"]:
            best = {"audit_epsilon": eps, "audit_guesses": 2 * k, "audit_correct": v}
    return best
