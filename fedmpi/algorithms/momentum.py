"""Client-level momentum in gradient units (FedCM, MoFedSAM, FedMRUR).

The server's last global update D (model space, Delta = x_K - x_0 direction) becomes the
average per-step gradient of the last round,

    m = -D / (K * eta_l^{t-1}),

and every local step uses v = alpha g + (1 - alpha) m before clipping and the SGD step
[code: FL-Simulator server/MoFedSAM.py, client/fedcm.py, client/mofedsam.py].

Weight decay: m carries last round's whole displacement, its decay included, so a step
w <- w - eta_l (clip(v) + wd w) decays by wd now and by (1 - alpha) times last round's
decay again through m. At the fixed point (m = the mean step's own direction) that is
m = g + (wd / alpha) w: an effective decay of wd / alpha, 10x FedAvg's at alpha = 0.1.
FL-Simulator steps so (SGD's weight_decay beside the mix): ``decay = "code"``. The
default ``decay = "matched"`` scales the step's decay as the fresh gradient is scaled,
w <- w - eta_l (clip(v) + alpha wd w), which brings the fixed point to m = g + wd w: the
decay FedAvg has at the same train.weight_decay, so the two compare like for like
(FedMIM's inertial step scales its decay by 1 - A the same way).

K: FL-Simulator divides by E * n / B of one (balanced) client. With unequal client sizes
fedmpi divides by the mean step count of the clients that produced D, weighted as D
weighted them (n_i for a mean of updates, equal for FedMRUR's normalized update): then
m is exactly the weighted mean per-step gradient when each client's gradient is constant.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from .base import RoundContext
from .local_sgd import Correction, rows_of
from .params import param

DECAY_PLACEMENTS = ("matched", "code")


def decay_param():
    """The ``decay`` parameter of every method that mixes a server direction into its
    local steps: where train.weight_decay goes (module docstring)."""
    return param("matched", DECAY_PLACEMENTS,
                 "where train.weight_decay acts: 'matched', scaled with the fresh gradient, "
                 "effective decay = weight_decay as FedAvg's (like-for-like); 'code', unscaled "
                 "each step as FL-Simulator, effective weight_decay / alpha")


def decayed(ctx: RoundContext, fresh: float, placement: str) -> RoundContext:
    """The context the local steps train with: weight decay ``fresh`` * wd under
    "matched" (``fresh``: the fresh gradient's weight, alpha), wd as given under "code"."""
    if placement == "code" or not ctx.weight_decay:
        return ctx
    return replace(ctx, weight_decay=fresh * ctx.weight_decay)


def effective_decay(weight_decay: float, fresh: float, placement: str) -> float:
    """The fixed-point decay per unit of gradient: wd under "matched", wd / ``fresh``
    under "code" (infinite at fresh = 0 with a decay: the gradient never enters)."""
    if placement == "matched" or not weight_decay:
        return weight_decay
    return weight_decay / fresh if fresh > 0 else math.inf


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
