"""FedDyn: Federated Learning Based on Dynamic Regularization.

Acar et al., ICLR 2021, https://arxiv.org/abs/2111.04263

Client i (state grad L_i, zero at first) takes K local steps from x^t on

    L_i(w) - <grad L_i, w> + (alpha/2) ||w - x^t||^2,

i.e. the loss gradient gains alpha (w - x^t) - grad L_i before clipping, then sets
grad L_i <- grad L_i - alpha (w_K - x^t) and uploads Delta_i = w_K - x^t. Server (state h,
zero at first):

    h <- h - (alpha/N) sum_{i in S} (w_i - x^t),    x^{t+1} = (1/S) sum_{i in S} w_i - h / alpha.

Messages d down, d up; client state grad L_i (d), server state h (d). This is the
canonical server-h form [code: geehokim/FedACG servers/base.py ServerDyn]; FL-Simulator's
running sums are equivalent. The server step is the paper's
own, so ``train.global_lr`` is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import group_sgd, local_sgd
from .base import Algorithm, register
from .local_sgd import rows_of
from .params import Params, param


def dynamic_regulariser(alpha: float, grad_l: torch.Tensor, anchor: torch.Tensor):
    """Gradient of -<grad L_i, w> + (alpha/2)||w - x^t||^2: g += alpha (w - x^t) - grad L_i."""
    def correct(grads, params):
        grads.add_(params, alpha=alpha).sub_(rows_of(anchor, grads), alpha=alpha) \
            .sub_(rows_of(grad_l, grads))
    return correct


@register
class FedDyn(Algorithm):
    name = "feddyn"
    paper = "Acar et al. 2021, arXiv:2111.04263"

    @dataclass(frozen=True)
    class Params(Params):
        alpha: float = param(0.1, "> 0", "dynamic regularisation weight alpha (FL-Simulator, FedACG: 0.1)")

    def client_state_sizes(self, d):
        return {"grad_l": d}

    def contribution_sizes(self, d, phase=None):
        return {"delta": d}

    def init_server_state(self, x):
        return {"x": x.clone(), "h": torch.zeros_like(x)}

    def server_update(self, state, sums, gathered, ctx):
        alpha = self.params.alpha
        state["h"].sub_(sums["delta"], alpha=alpha / ctx.num_clients)
        # mean_S w_i = x^t + mean_S Delta_i
        state["x"].add_(sums["delta"], alpha=1.0 / len(ctx.participants))
        state["x"].sub_(state["h"], alpha=1.0 / alpha)

    def local_update(self, task, payload, client_state, ctx):
        x, grad_l = payload["x"], client_state["grad_l"]
        alpha = self.params.alpha
        upload = local_sgd.local_update(task, x, ctx, dynamic_regulariser(alpha, grad_l, x))
        upload.state = {"grad_l": grad_l - alpha * upload.delta}
        return upload

    def local_update_group(self, tasks, payload, client_states, ctx):
        x, alpha = payload["x"], self.params.alpha
        grad_l = torch.stack([s["grad_l"] for s in client_states])
        uploads = group_sgd.local_update(tasks, x, ctx, dynamic_regulariser(alpha, grad_l, x))
        for i, upload in enumerate(uploads):
            upload.state = {"grad_l": grad_l[i] - alpha * upload.delta}
        return uploads

    def contribution(self, upload):
        return {"delta": upload.delta}

    def refined_upload(self, upload, x, w, w_new, steps, ctx):
        """FNR-FL: "delta" as by default, and grad L_i <- grad L_i - alpha (w_new - w), what
        the client rule gives with w_new (so h stays the mean of the clients' grad L_i)."""
        new, change = super().refined_upload(upload, x, w, w_new, steps, ctx)
        new.state = {"grad_l": upload.state["grad_l"] - self.params.alpha * (w_new - w)}
        return new, change
