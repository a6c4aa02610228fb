"""FedDecorr on a self-supervised client: FedDecorr-SimSiam / -BYOL (/ -SimCLR).

Shi et al., "Towards Understanding and Mitigating Dimensional Collapse in Heterogeneous
Federated Learning", ICLR 2023, https://arxiv.org/abs/2210.00226 (the regulariser,
fedmpi.algorithms.feddecorr); as a federated unsupervised baseline in Liao et al. (FedU^2,
CVPR 2024, https://arxiv.org/abs/2403.16398; code XeniaLLL/FedU2), which compares
FedDecorr-SimSiam and FedDecorr-BYOL.

Client k, from the global model: E epochs of the backbone's loss plus the regulariser on
each view's projections,

    L = l_ssl(Z^1, Z^2) + beta (L_decorr(Z^1) + L_decorr(Z^2)),   Z^v = g(f(x^v)) [B, proj_dim],

l_ssl the backbone's (``backbone``: byol = FedBYOL's client with its local EMA target,
simsiam = FedSimSiam's, simclr = FedSimCLR's NT-Xent), L_decorr standardised per view
over the batch (``normalisation`` as in feddecorr: "code" = bytedance/FedDecorr's
FedDecorrLoss, the default; "paper" = ||K||_F^2 / F^2). Upload Delta_k = theta_K - x^t.
Server: FedAvg (n_k-weighted). Messages d down, d up (the online network; BYOL's target
never travels). Client state: BYOL's target and seen flag (backbone byol), none otherwise.

Where the regulariser applies: on the projections Z, each view separately. The FedU^2
code's FedDecorr-BYOL client (src/my/algo/byol_local/client.py) adds
0.1 * (FedDecorrLoss(z1) + FedDecorrLoss(z2)) on the online projector's outputs, and FedU^2
puts its own regulariser on the same Z; FedDecorr's supervised "representation" is the
penultimate layer, whose analogue here would be the encoder output f(x) (one commented-out
line of that code's SimSiam client tries it). The encoder-output variant is not offered.
``beta = 0.1``: that client's weight (also the supervised default). beta = 0 is the
backbone's method bit for bit (FedBYOL, FedSimSiam, FedSimCLR).

``backbone = "byol"`` (default): the client of the FedU^2 code that carries FedDecorr, and
FedU^2's default backbone. No group form of the local update.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import register
from .byol import BYOLParams
from .feddecorr import NORMALISATIONS, decorrelation
from .fedbyol import OnBackbone
from .params import param
from .ssl_losses import halves

BACKBONES = ("byol", "simclr", "simsiam")


@dataclass(frozen=True)
class FedDecorrSSLParams(BYOLParams):
    backbone: str = param("byol", BACKBONES, "client method: byol | simclr | simsiam "
                                             "(FedU^2 compares FedDecorr-SimSiam and -BYOL)")
    temperature: float = param(0.07, "> 0", "NT-Xent temperature (simclr)")
    beta: float = param(0.1, ">= 0", "weight beta of the decorrelation loss on each view's "
                                     "projections (FedU^2 code: 0.1)")
    normalisation: str = param("code", NORMALISATIONS,
                               "code: off-diagonal mean of (Z^T Z)^2 / B (bytedance/FedDecorr) "
                               "| paper: ||K||_F^2 / F^2, K the correlation matrix")


def with_decorrelation(head, beta: float, normalisation: str):
    """``head`` + beta (L_decorr(Z^1) + L_decorr(Z^2)) on the projections of each view."""
    def regularised(module, z, both):
        z1, z2 = halves(z)
        return head(module, z, both) + beta * (decorrelation(z1, normalisation)
                                               + decorrelation(z2, normalisation))
    return regularised


@register
class FedDecorrSSL(OnBackbone):
    name = "feddecorr_ssl"
    paper = "Shi et al. 2023, arXiv:2210.00226 (self-supervised: Liao et al. 2024)"
    Params = FedDecorrSSLParams

    def regularised(self, head):
        return with_decorrelation(head, self.params.beta, self.params.normalisation)
