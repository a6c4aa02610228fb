"""SCAFFOLD: Stochastic Controlled Averaging for Federated Learning.

Karimireddy et al., ICML 2020, https://arxiv.org/abs/1910.06378 (Algorithm 1, option II)

Client i receives x and the server control variate c, starts at y = x and takes K steps

    y <- y - eta_l (g_i(y) - c_i + c),

then c_i+ = c_i - c + (x - y) / (K eta_l), uploads Delta y = y - x and
Delta c = c_i+ - c_i, and keeps c_i <- c_i+. Server:

    x <- x + eta_g (1/S) sum_{i in S} Delta y_i,    c <- c + (1/N) sum_{i in S} Delta c_i.

Messages 2d down (x, c) and 2d up (Delta y, Delta c); client state c_i (d), server state
c (d), both zero at the start. The correction enters the gradient before clipping and K is
the number of steps actually taken (the paper's definition); FL-Simulator's
K = E n_i / B is ``algorithm.steps = "nominal"``. Delta y is averaged with equal weights
over the S participants as in the paper (fedmpi's FedAvg weights by n_i; the two agree
when clients have equal sizes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import group_sgd, local_sgd, schedule, server_opt
from .base import Algorithm, register
from .local_sgd import rows_of
from .params import Params, param

STEP_COUNTS = ("actual", "nominal")


def control_variate(correction: torch.Tensor):
    """Gradient correction g += c - c_i (one vector, computed once per client)."""
    def correct(grads, params):
        grads.add_(rows_of(correction, grads))
    return correct


@register
class Scaffold(Algorithm):
    name = "scaffold"
    paper = "Karimireddy et al. 2020, arXiv:1910.06378"
    local_sgd_only = "c_i+ = c_i - c + (x - y) / (K eta_l) reads the update as K SGD steps"

    @dataclass(frozen=True)
    class Params(Params):
        steps: str = param("actual", STEP_COUNTS,
                           "K in c_i+: 'actual' steps taken (paper) or 'nominal' E*n_i/B (FL-Simulator)")

    def traffic(self, d, phase):
        return 2 * d, 2 * d

    def client_state_sizes(self, d):
        return {"c_i": d}

    def compressible(self, d):
        return {"up": {"delta": d, "delta_c": d}, "down": {"x": d, "c": d}}

    def contribution_sizes(self, d, phase=None):
        return {**super().contribution_sizes(d, phase), "delta_c": d}

    def init_server_state(self, x):
        return {"x": x.clone(), "c": torch.zeros_like(x)}

    def payload(self, state, ctx):
        return {"x": state["x"], "c": state["c"]}

    def server_update(self, state, sums, gathered, ctx):
        super().server_update(state, sums, gathered, ctx)   # the plain mean: weights 1
        state["c"].add_(sums["delta_c"], alpha=1.0 / ctx.num_clients)

    def check_training(self, train):
        schedule.require_constant_local(train, "scaffold", "the control variate's K eta_l")

    def local_update(self, task, payload, client_state, ctx):
        x, c, c_i = payload["x"], payload["c"], client_state["c_i"]
        upload = local_sgd.local_update(task, x, ctx, control_variate(c - c_i))
        return self._control_update(task, upload, c, c_i, ctx)

    def local_update_group(self, tasks, payload, client_states, ctx):
        x, c = payload["x"], payload["c"]
        c_i = torch.stack([s["c_i"] for s in client_states])
        uploads = group_sgd.local_update(tasks, x, ctx, control_variate(c - c_i))
        return [self._control_update(t, u, c, c_i[i], ctx) for i, (t, u) in enumerate(zip(tasks, uploads))]

    def _control_update(self, task, upload, c, c_i, ctx):
        k = self._num_steps(task, upload, ctx)
        # A client without a step has learnt nothing about its drift: keep c_i.
        c_new = c_i - c - upload.delta / (k * ctx.lr) if k > 0 else c_i.clone()
        upload.extras["delta_c"] = c_new - c_i
        upload.state = {"c_i": c_new}
        return upload

    def _num_steps(self, task, upload, ctx) -> float:
        if self.params.steps == "actual":
            return upload.steps
        return ctx.local_epochs * task.data.num_samples / ctx.batch_size

    def contribution(self, upload):
        return {**server_opt.count_once(upload), "delta_c": upload.extras["delta_c"]}
