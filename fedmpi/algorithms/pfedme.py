"""pFedMe: Personalized Federated Learning with Moreau Envelopes.

T. Dinh, Tran, Nguyen, NeurIPS 2020, https://arxiv.org/abs/2006.08848

Each client keeps a personalised model theta_i (client state; x^t at its first
participation, then where its last round left it, as the authors' code keeps it). At
every local step, on the step's batch, it first moves theta ``inner_steps`` = K times
towards the Moreau envelope's minimiser,

    theta <- theta - personal_lr (grad f(theta) + lambda (theta - w)),

then moves the local model w by the envelope's gradient, w <- w - lr lambda (w - theta)
(with ``train.weight_decay`` and ``grad_clip`` as any local step). The upload is Delta_i
= w_{i,K} - x^t and the server is FedAvg's: x <- x + eta_g mean(Delta), where the paper's
beta is ``train.global_lr`` (beta = 1: the mean of the local models). Per-client
evaluation scores theta_i. Messages d down, d up; theta_i never travels. K gradients a
step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import group_sgd, local_sgd
from .base import register
from .fedavg import FedAvg
from .params import Params, param


@register
class PFedMe(FedAvg):
    name = "pfedme"
    paper = "T. Dinh et al. 2020, arXiv:2006.08848"
    personalised = True

    @dataclass(frozen=True)
    class Params(Params):
        lam: float = param(15.0, "> 0", "lambda, the pull between theta and w (paper: 15)")
        personal_lr: float = param(0.01, "> 0", "the inner steps' learning rate (paper: "
                                                "0.01-0.09)")
        inner_steps: int = param(5, ">= 1", "K, inner steps on theta a local step (paper: 5)")

    def client_state_sizes(self, d):
        return {"theta": d, "started": 1}

    def local_update(self, task, payload, client_state, ctx):
        x = payload["x"]
        started = bool(client_state["started"][0])   # host sync: once a client, not a step
        theta = (client_state["theta"] if started else x).clone()
        flat, n, p = task.model, task.model.num_params, self.params
        w_now = torch.empty_like(x)

        def gradient(task, xb, yb, loss_fn):
            """K steps of theta on the batch, then the envelope's gradient at w."""
            w_now.copy_(flat.params)
            flat.params.copy_(theta)
            for _ in range(p.inner_steps):
                loss = local_sgd.loss_gradient(task, xb, yb, loss_fn)
                flat.grads.add_(flat.params[:n] - w_now[:n], alpha=p.lam)
                flat.params[:n].sub_(flat.grads, alpha=p.personal_lr)
            theta.copy_(flat.params)
            flat.params.copy_(w_now)
            torch.sub(w_now[:n], theta[:n], out=flat.grads).mul_(p.lam)
            return loss

        upload = local_sgd.local_update(task, x, ctx, gradient_fn=gradient)
        upload.state = {"theta": theta, "started": torch.ones(1, device=x.device)}
        return upload

    def local_update_group(self, tasks, payload, client_states, ctx):
        """The group form: at every step each row's theta takes its K inner steps on the
        row's batch (a ``group_sgd.train`` gradient hook), then the rows' w step by the
        envelope's gradient; w restored by copy in between."""
        x = payload["x"]
        theta = torch.stack([s["theta"] if bool(s["started"][0]) else x   # host sync: once a client
                             for s in client_states])
        p = self.params

        def gradient(model, a, xb, yb, weights, autocast):
            n = model.flat.num_params
            params, rows_theta = model.rows[:a, :n], theta[:a, :n]
            w_now = params.clone()
            params.copy_(rows_theta)
            for _ in range(p.inner_steps):
                losses, grads = model.gradient(a, xb, yb, weights, autocast)
                grads.add_(params - w_now, alpha=p.lam)
                params.sub_(grads, alpha=p.personal_lr)
            rows_theta.copy_(params)
            params.copy_(w_now)
            grads = model.grad_rows[:a]
            torch.sub(w_now, rows_theta, out=grads).mul_(p.lam)
            return losses, grads

        uploads = group_sgd.local_update(tasks, x, ctx, gradient=gradient)
        for i, upload in enumerate(uploads):
            upload.state = {"theta": theta[i].clone(), "started": torch.ones(1, device=x.device)}
        return uploads

    def personal_params(self, client_state, x):
        started = bool(client_state["started"][0])   # host sync: once a client, at evaluation
        return client_state["theta"] if started else x
