"""Ditto: Fair and Robust Federated Learning Through Personalization.

Li, Hu, Beirami, Smith, ICML 2021, https://arxiv.org/abs/2012.04221

The global model is FedAvg's: a sampled client trains x^t for E local epochs and uploads
Delta_i = x_{i,K} - x^t; the server takes the sample-weighted mean (messages d down, d
up). Each client also keeps a personal model v_i (client state, d values; x^t at its
first participation) and, in every round it is sampled, takes the same number of local
steps on

    f_i(v) + (lambda/2) ||v - x^t||^2,

i.e. the gradient gains lambda (v - x^t) (the paper's Algorithm 1, with the personal
steps over the same batches as the global ones). v_i never travels; per-client
evaluation (eval.clients) scores it as personal_*. lambda = 0 makes v_i a purely local
model; the global model does not depend on lambda at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import group_sgd, local_sgd
from .base import register
from .fedavg import FedAvg
from .fedprox import proximal
from .params import Params, param


@register
class Ditto(FedAvg):
    name = "ditto"
    paper = "Li et al. 2021, arXiv:2012.04221"
    personalised = True

    @dataclass(frozen=True)
    class Params(Params):
        lam: float = param(0.1, ">= 0", "the personal model's pull toward the global one, "
                                        "lambda (paper grid 0.01-2)")

    def client_state_sizes(self, d):
        return {"v": d, "started": 1}

    def local_update(self, task, payload, client_state, ctx):
        x = payload["x"]
        upload = local_sgd.local_update(task, x, ctx)          # the global model: FedAvg's
        started = bool(client_state["started"][0])   # host sync: once a client, not a step
        task.model.load(client_state["v"] if started else x)
        lam = self.params.lam
        local_sgd.train(task, ctx, proximal(lam, x) if lam else None)
        upload.state = {"v": task.model.params.detach().clone(),
                        "started": torch.ones(1, device=x.device)}
        return upload

    def local_update_group(self, tasks, payload, client_states, ctx):
        """The group form: FedAvg's group from x, then every row's personal model from its
        v_i (x where not started) over the same batches with the same pull."""
        x = payload["x"]
        uploads = group_sgd.local_update(tasks, x, ctx)   # deltas: new tensors, kept
        starts = torch.stack([s["v"] if bool(s["started"][0]) else x   # host sync: once a client
                              for s in client_states])
        lam = self.params.lam
        rows, _, _ = group_sgd.train(tasks, starts, ctx, proximal(lam, x) if lam else None)
        for upload, row in zip(uploads, rows):
            upload.state = {"v": row.clone(), "started": torch.ones(1, device=x.device)}
        return uploads

    def personal_params(self, client_state, x):
        started = bool(client_state["started"][0])   # host sync: once a client, at evaluation
        return client_state["v"] if started else x
