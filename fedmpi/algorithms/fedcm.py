"""FedCM: Federated Learning with Client-level Momentum.

Xu, Wang, Wang, Zhang, Wang, Huang, https://arxiv.org/abs/2106.10874, in the form of
FL-Simulator (woodenchild95/FL-Simulator client/fedcm.py, server/FedCM.py):

    client: m = -Dbar^{t-1} / (K eta_l^{t-1});  each step w <- w - eta_l (clip(v) + c wd w),
            v = alpha g(w) + (1 - alpha) m;  upload Delta_i = w_K - x^t
            c = alpha (``decay = "matched"``, effective decay wd as FedAvg's) or
            c = 1 (``"code"``, FL-Simulator's SGD weight_decay: effective wd / alpha)
    server: Dbar^t = sum_i n_i Delta_i / sum_i n_i;  x^{t+1} = x^t + eta_g Dbar^t

Messages: 2d down (x, m), d up. The server keeps Dbar and its mean step count K
(``momentum`` explains K with unequal clients); m = 0 in round 0. m spans the flat state
(parameters, then float buffers); only its parameter part enters the gradient
(``momentum.mixed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import group_sgd, local_sgd, momentum, schedule
from .base import register
from .fedavg import FedAvg
from .params import Params, param


@register
class FedCM(FedAvg):
    name = "fedcm"
    paper = "Xu et al. 2021, arXiv:2106.10874"
    local_sgd_only = "m = -Dbar / (K eta_l) reads the last update as K SGD steps"

    @dataclass(frozen=True)
    class Params(Params):
        alpha: float = param(0.1, "[0, 1]", "weight of the fresh gradient, "
                                            "v = alpha g + (1 - alpha) m (FL-Simulator 0.1)")
        decay: str = momentum.decay_param()

    def traffic(self, d, phase):
        return 2 * d, d

    def init_server_state(self, x):
        return {"x": x.clone(), "D": torch.zeros_like(x),
                "K": torch.zeros(1, dtype=torch.float64)}   # K = 0: no update yet, m = 0

    def compressible(self, d):
        return {"up": {"delta": d}, "down": {"x": d, "m": d}}

    def payload(self, state, ctx):
        # host sync: server, once per round
        m = momentum.gradient_units(state["D"], float(state["K"]), ctx.lr_prev)
        return {"x": state["x"], "m": m}

    def check_training(self, train):
        schedule.require_constant_local(train, self.name, "the momentum's m = -D / (K eta_l)")

    def effective_weight_decay(self, weight_decay):
        return momentum.effective_decay(weight_decay, self.params.alpha, self.params.decay)

    def local_update(self, task, payload, client_state, ctx):
        return local_sgd.local_update(task, payload["x"], self.decayed(ctx), self.correction(payload))

    def local_update_group(self, tasks, payload, client_states, ctx):
        return group_sgd.local_update(tasks, payload["x"], self.decayed(ctx), self.correction(payload))

    def correction(self, payload):
        return momentum.mixed(self.params.alpha, payload["m"])

    def decayed(self, ctx):
        """The local steps' context: the decay placed as ``decay`` says (``momentum``)."""
        return momentum.decayed(ctx, self.params.alpha, self.params.decay)

    def server_update(self, state, sums, gathered, ctx):
        super().server_update(state, sums, gathered, ctx)
        state["D"] = sums["delta"] / float(sums["weight"])  # host sync: server, once per round
        state["K"][0] = momentum.mean_steps(gathered, weighted=True)
