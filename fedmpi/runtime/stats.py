"""Statistics of a round's client updates, exact from sums (no per-client vectors needed).

With S clients, updates Delta_i, unit vectors u_i = Delta_i / ||Delta_i||:

- mean pairwise cosine  = (||sum_i u_i||^2 - S) / (S (S - 1))
  (sum over i != j of <u_i, u_j>, divided by the S(S-1) ordered pairs): FedMRUR's
  near-orthogonality of client updates;
- local consistency     = (1/S) sum_i ||x_i - xbar||^2 = (1/S) sum_i ||Delta_i||^2 - ||Dbar||^2
  with Dbar the unweighted mean (FedMIM's metric; all clients start from the same point).

Workers add ``Delta_i`` and ``u_i`` into two extra summed vectors; the norms come with the
per-client rows.
"""

from __future__ import annotations

import math

import numpy as np
import torch

STAT_SIZES_KEYS = ("_delta_sum", "_unit_sum")


def stat_contribution(delta: torch.Tensor) -> dict[str, torch.Tensor]:
    norm = torch.linalg.vector_norm(delta)
    return {"_delta_sum": delta, "_unit_sum": delta / norm.clamp_min(1e-12)}


def update_statistics(norms: np.ndarray, delta_sum: torch.Tensor | None = None,
                      unit_sum: torch.Tensor | None = None) -> dict[str, float]:
    """Round diagnostics from the clients' update norms and (optionally) the two sums."""
    s = len(norms)
    out = {"client_update_norm_mean": float(np.mean(norms)) if s else math.nan}
    if delta_sum is None:
        return out
    mean = delta_sum.double() / max(s, 1)
    out["local_consistency"] = float(np.mean(np.square(norms)) - mean.square().sum()) if s else math.nan
    out["client_update_cosine_mean"] = (
        float((unit_sum.double().square().sum() - s) / (s * (s - 1))) if s > 1 else math.nan)
    return out
