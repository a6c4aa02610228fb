"""What every supervised model is to fedmpi: a feature extractor and a linear classifier."""

from __future__ import annotations

import torch
from torch import nn


class Classifier(nn.Module):
    """``features(x) -> [B, F]`` (the penultimate representation MOON, FedMRUR and FNR-FL
    use), ``classifier`` (the final nn.Linear), ``forward == classifier(features(x))``,
    and ``project(features)`` through MOON's head ``projector`` when the model has one
    (model option proj_dim > 0, `fedmpi.models.add_projection_head`). A model defines
    ``features`` and ``classifier``, and may declare ``blocks`` (FedMLB's levels)."""

    def features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def blocks(self) -> list[nn.Module] | None:
        """The model's ``features`` as a chain of blocks, ``features(x) ==
        blocks[-1](...blocks[0](x))`` bit for bit: the levels at which FedMLB
        (fedmpi.algorithms.fedmlb) grafts the local model onto the global one. The blocks
        are the model's own submodules (grouped, never copied or re-registered); None for
        a model that declares none (the default)."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """MOON's projection of `features` (the head exists with model option proj_dim > 0)."""
        return self.projector(features)
