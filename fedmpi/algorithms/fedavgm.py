"""FedAvgM: Measuring the Effects of Non-Identical Data Distribution for Federated Visual Classification.

Hsu, Qi and Brown, 2019, https://arxiv.org/abs/1909.06335

Clients as FedAvg (E epochs of local SGD from x^t, upload Delta_i = x_{i,K} - x^t).
Server momentum on the n_i-weighted mean Dbar = sum_i n_i Delta_i / sum_i n_i:

    v <- beta v + Dbar;   x^{t+1} = x^t + eta_g v        (v^0 = 0, eta_g = train.global_lr = 1)

Messages d down, d up; server state v (d). beta = 0 is FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import server_opt
from .base import register
from .fedavg import FedAvg
from .params import Params, param


@register
class FedAvgM(FedAvg):
    name = "fedavgm"
    paper = "Hsu et al. 2019, arXiv:1909.06335"

    @dataclass(frozen=True)
    class Params(Params):
        beta: float = param(0.9, "[0, 1)",
                            "server momentum beta (0.9; the FedACG repo's FedAvgM baseline uses 0.4)")

    def init_server_state(self, x):
        return {"x": x.clone(), "v": torch.zeros_like(x)}

    def server_update(self, state, sums, gathered, ctx):
        v = server_opt.momentum(state["v"], server_opt.mean_update(sums), self.params.beta)
        state["x"].add_(v, alpha=ctx.global_lr)
