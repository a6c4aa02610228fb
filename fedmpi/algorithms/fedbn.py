"""FedBN: Federated Learning on Non-IID Features via Local Batch Normalization.

Li, Jiang, Zhang, Kamp, Dou, ICLR 2021, https://arxiv.org/abs/2102.07623

FedAvg, with every normalisation layer (its affine parameters and, for BatchNorm, its
running statistics) kept on the client and never averaged. The models here normalise with
GroupNorm where they normalise at all (``model.norm``), whose affine parameters are what
each client keeps; a model without normalisation layers is refused. Messages: every
other value, down and up (fedmpi.runtime.partial).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import register
from .params import Params
from .private import PrivateLayers, resolve


@register
class FedBN(PrivateLayers):
    name = "fedbn"
    paper = "Li et al. 2021, arXiv:2102.07623"

    @dataclass(frozen=True)
    class Params(Params):
        pass

    def private_layers(self, module):
        return resolve(["norm"], module)
