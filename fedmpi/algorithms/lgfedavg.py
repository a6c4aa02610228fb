"""LG-FedAvg: Think Locally, Act Globally: Federated Learning with Local and Global
Representations.

Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency 2020,
https://arxiv.org/abs/2001.01523

The mirror of FedPer: each client keeps its own representation (every layer below the
head) and FedAvg averages the global head. A client's body starts from the initial
model's at its first participation (the paper starts every client from a FedAvg
pre-trained model: run FedAvg first and start from its model for that). Messages: the
head's values down and up (fedmpi.runtime.partial).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import register
from .fedper import FedPer
from .params import param


@register
class LGFedAvg(FedPer):
    name = "lg_fedavg"
    paper = "Liang et al. 2020, arXiv:2001.01523"

    @dataclass(frozen=True)
    class Params(FedPer.Params):
        private: list = param(["body"], None, "the local layers: module names, or head | "
                                              "body | norm")
