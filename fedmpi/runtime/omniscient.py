"""Colluding, omniscient attacks (``[attack]`` kinds ``alie``, ``ipm``, ``min_max``,
``min_sum``): every malicious participant of a round sends one vector made from the
round's benign updates, which the attackers are assumed to know.

They act where the updates are (fedmpi.runtime.gram): on each worker's run of coordinate
blocks of all n updates, after the transpose and before the robust rule reads anything.
A per-coordinate statistic is local there; a global one (a norm, the benign updates'
distances) is one more pass whose per-block partials the server adds in block order, as
the Gram matrix's. No rank holds the updates, and the attack is the same bits for any
number of ranks.

With mu and sigma the benign updates' coordinate-wise mean and (unbiased) standard
deviation, n the round's participants and m its malicious ones:

- ``alie`` ("A little is enough", Baruch et al. 2019): mu - z sigma, z = Phi^-1((n - s) /
  n), s = floor(n / 2 + 1) - m (at least 1): the largest shift the paper's majority
  argument lets hide among the benign values;
- ``ipm`` (inner-product manipulation, Xie et al. 2020): -epsilon mu, epsilon =
  ``attack.scale``;
- ``min_max`` and ``min_sum`` (Shejwalkar and Houmansadr 2021, AGR-agnostic): mu + gamma p
  with p the ``attack.direction`` (``std``: -sigma; ``sign``: -sign(mu); ``unit``: -mu /
  ||mu||) and gamma the largest value that keeps the vector's largest distance to a benign
  update within the largest distance between two benign ones (min-max), or its summed
  squared distances to them within the largest such sum of a benign update (min-sum).
  Each distance is a quadratic in gamma whose coefficients come from ||mu - Delta_i||^2,
  <p, mu - Delta_i> and ||p||^2, so gamma is the smallest of the larger roots, exact where
  the paper's code halves a step from gamma = 10 to 1e-5.

The malicious clients train honestly; their uploads reach the aggregator as computed, and
only the rows the rule reads are replaced (their update_norm in /clients is the honest
one; ``robust_weight`` says what the rule made of them). A round without a malicious or
without a benign participant is not attacked.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import torch

from .robust import distances

KINDS = ("alie", "ipm", "min_max", "min_sum")
DIRECTIONS = ("std", "sign", "unit")


class CohortAttack:
    """The attack of a run: ``round(order)`` gives the round's (None: not attacked)."""

    def __init__(self, config, malicious: np.ndarray):
        a = config.attack
        self.kind, self.scale, self.direction = a.kind, a.scale, a.direction
        self.ids = malicious

    def round(self, order: np.ndarray):
        bad = np.isin(order, self.ids)
        if not bad.any() or bad.all():
            return None
        return _Round(self, bad)


class _Round:
    """One round's attack over the participants ``order`` (ascending id), ``bad`` marking
    the malicious rows. Per block: ``statistics(a)`` (partials), then on every rank
    ``apply(a, shared)`` with ``shared = solve(partials)`` from the server."""

    def __init__(self, attack: CohortAttack, bad: np.ndarray):
        self.kind, self.scale, self.direction = attack.kind, attack.scale, attack.direction
        self.bad = torch.from_numpy(np.flatnonzero(bad))
        self.good = torch.from_numpy(np.flatnonzero(~bad))
        self.n, self.m = len(bad), int(bad.sum())
        self.needs_statistics = self.kind in ("min_max", "min_sum")
        self.statistics_size = self.n * self.n + 2 * self.n + 1
        self.shared_size = 1

    def _moments(self, a: torch.Tensor):
        good = a[self.good]
        mu = good.mean(dim=0)
        sigma = good.std(dim=0) if len(good) > 1 else torch.zeros_like(mu)
        return mu, sigma

    def _direction(self, mu, sigma):
        return {"std": -sigma, "sign": -torch.sign(mu), "unit": -mu}[self.direction]

    def statistics(self, a: torch.Tensor) -> np.ndarray:
        """This block's partials: the Gram block (n x n), ||mu - a_i||^2 and <q, mu - a_i>
        for every row, ||q||^2 (q the unnormalised direction)."""
        mu, sigma = self._moments(a)
        q = self._direction(mu, sigma)
        off = mu - a
        return np.concatenate([(a @ a.T).numpy().reshape(-1), (off * off).sum(dim=1).numpy(),
                               (off @ q).numpy(), [float(q @ q)]])

    def solve(self, partials: np.ndarray | None) -> np.ndarray:
        if self.kind == "alie":
            s = max(1, math.floor(self.n / 2 + 1) - self.m)
            return np.array([NormalDist().inv_cdf((self.n - s) / self.n)])
        if self.kind == "ipm":
            return np.array([self.scale])
        total = np.zeros(self.statistics_size)
        for partial in partials:   # block order
            total += partial
        n, good = self.n, self.good.numpy()
        gram = total[:n * n].reshape(n, n)
        u, v, q2 = total[n * n:n * n + n][good], total[n * n + n:n * n + 2 * n][good], total[-1]
        scale = 1 / math.sqrt(q2) if self.direction == "unit" and q2 > 0 else 1.0
        b, p2 = scale * v, scale * scale * q2
        dist = distances(gram)[np.ix_(good, good)]
        if p2 <= 0:
            return np.array([0.0])
        if self.kind == "min_max":
            bound = dist.max()
            gamma = ((-b + np.sqrt(np.maximum(b * b - p2 * (u - bound), 0.0))) / p2).min()
        else:
            bound, k = dist.sum(axis=1).max(), len(good)
            big_b, big_u = b.sum(), u.sum()
            gamma = (-big_b + math.sqrt(max(big_b * big_b - k * p2 * (big_u - bound), 0.0))) \
                / (k * p2)
        return np.array([max(float(gamma), 0.0) * scale])

    def apply(self, a: torch.Tensor, shared: np.ndarray) -> None:
        """The malicious rows of block ``a`` (float64 [n, width]) replaced, in place."""
        mu, sigma = self._moments(a)
        value = float(shared[0])
        if self.kind == "alie":
            poisoned = mu - value * sigma
        elif self.kind == "ipm":
            poisoned = -value * mu
        else:
            poisoned = mu + value * self._direction(mu, sigma)
        a[self.bad] = poisoned
