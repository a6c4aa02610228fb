"""The two-layer CNN of McMahan et al., "Communication-Efficient Learning of Deep Networks
from Decentralized Data" (AISTATS 2017, https://arxiv.org/abs/1602.05629).

Two padding options, one network each:

- ``padding = "valid"`` (the default, which the presets, benchmarks, stored reproductions
  and fingerprints use): unpadded 5x5 convolutions, as in most PyTorch FL simulators, so
  the flatten size depends on the image size: 582,026 parameters on 28x28x1 with 10
  classes, 878,538 on 32x32x3;
- ``padding = "same"``: the paper's network as its TensorFlow code builds it, 5x5
  convolutions with padding 2 that keep the side, so only the max-pools shrink it: 7x7x64
  before the fully connected layer on 28x28, 1,663,370 parameters on 28x28x1 with 10
  classes (2.9x the unpadded network), 2,156,490 on 32x32x3.

Both are chains of plain layers (``chain()``), which a client group differentiates by hand
(fedmpi.algorithms.group_chain reads each convolution's padding).
"""

from __future__ import annotations

import torch
from torch import nn

from fedmpi.models.classifier import Classifier

PADDINGS = ("valid", "same")
NORMS = ("none", "batch", "group")   # after each convolution (FedBN's private layers)
KERNEL = 5


def _side_after_block(side: int, padding: str = "valid") -> int:
    """Spatial side after a 5x5 convolution (unpadded for "valid", padded by 2 for
    "same") and a 2x2 max-pool."""
    return (side - (KERNEL - 1 if padding == "valid" else 0)) // 2


class CNN(Classifier):
    """McMahan et al. 2017 CNN: 2 x (conv5x5 -> ReLU -> maxpool2) -> Linear(hidden) -> ReLU -> Linear;
    the convolutions unpadded (``padding="valid"``) or padded by 2 (``"same"``, the paper's)."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int,
                 hidden: int = 512, channels: tuple[int, int] = (32, 64),
                 padding: str = "valid", norm: str = "none"):
        super().__init__()
        if padding not in PADDINGS:
            raise ValueError(f"padding must be one of {PADDINGS}, got {padding!r}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        self.norm = norm
        c1, c2 = channels
        side = _side_after_block(_side_after_block(image_size, padding), padding)
        # an int, not the string "same": group_chain writes out zero-padded convolutions
        # with numeric padding (torch's "same" is a string it leaves to vmap)
        pad = 0 if padding == "valid" else KERNEL // 2
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, c1, kernel_size=KERNEL, padding=pad), *_norm(norm, c1),
            nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel_size=KERNEL, padding=pad), *_norm(norm, c2),
            nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(c2 * side * side, hidden), nn.ReLU(),
        )
        self.classifier = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate representation [B, hidden], the input of `classifier`."""
        return self.body(x)

    def chain(self) -> list[nn.Module] | None:
        """The layers whose composition is ``forward``, which a client group
        differentiates by hand (fedmpi.algorithms.group_chain); None for a subclass whose
        forward is not that."""
        if type(self).forward is not Classifier.forward or type(self).features is not CNN.features \
                or self.norm != "none":
            return None
        return list(self.body) + [self.classifier]

    def blocks(self) -> list[nn.Module] | None:
        """``features`` as three blocks (``Classifier.blocks``): conv block 1 (conv, ReLU,
        max-pool), conv block 2 (the same) and the flatten + hidden linear + ReLU; None for
        a subclass whose ``features`` is not the body."""
        if type(self).features is not CNN.features:
            return None
        layers, k = list(self.body), 3 if self.norm == "none" else 4
        return [nn.Sequential(*layers[0:k]), nn.Sequential(*layers[k:2 * k]),
                nn.Sequential(*layers[2 * k:])]


def _norm(norm: str, channels: int) -> list[nn.Module]:
    """The normalisation after a convolution: none, BatchNorm, or GroupNorm in 2 groups
    (one group where the channels are odd)."""
    if norm == "batch":
        return [nn.BatchNorm2d(channels)]
    if norm == "group":
        return [nn.GroupNorm(2 if channels % 2 == 0 else 1, channels)]
    return []
