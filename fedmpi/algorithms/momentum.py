"""Client-level momentum in gradient units (FedCM, MoFedSAM, FedMRUR).

The server's last global update D (model space, Delta = x_K - x_0 direction) becomes the
average per-step gradient of the last round,

    m = -D / (K * eta_l^{t-1}),

and every local step uses v = alpha g + (1 - alpha) m before clipping and the SGD step
[code: FL-Simulator server/MoFedSAM.py, client/fedcm.py, client/mofedsam.py].

K: FL-Simulator divides by E * n / B of one (balanced) client. With unequal client sizes
fedmpi divides by the mean step count of the clients that produced D, weighted as D
weighted them (n_i for a mean of updates, equal for FedMRUR's normalized update): then
m is exactly the weighted mean per-step gradient when each client's gradient is constant.
"""

from __future__ import annotations

import numpy as np
import torch

from .local_sgd import Correction, rows_of


def gradient_units(update: torch.Tensor, steps: float, lr_prev: float) -> torch.Tensor:
    """m = -update / (K eta_l^{t-1}); zero before the first update exists (K = 0)."""
    if steps <= 0:
        return torch.zeros_like(update)
    return update * (-1.0 / (steps * lr_prev))


def mean_steps(gathered: dict[str, np.ndarray], weighted: bool) -> float:
    """K of the round: the participants' local step counts, n_i-weighted or plain mean."""
    steps = gathered["steps"]
    if not weighted:
        return float(np.mean(steps))
    n = gathered["n_samples"]
    return float(np.sum(n * steps) / np.sum(n))


def mixed(alpha: float, m: torch.Tensor) -> Correction:
    """Gradient correction g <- alpha g + (1 - alpha) m (before clipping).

    ``m`` comes from the server's D over the whole flat state (parameters, then float
    buffers such as BatchNorm statistics; fedmpi.flat.FlatModel); the gradient has the
    parameters' num_params entries, so only m's first num_params values enter."""
    def correct(grads, params):
        grads.mul_(alpha).add_(rows_of(m, grads), alpha=1.0 - alpha)
    return correct
