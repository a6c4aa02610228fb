"""FedSimSiam: SimSiam clients averaged by FedAvg (a FUSL baseline of FedU^2).

Chen & He, "Exploring Simple Siamese Representation Learning", CVPR 2021,
https://arxiv.org/abs/2011.10566; federated as in Liao et al. (FedU^2, CVPR 2024).

Client: E epochs of SGD on  L = -(cos(q(z1), sg z2) + cos(q(z2), sg z1)) / 2,
z_v = g(f(x_v)) over two augmented views, from the global encoder f, projector g and
predictor q; upload Delta_i = w_K - x^t (all three). Server: FedAvg,
x^{t+1} = x^t + eta_g sum_i n_i Delta_i / sum_i n_i. Messages d down, d up; no state.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Algorithm, register
from .fedsimclr import SSLParams
from .mixins import SelfSupervised
from .params import param
from .ssl_losses import simsiam_head


@dataclass(frozen=True)
class PredictorParams(SSLParams):
    """SSLParams + the predictor q of SimSiam / BYOL (same shape as the projector)."""

    pred_hidden: int = param(2048, ">= 1", "predictor hidden width")


@register
class FedSimSiam(SelfSupervised, Algorithm):
    name = "fedsimsiam"
    paper = "Chen & He 2021, arXiv:2011.10566 (federated: Liao et al. 2024)"
    Params = PredictorParams

    def predictor(self):
        return True

    def local_update(self, task, payload, client_state, ctx):
        return self.train_on_views(task, payload["x"], ctx, simsiam_head)
