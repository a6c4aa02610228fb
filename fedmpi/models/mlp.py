"""A multilayer perceptron for tabular features (modality "tabular").

FedAvg's "2NN" and most federated benchmarks on tabular data (Adult, covertype, the UCI
sets) use such a network: fully connected layers with ReLU and a linear classifier. It
takes the float32 features [B, F] that the arrays loader standardises; with ``hidden``
empty it is multinomial logistic regression.
"""

from __future__ import annotations

import torch
from torch import nn

from fedmpi.models.classifier import Classifier


class MLP(Classifier):
    """Linear(F, h1) -> ReLU -> ... -> Linear(h_k, num_classes).

    The `build_model` signature is shared with the image models: for tabular data
    `in_channels` is the number of features F (`Dataset.in_channels`) and `image_size`
    is 1, which does not change the network.
    """

    def __init__(self, in_channels: int, num_classes: int, image_size: int,
                 hidden: tuple[int, ...] = (64, 64)):
        super().__init__()
        layers, width = [], in_channels
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        self.body = nn.Sequential(*layers)  # empty: the features are the inputs
        self.classifier = nn.Linear(width, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate representation [B, hidden[-1]] (x itself without hidden layers)."""
        return self.body(x)

    def chain(self) -> list[nn.Module] | None:
        """The layers whose composition is ``forward`` (the image flattened first for the
        2NN), which a client group differentiates by hand
        (fedmpi.algorithms.group_chain); None for a subclass whose forward is not that."""
        if type(self).forward is not Classifier.forward \
                or type(self).features not in (MLP.features, TwoNN.features):
            return None
        head = [nn.Flatten()] if type(self).features is TwoNN.features else []
        return head + list(self.body) + [self.classifier]


class TwoNN(MLP):
    """The "2NN" of McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data" (AISTATS 2017, https://arxiv.org/abs/1602.05629): the image
    flattened, two hidden layers of 200 units with ReLU, a linear classifier (199,210
    parameters on 28x28x1), the small model of cross-device FL."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int,
                 hidden: tuple[int, ...] = (200, 200)):
        super().__init__(in_channels * image_size * image_size, num_classes, 1, hidden)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.flatten(1))
