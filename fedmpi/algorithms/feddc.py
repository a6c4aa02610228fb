"""FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling and Correction.

Gao, Fu, Li, Chen, Xu and Xu, CVPR 2022, https://arxiv.org/abs/2203.11751
[code: gaoliang13/FedDC, utils_methods_FedDC.py train_FedDC and utils_general.py
train_model_FedDC]

Client i keeps a local drift h_i and a control variate c_i (the code's
``parameter_drifts[i]`` and ``state_gadient_diffs[i]``), both zero at first. It receives
the global model w = x^t and the global variate c, starts at theta = w and takes K local
steps on

    L_i(theta) + (alpha/2) ||theta + h_i - w||^2 + <theta, c - c_i>,

i.e. the loss gradient gains alpha (theta + h_i - w) + c - c_i before clipping. After
training, with Delta_i = theta_K - w:

    h_i <- h_i + Delta_i,    c_i+ = c_i - c - Delta_i / (K eta_l),

and it uploads Delta_i and Delta c_i = c_i+ - c_i, keeping c_i <- c_i+. The correction
term <theta, c - c_i> is the paper's (1/(eta K)) <theta, g_i - g> with the update
differences g_i, g kept, as the code keeps them, in gradient units: c_i, c are
SCAFFOLD's option-II control variates (fedmpi.algorithms.scaffold), c_i+ the same
recursion. Server (state c and H = (1/N) sum_{all i} h_i, both zero at first):

    H <- H + (1/N) sum_{i in S} Delta_i            (only the participants' h_i moved)
    x^{t+1} = (1/S) sum_{i in S} theta_i + H       (= x^t + mean_S Delta_i + H)
    c <- c + (1/N) sum_{i in S} Delta c_i.

Messages 2d down (x, c) and 2d up (Delta_i, Delta c_i): FedDC's extra d each way over
FedAvg, SCAFFOLD's. Client state h_i, c_i (2d); server state c, H (2d). The server never
sees an h_i: since h_i moves by exactly Delta_i, it keeps their mean H from the deltas.

Paper-vs-code choices (the code is followed; none needs a parameter):

- Aggregation: the code sets w = mean_S theta_i + mean over all N clients of h_i (the
  non-participants' drifts as they last left them), not a mean of theta_i + h_i over the
  participants; the two agree under full participation.
- K is the number of steps the client took. The code's ``n_minibatch`` = E ceil(n/B) with
  n the mean client size, the same number on the code's balanced splits.
- eta_l in c_i+ is the round's local learning rate eta_l^t; the code divides by the
  initial rate (its ``learning_rate``, not ``learning_rate * lr_decay_per_round**t``), the
  same only with a constant rate over rounds.
- No per-client weights: the code scales alpha by 1/w_i and c by 1/w_i in the client's
  terms and Delta c_i by w_i in c's update, w_i = N n_i / sum_j n_j, which is 1 on the
  balanced splits of all its examples. Delta_i is averaged with equal weights, as the
  code's np.mean.
- The correction enters the gradient before clipping and weight decay stays the
  optimizer's (the code's clip_grad_norm_ of the whole loss, then SGD's weight_decay).
- h_i, c_i and the server rule cover the whole flat state (float buffers included), as
  FedDyn's h here; the code's models and fedmpi's classifiers have parameters only.
- A client that took no step keeps c_i (and its h_i does not move: Delta_i = 0).
- The evaluated model is x (the code's ``cur_cld_model``, which the next round starts
  from; the code also logs mean_S theta_i).
- ``train.global_lr`` has no place in the rule, so a value other than 1 is refused; so
  are a learning rate that changes within the round (``train.local_schedule``,
  ``train.local_warmup``: K eta_l) and ``train.optimizer = "adam"`` (``local_sgd_only``),
  as for SCAFFOLD. Heavy-ball momentum is allowed, as for SCAFFOLD (the code has none).

``alpha = 0.01`` is the code's CIFAR-10 and CIFAR-100 setting (MNIST 0.1, synthetic
0.005). alpha = 0 is refused: without the penalty nothing ties theta_i to w - h_i, while
the server still adds H, so the rule is no longer FedDC (nor FedAvg, nor SCAFFOLD).
FedACG (Kim et al. 2024) compares against FedDC as its strongest baseline and counts its
doubled messages; its code has no FedDC.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UsageError
from . import local_sgd, schedule, server_opt
from .base import Algorithm, register
from .local_sgd import rows_of
from .params import Params, param


def drift_correction(alpha: float, offset: torch.Tensor):
    """Gradient of (alpha/2)||theta + h_i - w||^2 + <theta, c - c_i>: g += alpha theta + offset,
    offset = alpha (h_i - w) + c - c_i (one vector, computed once per client)."""
    def correct(grads, params):
        grads.add_(params, alpha=alpha).add_(rows_of(offset, grads))
    return correct


@register
class FedDC(Algorithm):
    name = "feddc"
    paper = "Gao et al. 2022, arXiv:2203.11751"
    local_sgd_only = ("its control variate c_i+ = c_i - c - Delta_i / (K eta_l) reads Delta_i "
                      "as K SGD steps")

    @dataclass(frozen=True)
    class Params(Params):
        alpha: float = param(0.01, "> 0", "drift penalty alpha of (alpha/2)||theta + h_i - w||^2 "
                                          "(authors' code: CIFAR 0.01, MNIST 0.1)")

    def traffic(self, d, phase):
        return 2 * d, 2 * d

    def client_state_sizes(self, d):
        return {"h_i": d, "c_i": d}

    def compressible(self, d):
        return {"up": {"delta": d, "delta_c": d}, "down": {"x": d, "c": d}}

    def contribution_sizes(self, d, phase=None):
        return {**super().contribution_sizes(d, phase), "delta_c": d}

    def check_training(self, train):
        schedule.require_constant_local(train, self.name, "the control variate's K eta_l")
        if train.global_lr != 1.0:
            raise UsageError(f"config field train.global_lr: must be 1 with feddc (its server "
                             f"sets x = mean theta_i + mean h_i, no server step size), got "
                             f"{train.global_lr}")

    def init_server_state(self, x):
        return {"x": x.clone(), "c": torch.zeros_like(x), "h": torch.zeros_like(x)}

    def payload(self, state, ctx):
        return {"x": state["x"], "c": state["c"]}

    def server_update(self, state, sums, gathered, ctx):
        n = ctx.num_clients
        state["h"].add_(sums["delta"], alpha=1.0 / n)
        # host sync: server, once per round
        state["x"].add_(sums["delta"], alpha=1.0 / float(sums["weight"])).add_(state["h"])
        state["c"].add_(sums["delta_c"], alpha=1.0 / n)

    def local_update(self, task, payload, client_state, ctx):
        x, c = payload["x"], payload["c"]
        h_i, c_i = client_state["h_i"], client_state["c_i"]
        alpha = self.params.alpha
        offset = (h_i - x).mul_(alpha).add_(c).sub_(c_i)
        upload = local_sgd.local_update(task, x, ctx, drift_correction(alpha, offset))
        k = upload.steps
        # A client without a step has learnt nothing about its drift: keep c_i.
        c_new = c_i - c - upload.delta / (k * ctx.lr) if k > 0 else c_i.clone()
        upload.extras["delta_c"] = c_new - c_i
        upload.state = {"h_i": h_i + upload.delta, "c_i": c_new}
        return upload

    def contribution(self, upload):
        return {**server_opt.count_once(upload), "delta_c": upload.extras["delta_c"]}
