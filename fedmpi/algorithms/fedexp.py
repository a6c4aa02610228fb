"""FedExP: Speeding Up Federated Averaging via Extrapolation.

Jhunjhunwala, Wang and Joshi, ICLR 2023, https://arxiv.org/abs/2301.09604

Clients as FedAvg. With q_i = n_i / sum_{S_t} n and Dbar = sum_i q_i Delta_i the server
takes an adaptive extrapolation step

    eta_g^t = max(1, sum_i q_i ||Delta_i||^2 / (2 (||Dbar||^2 + eps))),   x^{t+1} = x^t + eta_g^t Dbar

(train.global_lr, 1 by default, multiplies the step, so the config says what ran).

sum_i q_i ||Delta_i||^2 travels as a one-value contribution next to Delta_i; the server
could compute it from the uploads it already has, so it is not FL traffic: d down, d up.
Paper rule by default; the official code's choices (Divyansh03/FedExP main.py) are
parameters: S*eps, eps shrinking like eta_l^2 (eps^t = eps decay^{2t}; the code also
decays both once before round 0, we start both undecayed), and evaluating the average
of the last two iterates (x^{t+1} + x^t)/2 while training continues from x^{t+1}
(server state x_prev, d). Diagnostic: the step eta_g^t per round ("fedexp_step").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UsageError
from . import server_opt
from .base import register
from .fedavg import FedAvg
from .params import Params, param


@register
class FedExP(FedAvg):
    name = "fedexp"
    paper = "Jhunjhunwala et al. 2023, arXiv:2301.09604"
    diagnostic_fields = ("fedexp_step",)

    @dataclass(frozen=True)
    class Params(Params):
        eps: float = param(1e-3, "> 0", "eps in the step's denominator (code: 1e-3 CIFAR, 0.1 EMNIST)")
        eps_per_client: bool = param(False, doc="official code: use S*eps (S = participants "
                                                "this round) instead of eps")
        eps_decay: bool = param(False, doc="official code: eps^t = eps * lr_decay^(2t), "
                                           "shrinking like eta_l^2")
        average_iterates: bool = param(False, doc="official code: evaluate (x^{t+1} + x^t)/2; "
                                                  "training continues from x^{t+1}")

    def contribution_sizes(self, d, phase=None):
        return {**super().contribution_sizes(d, phase), "sq_norm": 1}

    def contribution(self, upload):
        out = super().contribution(upload)
        sq = torch.linalg.vector_norm(upload.delta).square() * float(upload.num_samples)
        return {**out, "sq_norm": sq.reshape(1)}

    def init_server_state(self, x):
        state = super().init_server_state(x)
        if self.params.average_iterates:
            state["x_prev"] = x.clone()
        return state

    def check_training(self, train):
        if self.params.eps_decay and (train.lr_schedule != "exponential" or train.warmup_rounds):
            raise UsageError("config field algorithm.eps_decay: needs train.lr_schedule = "
                             "\"exponential\" without warm-up (eps^t shrinks by lr_decay^2t)")

    def epsilon(self, ctx) -> float:
        """eps^t: eps, times S and/or decay^{2t} when the code's options are on."""
        eps = self.params.eps
        if self.params.eps_per_client:
            eps *= len(ctx.participants)
        if self.params.eps_decay:
            eps *= (ctx.lr / ctx.lr_prev) ** (2 * ctx.round)
        return eps

    def step(self, sums, ctx) -> float:
        """eta_g^t from the reduced contributions."""
        # host sync: server, once per round
        mean_sq_norm = float(sums["sq_norm"]) / float(sums["weight"])
        return server_opt.extrapolation(mean_sq_norm, server_opt.mean_update(sums), self.epsilon(ctx))

    def server_update(self, state, sums, gathered, ctx):
        averaging = self.params.average_iterates
        if averaging:
            state["x_prev"].copy_(state["x"])
        state["x"].add_(server_opt.mean_update(sums), alpha=ctx.global_lr * self.step(sums, ctx))
        if averaging and ctx.round == 0:
            state["x_prev"].copy_(state["x"])  # as the code: round 0 reports x^1 itself

    def eval_params(self, state):
        if self.params.average_iterates:
            return (state["x"] + state["x_prev"]) * 0.5
        return state["x"]

    def diagnostics(self, state, sums, gathered, ctx):
        return {"fedexp_step": self.step(sums, ctx)}
