"""FedNova: Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization.

Wang et al., NeurIPS 2020, https://arxiv.org/abs/2007.07481

Client i runs tau_i local steps from x^t (plain SGD, or heavy-ball momentum rho, or the
FedProx term mu) and uploads the normalised update d_i = (x^t - w_i) / a_i with

    a_i = tau_i                                          (plain SGD)
    a_i = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho)   (momentum rho)
    a_i = [1 - (1 - eta_l mu)^tau_i] / (eta_l mu)            (proximal mu)

and a_i. Server, p_i = n_i / sum_S n:  tau_eff = sum_S p_i a_i,
x^{t+1} = x^t - eta_g tau_eff sum_S p_i d_i. Messages d down, d + 1 up (d_i, a_i); no
state. [code: NIID-Bench train_net_fednova, in LonelyMoonDesert/FNR-FL train.py]

Momentum accumulates the corrected loss gradient before clipping (v <- rho v + g, step
with v); weight decay stays outside it as in every fedmpi step, and a_i counts neither
weight decay nor clipping. ``train.momentum`` instead of ``rho`` is the shared local
optimizer's momentum (after clipping, as torch.optim.SGD under NIID-Bench's clip-free
loop); a_i then takes it as rho. The paper gives a_i for momentum or prox, not both, so rho
and mu are not accepted together.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..errors import UsageError
from . import group_sgd, local_sgd, schedule
from .base import Algorithm, register
from .local_sgd import rows_of
from .fedprox import proximal
from .params import Params, param, param_error


def heavy_ball(rho: float, like: torch.Tensor):
    """Local momentum as a gradient correction: v <- rho v + g; g <- v (v starts at 0)."""
    velocity = torch.zeros_like(like)

    def correct(grads, params):
        v = rows_of(velocity, grads)
        v.mul_(rho).add_(grads)
        grads.copy_(v)
    return correct


def normalizer(tau: int, rho: float = 0.0, eta_mu: float = 0.0) -> float:
    """FedNova's a_i (Wang et al. 2020, section 4) for tau local steps."""
    if rho:
        return (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)
    if eta_mu:
        return (1 - (1 - eta_mu) ** tau) / eta_mu
    return float(tau)


@register
class FedNova(Algorithm):
    name = "fednova"
    paper = "Wang et al. 2020, arXiv:2007.07481"
    local_sgd_only = "a_i counts the update as tau_i SGD steps (plain, momentum or prox)"
    diagnostic_fields = ("tau_eff",)

    @dataclass(frozen=True)
    class Params(Params):
        rho: float = param(0.0, "[0, 1)", "local momentum rho (0 = plain SGD)")
        mu: float = param(0.0, ">= 0", "local proximal weight mu (0 = none)")

        def __post_init__(self):
            super().__post_init__()
            if self.rho and self.mu:
                raise param_error("mu", "must be 0 when algorithm.rho > 0 "
                                        "(a_i is defined for momentum or prox, not both)")

    def check_training(self, train):
        schedule.require_constant_local(train, "fednova", "a_i")
        if train.momentum and (self.params.rho or self.params.mu):
            which = "rho" if self.params.rho else "mu"
            raise UsageError(f"config field algorithm.{which}: must be 0 with train.momentum = "
                             f"{train.momentum} (a_i then counts train.momentum as rho; one "
                             f"momentum, and no prox with it)")

    def traffic(self, d, phase):
        return d, d + 1

    def gather_sizes(self, d, phase=None):
        return {"a": 1}

    def contribution_sizes(self, d, phase=None):
        return {"normalized": d, "weight": 1}

    def server_update(self, state, sums, gathered, ctx):
        # host sync: server, once per round
        state["x"].sub_(sums["normalized"],
                        alpha=ctx.global_lr * self._tau_eff(gathered) / float(sums["weight"]))

    def diagnostics(self, state, sums, gathered, ctx):
        return {"tau_eff": self._tau_eff(gathered)}

    @staticmethod
    def _tau_eff(gathered) -> float:
        n = gathered["n_samples"]
        return float(np.sum(n * gathered["a"]) / np.sum(n))

    def local_update(self, task, payload, client_state, ctx):
        x = payload["x"]
        upload = local_sgd.local_update(task, x, ctx, self.correction(x, task.model.grads))
        return self._normalized(upload, ctx)

    def local_update_group(self, tasks, payload, client_states, ctx):
        x, model = payload["x"], tasks[0].model
        like = model.grads.new_empty(len(tasks), model.num_params)  # a velocity per client
        uploads = group_sgd.local_update(tasks, x, ctx, self.correction(x, like))
        return [self._normalized(u, ctx) for u in uploads]

    def correction(self, x, grads_like):
        p = self.params
        if p.rho:
            return heavy_ball(p.rho, grads_like)
        if p.mu:
            return proximal(p.mu, x)
        return None

    def _normalized(self, upload, ctx):
        p = self.params
        a = normalizer(upload.steps, p.rho or ctx.momentum, ctx.lr * p.mu)
        upload.extras["a"] = torch.tensor([a], dtype=torch.float64)
        return upload

    def contribution(self, upload):
        n, a = float(upload.num_samples), float(upload.extras["a"])  # host sync: none, a CPU tensor
        # n_i d_i = -n_i Delta_i / a_i; a client without a step contributes only its weight
        scale = -n / a if a > 0 else 0.0
        return {"normalized": upload.delta * scale,
                "weight": torch.tensor([n], dtype=upload.delta.dtype, device=upload.delta.device)}

    def gather(self, upload):
        return {"a": upload.extras["a"]}

    def refined_upload(self, upload, x, w, w_new, steps, ctx):
        """FNR-FL: a' = a + a_re, a_re this normaliser of the refinement's plain SGD steps
        (``train.momentum`` as rho: rho and mu act only in this method's own steps), and
        n d = -n (w_new - x) / a' in place of -n (w - x) / a."""
        a = float(upload.extras["a"].reshape(-1)[0])   # host sync: once per refined client
        a_new = torch.tensor([a + normalizer(steps, ctx.momentum)], dtype=torch.float64)
        new = replace(upload, delta=w_new - x, extras={**upload.extras, "a": a_new})
        return new, {"normalized": self.contribution(new)["normalized"]
                     - self.contribution(upload)["normalized"]}
