"""APFL: Adaptive Personalized Federated Learning.

Deng, Kamani, Mahdavi 2020, https://arxiv.org/abs/2003.13461

The global model is FedAvg's: a sampled client trains x^t for E local epochs (FedAvg's
local update, the same batches, bit for bit) and uploads Delta_i = w_{i,K} - x^t. Each
client also keeps a local model v_i and a mixing weight alpha_i (client state; x^t and
``alpha`` at its first participation); its personalised model is the mixture

    vbar_i = alpha_i v_i + (1 - alpha_i) w.

At every local step, on the step's batch and at the step's w (before it moves), the
client also takes (the paper's Algorithm 1)

    v <- v - lr alpha grad f(vbar),    alpha <- clip(alpha - lr <v - w, grad f(vbar)>, 0, 1)

(the second with ``adaptive``). Per-client evaluation scores alpha_i v_i + (1 - alpha_i)
x, the mixture with the current global model (a client never trained: x). alpha = 0
without ``adaptive``: the personal model is the global one. Messages d down, d up;
v_i never travels. Twice FedAvg's gradients a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import group_sgd, local_sgd, schedule
from .base import register
from .fedavg import FedAvg
from .params import Params, param


@register
class APFL(FedAvg):
    name = "apfl"
    paper = "Deng et al. 2020, arXiv:2003.13461"
    personalised = True

    @dataclass(frozen=True)
    class Params(Params):
        alpha: float = param(0.5, "[0, 1]", "the mixing weight alpha at a client's first "
                                            "participation")
        adaptive: bool = param(True, (True, False), "update alpha by its gradient each step "
                                                    "(the paper's adaptive APFL)")

    def client_state_sizes(self, d):
        return {"v": d, "alpha": 1, "started": 1}

    def check_training(self, train):
        schedule.require_constant_local(train, "apfl", "the local model's step")

    def local_update(self, task, payload, client_state, ctx):
        x = payload["x"]
        started = bool(client_state["started"][0])   # host sync: once a client, not a step
        v = (client_state["v"] if started else x).clone()
        alpha = (client_state["alpha"].clone() if started else
                 torch.full((1,), self.params.alpha, device=x.device))
        flat, n = task.model, task.model.num_params
        w_now = torch.empty_like(x)

        def gradient(task, xb, yb, loss_fn):
            """v's and alpha's step at the current w, then the loss's gradient at w."""
            w_now.copy_(flat.params)
            flat.params.copy_(v).mul_(alpha).add_(w_now * (1 - alpha))   # vbar
            local_sgd.loss_gradient(task, xb, yb, loss_fn)
            if self.params.adaptive:
                step = torch.dot(v[:n] - w_now[:n], flat.grads)
            local_sgd.sgd_step(v[:n], flat.grads.mul_(alpha), ctx.lr, ctx.weight_decay,
                               ctx.grad_clip)
            if self.params.adaptive:
                alpha.sub_(step * ctx.lr).clamp_(0.0, 1.0)
            flat.params.copy_(w_now)
            return local_sgd.loss_gradient(task, xb, yb, loss_fn)

        upload = local_sgd.local_update(task, x, ctx, gradient_fn=gradient)
        upload.state = {"v": v, "alpha": alpha, "started": torch.ones(1, device=x.device)}
        return upload

    def local_update_group(self, tasks, payload, client_states, ctx):
        """The group form: every row's v and alpha take the same steps at the rows'
        current w (a ``group_sgd.train`` gradient hook; w restored by copy), then the
        loss's gradient at w steps the global rows, as FedAvg's group."""
        x = payload["x"]
        started = [bool(s["started"][0]) for s in client_states]   # host sync: once a client
        v = torch.stack([s["v"] if on else x for s, on in zip(client_states, started)])
        alpha = torch.stack([s["alpha"].clone() if on else
                             torch.full((1,), self.params.alpha, device=x.device)
                             for s, on in zip(client_states, started)])
        adaptive = self.params.adaptive

        def gradient(model, a, xb, yb, weights, autocast):
            n = model.flat.num_params
            params, rows_v, rows_alpha = model.rows[:a, :n], v[:a, :n], alpha[:a]
            w_now = params.clone()
            params.copy_(rows_v).mul_(rows_alpha).add_(w_now * (1 - rows_alpha))   # vbar
            _, grads = model.gradient(a, xb, yb, weights, autocast)
            if adaptive:
                step = ((rows_v - w_now) * grads).sum(dim=1, keepdim=True)
            group_sgd.group_step(rows_v, grads.mul_(rows_alpha), ctx.lr, ctx.weight_decay,
                                 ctx.grad_clip, None, 0.0, False)
            if adaptive:
                rows_alpha.sub_(step * ctx.lr).clamp_(0.0, 1.0)
            params.copy_(w_now)
            return model.gradient(a, xb, yb, weights, autocast)

        uploads = group_sgd.local_update(tasks, x, ctx, gradient=gradient)
        for i, upload in enumerate(uploads):
            upload.state = {"v": v[i].clone(), "alpha": alpha[i].clone(),
                            "started": torch.ones(1, device=x.device)}
        return uploads

    def personal_params(self, client_state, x):
        started = bool(client_state["started"][0])   # host sync: once a client, at evaluation
        if not started:
            return x
        alpha = client_state["alpha"]
        return client_state["v"] * alpha + x * (1 - alpha)
