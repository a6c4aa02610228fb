"""What every supervised model is to fedmpi: a feature extractor and a linear classifier."""

from __future__ import annotations

import torch
from torch import nn


class Classifier(nn.Module):
    """``features(x) -> [B, F]`` (the penultimate representation MOON, FedMRUR and FNR-FL
    use), ``classifier`` (the final nn.Linear), ``forward == classifier(features(x))``,
    and ``project(features)`` through MOON's head ``projector`` when the model has one
    (model option proj_dim > 0, `fedmpi.models.add_projection_head`). A model defines
    ``features`` and ``classifier``."""

    def features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """MOON's projection of `features` (the head exists with model option proj_dim > 0)."""
        return self.projector(features)
