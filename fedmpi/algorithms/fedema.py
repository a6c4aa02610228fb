"""FedEMA: FedBYOL whose clients start from a divergence-aware EMA of local and global.

Zhuang et al., "Divergence-aware Federated Self-Supervised Learning", ICLR 2022,
https://arxiv.org/abs/2204.04385; rules from EasyFL applications/fedssl client.py (the
authors' code, SELECTIVE_EMA with auto_scaler).

Client k with local online model W_k^local (encoder, projector, predictor) and divergence
delta_k of its last local training (fedmpi.algorithms.byol.encoder_divergence):

    mu_k = min(lambda_k delta_k, 1),    W_k <- mu_k W_k^local + (1 - mu_k) W_g,

lambda_k = tau / delta_k fixed after the client's first local training (tau = 0.7). The EMA
applies only if the client trained in the previous round; otherwise (and at the first
participation) it starts from the global model and its target is reset to the global
encoder + projector (EasyFL SELECTIVE_EMA). Then BYOL as in FedBYOL (local target, EMA per
step). Server: FedAvg of encoder, projector and predictor. Messages d down, d up.
Client state: target (d - |q|), seen (1), online (d), divergence delta_k (1), lam (1),
last_round (1), mu (1: the mu_k this update started from, 0 = global).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import register
from .byol import BYOLParams, encoder_divergence
from .fedbyol import FedBYOL
from .params import param

# lambda_k = tau / max(delta_k, _TINY): a first training that did not move the encoder
# (lr = 0) must not store inf or nan.
_TINY = 1e-12


@register
class FedEMA(FedBYOL):
    name = "fedema"
    paper = "Zhuang et al. 2022, arXiv:2204.04385"

    @dataclass(frozen=True)
    class Params(BYOLParams):
        tau: float = param(0.7, "> 0",
                           "auto-scaler target: lambda_k = tau / delta_k after the first training")

    def client_state_sizes(self, d):
        return {**super().client_state_sizes(d), "online": d, "divergence": 1, "lam": 1,
                "last_round": 1, "mu": 1}

    @staticmethod
    def trained_last_round(client_state, ctx, seen: bool) -> bool:
        # host sync: once per client
        return seen and int(client_state["last_round"].item()) == ctx.round - 1

    def mu_k(self, client_state, ctx, seen: bool) -> float:
        """min(lambda_k delta_k, 1) if the client trained in round t - 1, else 0 (global)."""
        if not self.trained_last_round(client_state, ctx, seen):
            return 0.0
        # host sync: once per client
        return min(float(client_state["lam"].item()) * float(client_state["divergence"].item()), 1.0)

    def start(self, x, client_state, ctx, seen):
        if not self.trained_last_round(client_state, ctx, seen):
            return x, x[:self.target_size(len(x))]
        mu = self.mu_k(client_state, ctx, seen)
        return client_state["online"] * mu + x * (1 - mu), client_state["target"]

    def extra_state(self, task, start, client_state, ctx, seen):
        w = task.model.params
        delta = encoder_divergence(task.model, start, w)
        lam = client_state["lam"] if seen else self.params.tau / delta.clamp(min=_TINY)
        one = torch.ones(1, device=w.device)
        return {"online": w.clone(), "divergence": delta, "lam": lam,
                "last_round": one * ctx.round, "mu": one * self.mu_k(client_state, ctx, seen)}
