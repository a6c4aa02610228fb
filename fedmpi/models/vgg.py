"""VGG-11 for small images: Simonyan & Zisserman, "Very Deep Convolutional Networks for
Large-Scale Image Recognition" (ICLR 2015, https://arxiv.org/abs/1409.1556), configuration A,
with the 512-512-512 head and init of NIID-Bench / FNR-FL `vggmodel.py`
[code: Xtra-Computing/NIID-Bench, LonelyMoonDesert/FNR-FL].

Two deviations keep any image size working and are no-ops for 32x32 inputs: max-pools
round up (28x28 gives 14, 7, 4, 2, 1 instead of reaching 0), and an adaptive average pool
to 1x1 precedes the head.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedmpi.models.classifier import Classifier

CONFIG_A = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
WIDTHS = (64, 128, 256, 512)  # with norm="group", num_groups must divide all of these
NORMS = ("none", "group")


def _conv_stack(in_channels: int, norm: str, num_groups: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for v in CONFIG_A:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2, ceil_mode=True))
            continue
        layers.append(nn.Conv2d(in_channels, v, kernel_size=3, padding=1))
        if norm == "group":
            layers.append(nn.GroupNorm(num_groups, v))
        layers.append(nn.ReLU(inplace=True))
        in_channels = v
    return nn.Sequential(*layers)


class VGG11(Classifier):
    """VGG-11 (Simonyan & Zisserman 2015, config A) with NIID-Bench's small-image head."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int,
                 norm: str = "none", num_groups: int = 2, dropout: float = 0.5):
        super().__init__()
        del image_size  # the adaptive pool makes the network size-agnostic
        self.convs = _conv_stack(in_channels, norm, num_groups)
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Dropout(dropout), nn.Linear(512, 512), nn.ReLU(inplace=True),
            nn.Dropout(dropout), nn.Linear(512, 512), nn.ReLU(inplace=True),
        )
        self.classifier = nn.Linear(512, num_classes)
        self._niid_bench_init()

    def _niid_bench_init(self) -> None:
        """Convolutions ~ N(0, 2 / (k*k*out)), zero bias, as NIID-Bench; linears keep PyTorch's."""
        for module in self.convs.modules():
            if isinstance(module, nn.Conv2d):
                fan_out = module.kernel_size[0] * module.kernel_size[1] * module.out_channels
                nn.init.normal_(module.weight, 0.0, math.sqrt(2.0 / fan_out))
                nn.init.zeros_(module.bias)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Penultimate representation [B, 512], the input of `classifier`."""
        return self.head(self.convs(x))

    def blocks(self) -> list[nn.Module] | None:
        """``features`` as six blocks (``Classifier.blocks``): the five stages of the conv
        stack, each ending at its max-pool (64 | 128 | 256-256 | 512-512 | 512-512, with
        their GroupNorms and ReLUs), then the head (pool, flatten, the two hidden linears
        with their dropout); None for a subclass whose ``features`` is not that chain."""
        if type(self).features is not VGG11.features:
            return None
        stages, stage = [], []
        for layer in self.convs:
            stage.append(layer)
            if isinstance(layer, nn.MaxPool2d):
                stages.append(nn.Sequential(*stage))
                stage = []
        return stages + [self.head]
