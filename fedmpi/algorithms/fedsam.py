"""FedSAM: Generalized Federated Learning via Sharpness Aware Minimization.

Qu, Li, Duan, Liu, Tang, Lu, ICML 2022, https://arxiv.org/abs/2206.02618
[code: FL-Simulator client/fedsam.py, optimizer/ESAM.py]:

    client: each step g1 = grad f(w), e = rho g1 / (||g1|| + 1e-7), g~ = grad f(w + e) on
            the same batch; w <- w - eta_l (clip(g~) + wd w);  upload Delta_i = w_K - x^t
    server: FedAvg, x^{t+1} = x^t + eta_g sum_i n_i Delta_i / sum_i n_i

Messages d down, d up; two forward/backward passes per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import group_sgd, local_sgd
from .base import register
from .fedavg import FedAvg
from .params import Params, param
from .sam import group_gradient, sam_gradient


@register
class FedSAM(FedAvg):
    name = "fedsam"
    paper = "Qu et al. 2022, arXiv:2206.02618"

    @dataclass(frozen=True)
    class Params(Params):
        rho: float = param(0.1, ">= 0", "SAM perturbation radius rho (FL-Simulator 0.1; 0 = plain SGD)")

    def local_update(self, task, payload, client_state, ctx):
        return local_sgd.local_update(task, payload["x"], ctx,
                                      gradient_fn=sam_gradient(self.params.rho))

    def local_update_group(self, tasks, payload, client_states, ctx):
        return group_sgd.local_update(tasks, payload["x"], ctx,
                                      gradient=group_gradient(self.params.rho))
