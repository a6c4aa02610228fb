"""FedAvg: Communication-Efficient Learning of Deep Networks from Decentralized Data.

McMahan et al., AISTATS 2017, https://arxiv.org/abs/1602.05629

Client: E epochs of local SGD from x^t, upload Delta_i = x_{i,K} - x^t.
Server: x^{t+1} = x^t + eta_g * sum_i n_i Delta_i / sum_i n_i. Messages d down, d up.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import group_sgd, local_sgd
from .base import Algorithm, Params, register


@register
class FedAvg(Algorithm):
    name = "fedavg"
    paper = "McMahan et al. 2017, arXiv:1602.05629"

    @dataclass(frozen=True)
    class Params(Params):
        pass

    def local_update(self, task, payload, client_state, ctx):
        return local_sgd.local_update(task, payload["x"], ctx)

    def local_update_group(self, tasks, payload, client_states, ctx):
        return group_sgd.local_update(tasks, payload["x"], ctx)
