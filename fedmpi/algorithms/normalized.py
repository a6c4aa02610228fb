"""FedMRUR's normalized update aggregation, a pure function on flat tensors.

An, Shen, Hu, Luo, "Federated Learning with Manifold Regularization and Normalized Update
Reaggregation", NeurIPS 2023, https://arxiv.org/abs/2311.05924, Algorithm 1 line 15:

    D = (1/|S| sum_p ||Delta_p||) * s / ||s||,   s = sum_p Delta_p

The sum only gives the direction; the length is the mean client update length, so
near-orthogonal client updates no longer shrink the global step (a plain mean of S
orthogonal equal-norm updates has length ||Delta_p|| / sqrt(S); D has ||Delta_p||).
"""

from __future__ import annotations

import numpy as np
import torch


def normalized_update(update_sum: torch.Tensor, norms) -> torch.Tensor:
    """D from s = sum_p Delta_p and the clients' ||Delta_p||; D = 0 if s = 0."""
    length = float(np.mean(np.asarray(norms, dtype=np.float64)))
    # host sync: server, once per round
    s_norm = float(torch.linalg.vector_norm(update_sum, dtype=torch.float64))
    if s_norm == 0.0:
        return torch.zeros_like(update_sum)
    return update_sum * (length / s_norm)
