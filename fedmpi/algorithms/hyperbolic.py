"""FedMRUR's hyperbolic regulariser: Lorentz lift and squared Lorentzian distance.

Law, Liao, Snell, Zemel, "Lorentzian Distance Learning for Hyperbolic Representations",
ICML 2019 (FedMRUR's ref. [19]); FedMRUR eq. (3), An et al. 2023, arXiv:2311.05924.

    Lift(z) = (sqrt(beta + ||z||^2), z)            on the hyperboloid <a, a>_L = -beta
    <a, b>_L = -a_0 b_0 + sum_{i>=1} a_i b_i
    dL2(a, b) = -2 beta - 2 <a, b>_L = <a - b, a - b>_L
              = 2 (sqrt((beta + |z1|^2)(beta + |z2|^2)) - beta - <z1, z2>)  >= 0
    R(w) = mean_b exp(dL2(Lift(z_b(w)), Lift(z_g,b)) / sigma)

The distance is evaluated as the Lorentzian square of the difference: the same number on
the hyperboloid, but -2 beta - 2 <a, b>_L subtracts two numbers of size ||z||^2 that
nearly cancel, while <a - b, a - b>_L is exactly 0 for equal inputs.
"""

from __future__ import annotations

import torch


def lift(z: torch.Tensor, beta: float) -> torch.Tensor:
    """[B, F] Euclidean representations -> [B, F + 1] points of the Lorentz model."""
    time = torch.sqrt(beta + z.square().sum(dim=-1, keepdim=True))
    return torch.cat([time, z], dim=-1)


def lorentz_inner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """<a, b>_L over the last dimension."""
    prod = a * b
    return prod[..., 1:].sum(dim=-1) - prod[..., 0]


def lorentz_dist2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Squared Lorentzian distance of lifted points, per row, clamped at 0 (rounding)."""
    diff = a - b
    return lorentz_inner(diff, diff).clamp(min=0.0)


def regularizer(z: torch.Tensor, z_global: torch.Tensor, beta: float,
                sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, per-sample dL2): R = mean over the batch of exp(dL2 / sigma)."""
    dist2 = lorentz_dist2(lift(z, beta), lift(z_global, beta))
    return torch.exp(dist2 / sigma).mean(), dist2
