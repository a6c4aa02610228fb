"""The singular-value spectrum of an encoder's features (FedU^2 Figure 3), in pieces that
merge exactly: each worker's chunks of centred scatter (``covariance_sums``), combined on
the server (``combine_covariance_sums``) into the covariance's singular values, and its
summaries (``log10_spectrum``, ``effective_rank``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from fedmpi.errors import UsageError
from fedmpi.evaluation.ssl import _from_host, _host

@dataclass(frozen=True)
class CovarianceSums:
    """Sufficient statistics of a feature chunk: count, mean, centred scatter (float64)."""
    n: int
    mean: torch.Tensor     # [F]
    scatter: torch.Tensor  # [F, F] sum_i (z_i - mean)(z_i - mean)^T

    def __reduce__(self):
        """Sent to the server as host arrays, like ``KnnPartial``."""
        return _from_host, (CovarianceSums, self.n, _host(self.mean), _host(self.scatter))


def covariance_sums(feats: torch.Tensor) -> CovarianceSums:
    z = feats.detach().double()
    mean = z.mean(0) if len(z) else z.new_zeros(z.shape[1])
    centred = z - mean
    return CovarianceSums(len(z), mean, centred.T @ centred)


def combine_covariance_sums(parts: Sequence[CovarianceSums]) -> CovarianceSums:
    """Chunks' statistics merged left to right (Chan, Golub, LeVeque pairwise update)."""
    if not parts:
        raise UsageError("combine_covariance_sums: no chunks")
    total = parts[0]
    for part in parts[1:]:
        if part.n == 0 or total.n == 0:  # an empty chunk (a worker with no rows)
            total = total if part.n == 0 else part
            continue
        n = total.n + part.n
        delta = part.mean - total.mean
        cross = torch.outer(delta, delta) * (total.n * part.n / n)
        total = CovarianceSums(n, total.mean + delta * (part.n / n), total.scatter + part.scatter + cross)
    return total


def spectrum_from_sums(sums: CovarianceSums) -> torch.Tensor:
    """Singular values (descending, float64) of the covariance scatter / n."""
    if sums.n < 1:
        raise UsageError("feature spectrum: no features")
    return torch.linalg.svdvals(sums.scatter / sums.n)


def feature_spectrum(feats: torch.Tensor) -> torch.Tensor:
    """Singular values of Cov(z) = (1/N) sum_i (z_i - mean)(z_i - mean)^T, descending."""
    return spectrum_from_sums(covariance_sums(feats))


def log10_spectrum(singular_values: torch.Tensor, floor: float = 1e-12) -> torch.Tensor:
    """log10 of the singular values, clamped at `floor` (collapsed directions are ~0)."""
    return torch.log10(singular_values.clamp(min=floor))


def effective_rank(singular_values: torch.Tensor) -> float:
    """exp(-sum p_i log p_i), p = sigma / sum sigma (Roy & Vetterli 2007): 1 to F."""
    s = singular_values.double().clamp(min=0)
    p = s[s > 0] / s.sum()
    return float(torch.exp(-(p * p.log()).sum())) if len(p) else 0.0  # host sync: a summary, once
