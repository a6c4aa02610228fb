"""FedSimSiam: SimSiam clients averaged by FedAvg (a FUSL baseline of FedU^2).

Chen & He, "Exploring Simple Siamese Representation Learning", CVPR 2021,
https://arxiv.org/abs/2011.10566; federated as in Liao et al. (FedU^2, CVPR 2024).

Client: E epochs of SGD on  L = -(cos(q(z1), sg z2) + cos(q(z2), sg z1)) / 2,
z_v = g(f(x_v)) over two augmented views, from the global encoder f, projector g and
predictor q; upload Delta_i = w_K - x^t (all three). Server: FedAvg,
x^{t+1} = x^t + eta_g sum_i n_i Delta_i / sum_i n_i. Messages d down, d up; no state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UsageError
from ..models.ssl import build_ssl_model
from . import local_sgd
from .base import Algorithm, register
from .fedsimclr import SSLParams
from .ssl_losses import on_projections, simsiam_head


@dataclass(frozen=True)
class PredictorParams(SSLParams):
    """SSLParams + the predictor q of SimSiam / BYOL (same shape as the projector)."""

    pred_hidden: int = field(default=2048, metadata={"doc": "predictor hidden width"})

    def __post_init__(self):
        super().__post_init__()
        value = self.pred_hidden
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"algorithm.pred_hidden={value!r}: must be a positive integer")


def build_predictor_model(params: PredictorParams, name, in_channels, image_size, options):
    """SSLNet with projector and predictor over the registry backbone ``name``."""
    options = {k: v for k, v in options.items() if k != "proj_dim"}
    return build_ssl_model(name, in_channels, image_size, options, proj_dim=params.proj_dim,
                           hidden=params.proj_hidden, predictor=True,
                           pred_hidden=params.pred_hidden, norm=params.head_norm)


@register
class FedSimSiam(Algorithm):
    name = "fedsimsiam"
    paper = "Chen & He 2021, arXiv:2011.10566 (federated: Liao et al. 2024)"
    supervised = False
    Params = PredictorParams

    def build_model(self, build, name, in_channels, num_classes, image_size, options):
        return build_predictor_model(self.params, name, in_channels, image_size, options)

    def local_update(self, task, payload, client_state, ctx):
        batches = task.data.view_batches(ctx.local_epochs, ctx.batch_size)
        return local_sgd.local_update(task, payload["x"], ctx, loss_fn=on_projections(simsiam_head),
                                      batches=batches)
