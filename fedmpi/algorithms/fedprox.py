"""FedProx: Federated Optimization in Heterogeneous Networks.

Li et al., MLSys 2020, https://arxiv.org/abs/1812.06127

FedAvg whose local loss adds (mu/2) ||w - x^t||^2, i.e. the gradient gains mu (w - x^t)
before clipping. Server and messages as FedAvg (d down, d up).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import group_sgd, local_sgd
from .base import register
from .fedavg import FedAvg
from .local_sgd import rows_of
from .params import Params, param


def proximal(mu: float, anchor):
    """Gradient correction of (mu/2)||w - anchor||^2: g += mu (w - anchor).

    ``params`` are the model's trainable parameters (the first num_params values of the
    flat state, fedmpi.flat.FlatModel); ``anchor`` may be the whole flat state, whose
    float buffers (BatchNorm statistics) follow the parameters: only its first
    len(params) values are used."""
    def correct(grads, params):
        grads.add_(params, alpha=mu).sub_(rows_of(anchor, grads), alpha=mu)
    return correct


@register
class FedProx(FedAvg):
    name = "fedprox"
    paper = "Li et al. 2020, arXiv:1812.06127"

    @dataclass(frozen=True)
    class Params(Params):
        mu: float = param(0.01, ">= 0", "proximal weight mu (paper grid 0.001-1)")

    def local_update(self, task, payload, client_state, ctx):
        x = payload["x"]   # parameters, then float buffers: the anchor is the first part
        return local_sgd.local_update(task, x, ctx,
                                      proximal(self.params.mu, x[:task.model.num_params]))

    def local_update_group(self, tasks, payload, client_states, ctx):
        x = payload["x"]
        return group_sgd.local_update(tasks, x, ctx, proximal(self.params.mu, x))
