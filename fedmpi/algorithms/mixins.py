"""Optional parts of the protocol, for the methods that need them; ``base.Algorithm``
keeps a default of each attribute the runtime reads, so the others never see them.

- ``GramAggregation``: client weights that depend on every pair of updates (FedU^2's EUA,
  min-norm weights from <Delta_k, Delta_l>; fedmpi.algorithms.eua).
- ``SelfSupervised``: a representation learner without labels or classifier (SimCLR,
  SimSiam, BYOL and the methods built on them).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..models.ssl import build_ssl_model
from . import local_sgd
from .base import RoundContext, Upload
from .ssl_losses import on_projections


class GramAggregation:
    """Aggregation by pairwise inner products, without any rank holding K d values.

    In a phase where ``gram_weighted(phase)`` is True the uploads' ``delta`` are not summed
    by ``contribution`` (``contribution_sizes`` must then omit "delta"): fedmpi.runtime.gram
    computes inner[k, l] = <Delta_k, Delta_l> where the updates are, calls
    ``gram_coefficients`` on the server and hands ``server_update``
    sums["delta"] = sum_k c_k Delta_k.
    """

    def gram_weighted(self, phase: str) -> bool:
        return True

    def gram_coefficients(self, inner: np.ndarray, ctx: RoundContext) -> np.ndarray:
        """c_k (float64, K) from inner[k, l] = <Delta_k, Delta_l> (float64), participants
        in ascending client id."""
        raise NotImplementedError


class SelfSupervised:
    """A representation learner: its model is a registry backbone as encoder with the
    projection head of ``params`` (SSLParams; a predictor too when ``predictor``), its
    local update reads ``task.data.view_batches`` (two augmented views, labels unused),
    and the runtime scores the global model by the kNN accuracy of its encoder
    (fedmpi.evaluation) instead of a test-set accuracy (``supervised = False``)."""

    supervised: ClassVar[bool] = False

    def predictor(self) -> bool:
        """Whether the network has a predictor q after the projector (SimSiam, BYOL)."""
        return False

    def build_model(self, build, name, in_channels, num_classes, image_size, options):
        p = self.params
        options = {k: v for k, v in options.items() if k != "proj_dim"}
        head = {"predictor": True, "pred_hidden": p.pred_hidden} if self.predictor() else {}
        return build_ssl_model(name, in_channels, image_size, options, proj_dim=p.proj_dim,
                               hidden=p.proj_hidden, norm=p.head_norm, **head)

    def train_on_views(self, task, x, ctx, head) -> Upload:
        """E local epochs from ``x`` on ``head(module, z, both)``, the loss on the
        projections of both views (ssl_losses.on_projections); uploads Delta = w_K - x."""
        batches = task.data.view_batches(ctx.local_epochs, ctx.batch_size)
        return local_sgd.local_update(task, x, ctx, loss_fn=on_projections(head), batches=batches)
