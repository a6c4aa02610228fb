"""MoFedSAM: FedSAM with FedCM's client-level momentum.

Qu, Li, Duan, Liu, Tang, Lu, "Generalized Federated Learning via Sharpness Aware
Minimization", ICML 2022, https://arxiv.org/abs/2206.02618
[code: FL-Simulator client/mofedsam.py, server/MoFedSAM.py]:

    client: m = -Dbar^{t-1} / (K eta_l^{t-1});  each step g~ = SAM gradient (rho, as FedSAM),
            v = alpha g~ + (1 - alpha) m,  w <- w - eta_l (clip(v) + c wd w)
            (c as FedCM's ``decay``: alpha by default, 1 as FL-Simulator)
    server: as FedCM, x^{t+1} = x^t + eta_g Dbar^t (n_i-weighted mean)

Messages 2d down (x, m), d up; server keeps Dbar and K. Defaults from the FL-Simulator
README (rho 0.1, alpha 0.1); FedMRUR's MoFedSAM baseline uses rho 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import group_sgd, local_sgd
from .base import register
from .fedcm import FedCM
from .params import param
from .sam import group_gradient, sam_gradient


@register
class MoFedSAM(FedCM):
    name = "mofedsam"
    paper = "Qu et al. 2022, arXiv:2206.02618"

    @dataclass(frozen=True)
    class Params(FedCM.Params):
        rho: float = param(0.1, ">= 0", "SAM perturbation radius rho (FL-Simulator 0.1; FedMRUR paper 0.5)")

    def local_update(self, task, payload, client_state, ctx):
        return local_sgd.local_update(task, payload["x"], self.decayed(ctx), self.correction(payload),
                                      gradient_fn=sam_gradient(self.params.rho))

    def local_update_group(self, tasks, payload, client_states, ctx):
        return group_sgd.local_update(tasks, payload["x"], self.decayed(ctx), self.correction(payload),
                                      gradient=group_gradient(self.params.rho))
