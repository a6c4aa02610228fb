"""ResNet-18 with GroupNorm: He et al., "Deep Residual Learning for Image Recognition"
(CVPR 2016, https://arxiv.org/abs/1512.03385), with every BatchNorm replaced by GroupNorm
(Wu & He, "Group Normalization", ECCV 2018) as FL papers do, so no running statistics exist.

Two stems, after the code the seed papers used:
- "cifar":    3x3 stride-1 conv1, no max-pool, PyTorch default init
              [geehokim/FedACG models/resnet.py];
- "imagenet": 7x7 stride-2 conv1 + 3x3 stride-2 max-pool, torchvision's init
              [woodenchild95/FL-Simulator models.py, torchvision resnet18 with GN(2)].
"""

from __future__ import annotations

import torch
from torch import nn

from fedmpi.models.classifier import Classifier

WIDTHS = (64, 128, 256, 512)  # every GroupNorm's num_groups must divide all of these
STEMS = ("cifar", "imagenet")


def _conv3x3(in_planes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """He et al. 2016 basic residual block (two 3x3 convs), GroupNorm instead of BatchNorm."""

    def __init__(self, in_planes: int, planes: int, stride: int, num_groups: int):
        super().__init__()
        self.conv1 = _conv3x3(in_planes, planes, stride)
        self.norm1 = nn.GroupNorm(num_groups, planes)
        self.conv2 = _conv3x3(planes, planes)
        self.norm2 = nn.GroupNorm(num_groups, planes)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False),
                nn.GroupNorm(num_groups, planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def _stem(in_channels: int, stem: str, num_groups: int) -> nn.Sequential:
    if stem == "cifar":
        conv, pool = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False), nn.Identity()
    else:
        conv = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        pool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
    return nn.Sequential(conv, nn.GroupNorm(num_groups, 64), nn.ReLU(inplace=True), pool)


def _stage(in_planes: int, planes: int, stride: int, num_groups: int) -> nn.Sequential:
    return nn.Sequential(BasicBlock(in_planes, planes, stride, num_groups),
                         BasicBlock(planes, planes, 1, num_groups))


class ResNet18(Classifier):
    """ResNet-18 (He et al. 2016) with GroupNorm(num_groups); 512-d features after global avg-pool."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int,
                 num_groups: int = 2, stem: str = "cifar"):
        super().__init__()
        del image_size  # global average pooling makes the network size-agnostic
        self.stem = _stem(in_channels, stem, num_groups)
        self.layer1 = _stage(64, 64, 1, num_groups)
        self.layer2 = _stage(64, 128, 2, num_groups)
        self.layer3 = _stage(128, 256, 2, num_groups)
        self.layer4 = _stage(256, 512, 2, num_groups)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(512, num_classes)
        if stem == "imagenet":
            self._torchvision_init()

    def _torchvision_init(self) -> None:
        """Re-initialise the convolutions as torchvision.models.resnet18 does."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate representation [B, 512] (global average pool output)."""
        x = self.layer2(self.layer1(self.stem(x)))
        return self.pool(self.layer4(self.layer3(x)))

    def blocks(self) -> list[nn.Module] | None:
        """``features`` as five blocks (``Classifier.blocks``), FedMLB's levels for
        ResNet-18 [code: jinkyu032/FedMLB models/resnet_FedMLB.py]: the stem, layer1,
        layer2, layer3, and layer4 with the global average pool and flatten; None for a
        subclass whose ``features`` is not that chain."""
        if type(self).features is not ResNet18.features:
            return None
        return [self.stem, self.layer1, self.layer2, self.layer3,
                nn.Sequential(self.layer4, self.pool)]
