"""FedU: FedBYOL with a divergence-aware predictor update (DAPU).

Zhuang et al., "Collaborative Unsupervised Visual Representation Learning from
Decentralized Data", ICCV 2021, https://arxiv.org/abs/2108.06492; rules from EasyFL
applications/fedssl (the authors' code).

Client k at the start of a local update: online encoder + projector <- global; predictor

    q_k <- q_global   if delta_k < mu   (or at the first participation),
    q_k <- q_k^local  otherwise,

with delta_k = mean over the encoder's convolution weights of ||W_end - W_start||_2 over the
client's LAST local training (fedmpi.algorithms.byol.encoder_divergence). Then BYOL as in
FedBYOL (local target, EMA per step). Server: FedAvg of encoder, projector and predictor.
Messages d down, d up. Client state: target (d - |q|), seen (1), the local predictor (|q|),
the last divergence delta_k (1). mu = 0: always the local predictor; mu = inf: FedBYOL.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import register
from .byol import BYOLParams, encoder_divergence, predictor_size
from .fedbyol import FedBYOL
from .params import param


@register
class FedU(FedBYOL):
    name = "fedu"
    paper = "Zhuang et al. 2021, arXiv:2108.06492"

    @dataclass(frozen=True)
    class Params(BYOLParams):
        mu: float = param(0.4, ">= 0", "DAPU threshold: the global predictor is used when "
                                       "delta_k < mu (EasyFL 0.4; inf: always, i.e. FedBYOL)")

    def client_state_sizes(self, d):
        return {**super().client_state_sizes(d), "predictor": predictor_size(self.params),
                "divergence": 1}

    def start(self, x, client_state, ctx, seen):
        online, target = super().start(x, client_state, ctx, seen)
        # host sync: once per client
        if not seen or float(client_state["divergence"].item()) < self.params.mu:
            return online, target
        online = online.clone()
        online[self.target_size(len(x)):] = client_state["predictor"]
        return online, target

    def extra_state(self, task, start, client_state, ctx, seen):
        w = task.model.params
        return {"predictor": w[self.target_size(len(w)):].clone(),
                "divergence": encoder_divergence(task.model, start, w)}
