"""The two-layer CNN of McMahan et al., "Communication-Efficient Learning of Deep Networks
from Decentralized Data" (AISTATS 2017, https://arxiv.org/abs/1602.05629).

Unlike the paper's TensorFlow code the convolutions are unpadded, as in most PyTorch FL
simulators, so the flatten size depends on the image size.
"""

from __future__ import annotations

import torch
from torch import nn

from fedmpi.models.classifier import Classifier


def _side_after_block(side: int) -> int:
    """Spatial side after an unpadded 5x5 convolution and a 2x2 max-pool."""
    return (side - 4) // 2


class CNN(Classifier):
    """McMahan et al. 2017 CNN: 2 x (conv5x5 -> ReLU -> maxpool2) -> Linear(hidden) -> ReLU -> Linear."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int,
                 hidden: int = 512, channels: tuple[int, int] = (32, 64)):
        super().__init__()
        c1, c2 = channels
        side = _side_after_block(_side_after_block(image_size))
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, c1, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel_size=5), nn.ReLU(), nn.MaxPool2d(2),
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
        if type(self).forward is not Classifier.forward or type(self).features is not CNN.features:
            return None
        return list(self.body) + [self.classifier]
