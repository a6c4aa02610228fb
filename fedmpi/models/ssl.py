"""Self-supervised network: a registry backbone as encoder + projector (+ predictor).

SimCLR / BYOL / SimSiam share one shape: encoder f (the backbone's
``features``, the representation kNN and the linear probe read), projector g (z = g(f(x)))
and, for BYOL and SimSiam, predictor q (p = q(z)). FedU^2 uses 512-2048(BN,ReLU)-512 for
g and q. fedmpi's models have parameters only (no running statistics to aggregate), so the
heads use LayerNorm (``norm="layer"``, the default) or nothing (``norm="none"``) where the
papers use BatchNorm:

    g, q:  Linear(in, hidden) -> [LayerNorm(hidden)] -> ReLU -> Linear(hidden, out).

Parameters are registered encoder, projector, predictor, so in the flat buffer
(fedmpi.flat) each group is one contiguous slice named by its prefix (``group_slices``):
algorithms aggregate subsets by slice (FedU / FedEMA: online encoder + projector and the
predictor separately). BYOL's target network (encoder + projector) is a separate module
kept per client (``target_copy``) whose flat layout equals the online prefix
[encoder, projector], so the EMA is one operation on flat tensors.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fedmpi.errors import UsageError
from fedmpi.models import MODELS, build_model

GROUPS = ("encoder", "projector", "predictor")
NORMS = ("layer", "none")


def mlp_head(in_dim: int, hidden: int, out_dim: int, norm: str) -> nn.Sequential:
    """Linear -> [LayerNorm] -> ReLU -> Linear."""
    middle = [nn.LayerNorm(hidden)] if norm == "layer" else []
    return nn.Sequential(nn.Linear(in_dim, hidden), *middle, nn.ReLU(), nn.Linear(hidden, out_dim))


class SSLNet(nn.Module):
    """Encoder (any module with ``features(x) -> [B, feature_dim]``) + projector (+ predictor)."""

    def __init__(self, encoder: nn.Module, feature_dim: int, proj_dim: int = 512,
                 hidden: int = 2048, predictor: bool = False, pred_hidden: int = 2048,
                 norm: str = "layer"):
        super().__init__()
        for name, value in (("feature_dim", feature_dim), ("proj_dim", proj_dim),
                            ("hidden", hidden), ("pred_hidden", pred_hidden)):
            if not (isinstance(value, int) and value >= 1):
                raise UsageError(f"ssl model {name}={value!r}: must be a positive integer")
        if norm not in NORMS:
            allowed = ", ".join(map(repr, NORMS))
            raise UsageError(f"ssl model norm={norm!r}: must be one of {allowed}")
        self.encoder = encoder
        self.projector = mlp_head(feature_dim, hidden, proj_dim, norm)
        self.predictor = mlp_head(proj_dim, pred_hidden, proj_dim, norm) if predictor else None
        self.feature_dim, self.proj_dim = feature_dim, proj_dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Representation f(x) [B, feature_dim] (kNN, linear probe, fine-tuning)."""
        return self.encoder.features(x)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """z = g(f(x)) [B, proj_dim], not normalised."""
        return self.projector(self.encode(x))

    def predict(self, z: torch.Tensor) -> torch.Tensor:
        """p = q(z) [B, proj_dim]."""
        if self.predictor is None:
            raise RuntimeError("this SSLNet was built without a predictor")
        return self.predictor(z)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)

    def target_copy(self) -> "SSLNet":
        """BYOL's target: a deep copy of encoder + projector, no predictor, no gradients."""
        predictor, self.predictor = self.predictor, None
        try:
            target = copy.deepcopy(self)
        finally:
            self.predictor = predictor
        for p in target.parameters():
            p.requires_grad_(False)
        return target


def group_slices(module: nn.Module) -> dict[str, slice]:
    """Flat-buffer slice of each top-level parameter group (first component of the name),
    in registration order; raises if a group is not contiguous."""
    slices: dict[str, slice] = {}
    offset = 0
    for name, p in module.named_parameters():
        group = name.split(".", 1)[0]
        if group in slices and slices[group].stop != offset:
            raise ValueError(f"parameter group {group!r} is not contiguous")
        start = slices[group].start if group in slices else offset
        offset += p.numel()
        slices[group] = slice(start, offset)
    return slices


def build_ssl_model(backbone_name: str, in_channels: int, image_size: int,
                    backbone_options: dict | None = None, *, proj_dim: int = 512,
                    predictor: bool = False, hidden: int = 2048, pred_hidden: int = 2048,
                    norm: str = "layer") -> SSLNet:
    """SSLNet over registry model ``backbone_name`` (fedmpi.models.build_model) built with
    ``backbone_options`` (a dict: the backbone's own ``hidden`` must not meet the head's).

    The backbone is built with num_classes=1 and its ``classifier`` is replaced by
    nn.Identity, so the classifier has no parameters in the flat buffer and
    ``encoder(x) == encoder.features(x)``; ``proj_dim`` is the SSL projector's, so the
    backbone never gets MOON's head. Building draws from torch's global generator
    (the dropped classifier's initialisation included): seed it first.
    """
    if backbone_name in MODELS and MODELS[backbone_name].modality != "image":
        raise UsageError(f"model.name {backbone_name!r} is a {MODELS[backbone_name].modality} "
                         "model; self-supervised learning needs an image backbone")
    backbone = build_model(backbone_name, in_channels, 1, image_size, **(backbone_options or {}))
    feature_dim = backbone.classifier.in_features
    backbone.classifier = nn.Identity()
    return SSLNet(backbone, feature_dim, proj_dim=proj_dim, hidden=hidden, predictor=predictor,
                  pred_hidden=pred_hidden, norm=norm)
