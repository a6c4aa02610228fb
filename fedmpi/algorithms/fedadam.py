"""FedAdam: Adaptive Federated Optimization.

Reddi et al., ICLR 2021, https://arxiv.org/abs/2003.00295 (Algorithm 2, FedAdam)

Clients as FedAvg. Server Adam without bias correction on the n_i-weighted mean
Dbar = sum_i n_i Delta_i / sum_i n_i:

    m <- b1 m + (1 - b1) Dbar;   v <- b2 v + (1 - b2) Dbar^2;
    x^{t+1} = x^t + eta_g m / (sqrt(v) + tau)            (m^0 = 0, v^0 = v0)

Messages d down, d up; server state m, v (2d). Defaults: b1 0.9, b2 0.99 (Reddi et al.);
tau 1e-3, v0 = tau^2, eta_g 0.01 as the FedACG repo's ServerAdam (Reddi et al. ask for
v0 >= tau^2). Left unset, v0 follows tau (tau^2 of the tau given), so a changed tau keeps
the v0 = tau^2 convention; an explicit v0 (0: FL-Simulator) is kept. FL-Simulator uses
tau 0.01, v0 0, eta_g 0.1 (FedMIM's FedAdam baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import server_opt
from .base import register
from .fedavg import FedAvg
from .params import Params, param


@register
class FedAdam(FedAvg):
    name = "fedadam"
    paper = "Reddi et al. 2021, arXiv:2003.00295"

    @dataclass(frozen=True)
    class Params(Params):
        b1: float = param(0.9, "[0, 1)", "first-moment decay beta_1")
        b2: float = param(0.99, "[0, 1)", "second-moment decay beta_2")
        tau: float = param(1e-3, "> 0",
                           "adaptivity tau added to sqrt(v) (FedACG repo 1e-3; FL-Simulator 0.01)")
        v0: float | None = param(None, ">= 0", "initial second moment v^0; default tau^2 of the "
                                               "tau given (FedACG repo; FL-Simulator 0)")
        eta_g: float = param(0.01, "> 0", "server step eta_g (FedACG README 0.01; FL-Simulator/"
                                          "FedMIM 0.1); train.global_lr multiplies it, keep that 1")

        def __post_init__(self):
            if self.v0 is None and isinstance(self.tau, (int, float)):  # a bad tau is named by the check
                object.__setattr__(self, "v0", float(self.tau) ** 2)
            super().__post_init__()

    def init_server_state(self, x):
        return {"x": x.clone(), "m": torch.zeros_like(x), "v": torch.full_like(x, self.params.v0)}

    def server_update(self, state, sums, gathered, ctx):
        p = self.params
        step = server_opt.adam(state["m"], state["v"], server_opt.mean_update(sums), p.b1, p.b2, p.tau)
        state["x"].add_(step, alpha=p.eta_g * ctx.global_lr)
