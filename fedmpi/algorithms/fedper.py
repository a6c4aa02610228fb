"""FedPer: Federated Learning with Personalization Layers.

Arivazhagan, Aggarwal, Singh, Choudhary 2019, https://arxiv.org/abs/1912.00818

FedAvg over the base layers; each client keeps its personalisation layers (by default
the classifier head), trained with the base in every local update and never sent. A
client's head starts from the initial model's at its first participation. Messages:
d_shared down and up (fedmpi.runtime.partial). ``private = []`` is FedAvg, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import register
from .params import Params, param
from .private import PrivateLayers, check_names, resolve


@register
class FedPer(PrivateLayers):
    name = "fedper"
    paper = "Arivazhagan et al. 2019, arXiv:1912.00818"

    @dataclass(frozen=True)
    class Params(Params):
        private: list = param(["head"], None, "the layers each client keeps: module names, or "
                                              "head | body | norm ([] = FedAvg)")

        def __post_init__(self):
            super().__post_init__()
            check_names(self.private)

    def private_layers(self, module):
        return resolve(self.params.private, module)
