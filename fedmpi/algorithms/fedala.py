"""FedALA: Adaptive Local Aggregation for Personalized Federated Learning.

Zhang, Hua, Wang, Song, Xue, Ma, Guan, AAAI 2023, https://arxiv.org/abs/2212.01197

Each client keeps its last local model theta_i (client state) and, instead of
overwriting it with the global model x^t, starts its local training from

    lower layers: x^t,    top ``layers`` parameter tensors: theta_i + (x^t - theta_i) * W_i,

with element-wise weights W_i in [0, 1] (client state, ones at the start) learned on a
``sample`` fraction of its local data: on each batch, W_i <- clip(W_i - ``eta`` grad
L(theta_hat) * (x^t - theta_i), 0, 1), theta_hat's top layers rebuilt from W_i after
each step. At the client's second participation the weights train over that fraction
until the standard deviation of the last ``window`` losses drops below ``threshold``
(at most ``max_passes`` passes: the authors' loop has no cap); after that, one pass a
round. Then FedAvg's local training from theta_hat; the upload is theta_{i,K} - x^t, so
the server's mean is the mean of the local models, as FedAvg's. A client's first
participation has no local model yet: it starts from x^t (the authors' clients start
from a copy of the initial model; here no such copy is kept). Per-client evaluation
scores theta_i. Messages d down, d up; theta_i and W_i never travel. In a client
group each client's W trains on its own, then the rows train in lock-step from their
theta_hat (``local_update_group``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import group_sgd, local_sgd
from .base import Upload, register
from .fedavg import FedAvg
from .params import Params, param


@register
class FedALA(FedAvg):
    name = "fedala"
    paper = "Zhang et al. 2023, arXiv:2212.01197"
    personalised = True

    @dataclass(frozen=True)
    class Params(Params):
        eta: float = param(1.0, "> 0", "the weights' learning rate (paper: 1.0)")
        sample: float = param(0.8, "(0, 1]", "the fraction of a client's batches W learns on "
                                             "(the authors' rand_percent 80)")
        layers: int = param(2, ">= 1", "top parameter tensors aggregated adaptively (the "
                                       "authors' layer_idx; 2: the classifier's weight, bias)")
        threshold: float = param(0.1, "> 0", "the loss std that ends the first training of W")
        window: int = param(10, ">= 2", "losses the std is taken over (num_pre_loss)")
        max_passes: int = param(100, ">= 1", "passes over the fraction at most, the first time")

    def client_state_sizes(self, d):
        # W is used on the top layers only; the store's sizes are fixed before the model
        # is known to the method, so it is kept at d (2d a client in all)
        return {"theta": d, "weights": d, "started": 1}

    def local_update(self, task, payload, client_state, ctx):
        x = payload["x"]
        start, weights, started = self.local_start(task, ctx, x, client_state)
        task.model.load(start)
        loss, steps = local_sgd.train(task, ctx)
        return self.upload(task, x, task.model.params, weights, started, loss, steps)

    def local_update_group(self, tasks, payload, client_states, ctx):
        """The group form: each client's adaptive aggregation on its own (it reads the
        client's batches through the worker's model, one client after another), then
        FedAvg's local training of every row from its client's theta_hat in lock-step."""
        x = payload["x"]
        starts = [self.local_start(t, ctx, x, s) for t, s in zip(tasks, client_states)]
        rows, losses, steps = group_sgd.train(tasks, torch.stack([s[0] for s in starts]), ctx)
        return [self.upload(t, x, rows[i], w, on, losses[i], steps[i])
                for i, (t, (_, w, on)) in enumerate(zip(tasks, starts))]

    def local_start(self, task, ctx, x, client_state):
        """theta_hat (x where the client has no local model yet), W after this round's
        training of it, and whether the client had started."""
        started = int(client_state["started"][0])   # host sync: once a client, not a step
        lo, hi = top_run(task.model, self.params.layers)
        weights = client_state["weights"].clone() if started else torch.ones_like(x)
        start = x.clone()
        if started:
            start[lo:hi] = self.aggregate(task, ctx, x, client_state["theta"], weights, lo, hi,
                                          started == 1)
        return start, weights, started

    @staticmethod
    def upload(task, x, params, weights, started, loss, steps) -> Upload:
        upload = Upload(delta=params - x, num_samples=task.data.num_samples, loss=loss,
                        steps=steps)
        upload.state = {"theta": params.detach().clone(), "weights": weights,
                        "started": torch.full((1,), 2.0 if started else 1.0, device=x.device)}
        return upload

    def personal_params(self, client_state, x):
        started = bool(client_state["started"][0])   # host sync: once a client, at evaluation
        return client_state["theta"] if started else x

    def aggregate(self, task, ctx, x, theta, weights, lo, hi, first: bool) -> torch.Tensor:
        """W trained on the sampled batches at theta_hat (lower layers x, top layers
        theta + (x - theta) W); returns theta_hat's top layers. ``weights`` in place."""
        p, flat = self.params, task.model
        gap = x[lo:hi] - theta[lo:hi]
        loss_fn = local_sgd.autocast(task.loss_fn or local_sgd.cross_entropy, task)
        hat = x.clone()
        top = hat[lo:hi]
        torch.addcmul(theta[lo:hi], gap, weights[lo:hi], out=top)
        count = max(1, math.ceil(p.sample * task.data.num_steps(1, ctx.batch_size)))
        losses: list[float] = []
        for _ in range(p.max_passes if first else 1):
            loss = None
            for k, (xb, yb) in enumerate(task.data.batches(1, ctx.batch_size)):
                if k == count:
                    break
                flat.load(hat)
                loss = local_sgd.loss_gradient(task, xb, yb, loss_fn)
                weights[lo:hi].addcmul_(flat.grads[lo:hi], gap, value=-p.eta).clamp_(0.0, 1.0)
                torch.addcmul(theta[lo:hi], gap, weights[lo:hi], out=top)
            if loss is None:
                break
            losses.append(float(loss.detach()))   # host sync: once a pass
            if len(losses) > p.window and np.std(losses[-p.window:]) < p.threshold:
                break
        return top


def top_run(flat, layers: int) -> tuple[int, int]:
    """The coordinates of the last ``layers`` parameter tensors (one run: the top)."""
    slots = flat.layout[:len(list(flat.module.parameters()))]
    top = slots[-min(layers, len(slots)):]
    return top[0].offset, top[-1].offset + top[-1].numel
