"""FedACG: Communication-Efficient Federated Learning with Accelerated Client Gradient.

Kim, Kim and Han, CVPR 2024, https://arxiv.org/abs/2201.03172

The server broadcasts one vector, the lookahead x_hat = x^{t-1} + lambda m^{t-1}.
Client i starts at w_0 = x_hat, runs K SGD steps on CE(w) + (beta/2)||w - x_hat||^2
(+ wd) and uploads Delta_i = w_K - x_hat. With the plain mean over S_t (repo convention;
the paper's splits are balanced, so |D_i| weights are the same):

    Dbar = (1/S) sum_i Delta_i;   m^t = lambda m^{t-1} + Dbar;   x^t = x^{t-1} + eta_g m^t

(m^0 = 0, eta_g = train.global_lr = 1, so x^t is the mean of the client models).
Evaluation uses x^t, not the lookahead. Messages d down, d up; server state m (d).
beta: paper (Table 5b default) 0.01 in (beta/2)||.||^2; the repo adds w_prox ||.||^2
un-halved with w_prox = 1e-3 (prox_form = "repo", beta = 0.001). The repo's LambdaLR
also decays eta_l once per local epoch within a round; negligible, not reproduced.
lambda = 0, beta = 0 is FedAvg with a plain mean; beta = 0 is FedAvgM(beta = lambda)
with the clients started at x_hat instead of x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import group_sgd, local_sgd, server_opt
from .base import Algorithm, register
from .fedprox import proximal
from .params import Params, param

PROX_FORMS = ("paper", "repo")


@register
class FedACG(Algorithm):
    name = "fedacg"
    paper = "Kim et al. 2024, arXiv:2201.03172"

    @dataclass(frozen=True)
    class Params(Params):
        lam: float = param(0.85, "[0, 1)",
                           "lambda: global momentum and lookahead x + lambda m (paper/repo 0.85)")
        beta: float = param(0.01, ">= 0", "prox weight beta toward the lookahead "
                                          "(paper 0.01; repo 0.001 with prox_form='repo')")
        prox_form: str = param("paper", PROX_FORMS, "'paper': (beta/2)||w - x_hat||^2; "
                                                    "'repo': beta ||w - x_hat||^2 (un-halved w_prox)")

    def init_server_state(self, x):
        return {"x": x.clone(), "m": torch.zeros_like(x)}

    def compressible(self, d):
        return {"up": {"delta": d}, "down": {"x_hat": d}}

    def payload(self, state, ctx):
        return {"x_hat": state["x"] + self.params.lam * state["m"]}

    def local_update(self, task, payload, client_state, ctx):
        x_hat = payload["x_hat"]
        return local_sgd.local_update(task, x_hat, ctx, self.correction(x_hat[:task.model.num_params]))

    def local_update_group(self, tasks, payload, client_states, ctx):
        x_hat = payload["x_hat"]
        return group_sgd.local_update(tasks, x_hat, ctx, self.correction(x_hat))

    def correction(self, x_hat):
        # The gradient of beta ||.||^2 (repo) is twice that of (beta/2) ||.||^2 (paper).
        mu = self.params.beta * (2.0 if self.params.prox_form == "repo" else 1.0)
        return proximal(mu, x_hat) if mu else None

    def contribution(self, upload):
        return server_opt.count_once(upload)   # the repo's plain mean over S_t

    def server_update(self, state, sums, gathered, ctx):
        m = server_opt.momentum(state["m"], server_opt.mean_update(sums), self.params.lam)
        state["x"].add_(m, alpha=ctx.global_lr)
