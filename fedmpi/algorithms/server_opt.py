"""Server optimizers on flat tensors: the pieces FedAvgM, FedAdam, FedExP and FedACG share.

The server treats the aggregated client update Dbar = sum_i q_i Delta_i (model-space,
"positive" direction: x + Delta moves toward the clients) as a pseudo-gradient step and feeds it to
an optimizer whose state lives in the server state dict. Every function here is pure
tensor arithmetic on flat CPU tensors (no runtime, no MPI), updates the state it is
given in place and returns the direction the caller adds to x, so the rules are tested
on their own (tests/test_alg_server.py).
"""

from __future__ import annotations

import torch


def count_once(upload) -> dict[str, torch.Tensor]:
    """The contribution of a plain (unweighted) mean over S_t: (Delta_i, weight 1), so the
    reduced "weight" is S exactly (a float32 sum of ones) whichever the order.

    FedACG, FedMRUR, FedMIM and SCAFFOLD use it. Two server steps divide by it, in two
    arithmetic orders kept as they are (bit for bit): FedACG's Dbar = sum / S
    (``mean_update``, then momentum) and FedMIM's and SCAFFOLD's x += (eta_g / S) sum
    (``Algorithm.server_update``); FedMRUR normalises the sum instead.
    """
    one = torch.ones(1, dtype=upload.delta.dtype, device=upload.delta.device)
    return {"delta": upload.delta, "weight": one}


def mean_update(sums: dict[str, torch.Tensor]) -> torch.Tensor:
    """Dbar = sum_i w_i Delta_i / sum_i w_i from the reduced contributions.

    The weights w_i are whatever the algorithm's ``contribution`` put in "weight":
    n_i (FedAvg's convention) or 1 (a plain mean over S_t, ``count_once``).
    """
    return sums["delta"] / sums["weight"]


def momentum(v: torch.Tensor, dbar: torch.Tensor, beta: float) -> torch.Tensor:
    """Heavy-ball server momentum v <- beta v + Dbar, in place; returns v.

    FedAvgM (Hsu et al. 2019) and FedACG (lambda in place of beta) use the same recursion.
    """
    return v.mul_(beta).add_(dbar)


def adam(m: torch.Tensor, v: torch.Tensor, dbar: torch.Tensor, b1: float, b2: float,
         tau: float) -> torch.Tensor:
    """Reddi et al. 2021, Alg. 2 (no bias correction), moments updated in place:

        m <- b1 m + (1 - b1) Dbar;  v <- b2 v + (1 - b2) Dbar^2;  returns m / (sqrt(v) + tau).
    """
    m.mul_(b1).add_(dbar, alpha=1.0 - b1)
    v.mul_(b2).addcmul_(dbar, dbar, value=1.0 - b2)
    return m / (v.sqrt() + tau)


def squared_norm(vec: torch.Tensor) -> float:
    """||vec||^2 accumulated in float64 (d can be ~10^7 on the server)."""
    return float(torch.linalg.vector_norm(vec, dtype=torch.float64)) ** 2  # host sync: server


def extrapolation(mean_sq_norm: float, dbar: torch.Tensor, eps: float) -> float:
    """FedExP's server step eta_g = max(1, sum_i q_i ||Delta_i||^2 / (2 (||Dbar||^2 + eps))).

    ``mean_sq_norm`` is sum_i q_i ||Delta_i||^2 with the same weights q_i as Dbar. By
    Jensen it is >= ||Dbar||^2, so without the max the step would still be >= ~1/2; the
    max makes FedExP never slower than FedAvg.
    """
    return max(1.0, mean_sq_norm / (2.0 * (squared_norm(dbar) + eps)))
