"""FedMIM: Enhance Local Consistency in Federated Learning: A Multi-Step Inertial Momentum Approach.

Liu, Sun, Ding, Shen, Liu and Tao, 2023, https://arxiv.org/abs/2302.05726

With the last J global displacements u_j = x^{t-j} - x^{t-j-1} (j = 0..J-1, zero before
the history exists), A = sum_j alpha_j < 1 and K the client's step count, each local step
(Algorithm 1) is

    x_{k+1} = x_k + sum_j alpha_j u_j / K - (1 - A) eta_l (g + wd x_k),
    g = clip_10( grad f_i(x_k + sum_j beta_j u_j / K) )

(gradient at the beta-lookahead point, taken like a SAM perturbation; weight decay at
x_k). The decay is scaled by 1 - A with the gradient (``decay = "matched"``): the
inertia re-applies last round's decay, and at the fixed point the effective decay is wd,
FedAvg's, as FedCM's "matched" (``momentum``). ``decay = "code"`` decays by eta_l wd x_k
unscaled each step, as FL-Simulator's FedCM: effective wd / (1 - A). Either way
FedMIM(alpha = (a, 0, ...), beta = 0) is FedCM(alpha = 1 - a) with the same ``decay``.

Server: x^{t+1} = x^t + eta_g (1/S) sum_i Delta_i, the plain mean of the client
models at eta_g = 1. The server keeps J+1 snapshots and sends the J displacements:
(1+J)d down, d up ("honest"); the paper counts d down ("paper"). ``traffic_count``
picks the one the FL ledger (fl_bytes_down) carries; every round stores both as the
diagnostics fl_bytes_down_honest = S (1+J) d 4 and fl_bytes_down_paper = S d 4 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UsageError
from ..flat import WIRE_BYTES
from . import local_sgd, momentum, schedule, server_opt
from .base import Algorithm, Upload, register
from .params import Params, param, param_error


def _float_tuple(name: str, value) -> tuple[float, ...]:
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise param_error(name, f"must be numbers, got {list(value)}")
    values = tuple(float(v) for v in value)  # host sync: none, config time (numbers)
    if not all(math.isfinite(v) for v in values):
        raise param_error(name, f"must be finite numbers, got {list(value)}")
    return values


@register
class FedMIM(Algorithm):
    name = "fedmim"
    paper = "Liu et al. 2023, arXiv:2302.05726"
    local_sgd_only = "its local step is its own inertial SGD step (local_sgd.sgd_step)"
    # the round's download under both counts (bytes, as fl_bytes_down), whatever
    # traffic_count sends to the ledger
    diagnostic_fields = ("fedmim_local_consistency", "fl_bytes_down_honest", "fl_bytes_down_paper")

    @dataclass(frozen=True)
    class Params(Params):
        J: int = param(2, ">= 1", "J, number of past global displacements used")
        alpha: tuple = param((0.6, 0.3), doc="alpha_1..alpha_J inertia weights, newest first; "
                                             "sum < 1 (paper best (0.6, 0.3))")
        beta: tuple = param((0.9, 0.1), doc="beta_1..beta_J weights of the gradient's lookahead "
                                            "point, newest first (paper best (0.9, 0.1))")
        decay: str = param("matched", momentum.DECAY_PLACEMENTS,
                           "where train.weight_decay acts: 'matched', scaled by 1 - A with the "
                           "gradient, effective decay = weight_decay (FedAvg's); 'code', unscaled "
                           "each step, effective weight_decay / (1 - A)")
        traffic_count: str = param("honest", ("honest", "paper"),
                                   "'honest': (1+J)d down (the J displacements travel); "
                                   "'paper': d down, as the paper counts")

        def __post_init__(self):
            super().__post_init__()
            for name in ("alpha", "beta"):
                values = _float_tuple(name, getattr(self, name))
                if len(values) != self.J:
                    raise param_error(name, f"needs J = {self.J} values, got {len(values)}")
                object.__setattr__(self, name, values)
            if sum(self.alpha) >= 1:
                raise param_error("alpha", f"sum must be < 1, got {sum(self.alpha)}")

    def traffic(self, d, phase):
        return self.downloads(d)[self.params.traffic_count], d

    def downloads(self, d) -> dict[str, int]:
        """Values one client downloads per round: "honest" (1+J)d, x and the J
        displacements it needs if it missed the last J rounds; "paper" d, as counted there."""
        return {"honest": (1 + self.params.J) * d, "paper": d}

    def gather_sizes(self, d, phase=None):
        return {"delta_sq": 1}

    def init_server_state(self, x):
        # history[j] = x^{t-1-j}; all x^0 at the start, so the missing displacements are 0.
        return {"x": x.clone(), "history": x.clone().repeat(self.params.J, 1)}

    def payload(self, state, ctx):
        snapshots = torch.cat([state["x"][None], state["history"]])
        return {"x": state["x"], "displacements": (snapshots[:-1] - snapshots[1:]).reshape(-1)}

    def server_update(self, state, sums, gathered, ctx):
        state["history"] = torch.cat([state["x"][None], state["history"][:-1]])
        super().server_update(state, sums, gathered, ctx)   # the plain mean: weights 1

    def diagnostics(self, state, sums, gathered, ctx):
        """(1/S) sum_i ||x_i - xbar||^2 = mean_i ||Delta_i||^2 - ||Dbar||^2 (same start x^t)."""
        s = len(gathered["client"])
        mean = sums["delta"].double() / s
        down = {f"fl_bytes_down_{count}": float(s * n * WIRE_BYTES)  # host sync: none, ints
                for count, n in self.downloads(state["x"].numel()).items()}
        # host sync: server diagnostics, once per round
        return {"fedmim_local_consistency": float(np.mean(gathered["delta_sq"]) - mean.square().sum()),
                **down}

    def effective_weight_decay(self, weight_decay):
        return momentum.effective_decay(weight_decay, 1.0 - sum(self.params.alpha), self.params.decay)

    def check_training(self, train):
        schedule.require_constant_local(train, "fedmim", "the inertia's per-step share of u")
        if train.momentum:
            raise UsageError(f"config field train.momentum: must be 0 with fedmim (its inertial "
                             f"step is its momentum), got {train.momentum}")

    def local_update(self, task, payload, client_state, ctx):
        x = payload["x"]
        u = payload["displacements"].view(self.params.J, -1)
        steps = max(task.data.num_steps(ctx.local_epochs, ctx.batch_size), 1)
        inertia = _weighted(self.params.alpha, u) / steps
        lookahead = _weighted(self.params.beta, u) / steps
        task.model.load(x)
        scale = 1.0 - sum(self.params.alpha)
        # sgd_step's decay is lr * wd with lr = scale eta_l: "code" undoes the scale
        wd = ctx.weight_decay if self.params.decay == "matched" else ctx.weight_decay / scale
        loss, k = inertial_train(task, ctx, inertia, lookahead, scale, wd)
        delta = task.model.params - x
        return Upload(delta=delta, num_samples=task.data.num_samples, loss=loss, steps=k)

    def contribution(self, upload):
        return server_opt.count_once(upload)   # the plain mean over S_t

    def gather(self, upload):
        return {"delta_sq": upload.delta.double().square().sum().reshape(1)}


def _weighted(weights, vectors: torch.Tensor) -> torch.Tensor:
    w = torch.tensor(weights, dtype=vectors.dtype, device=vectors.device)
    return w @ vectors


def inertial_train(task, ctx, inertia: torch.Tensor, lookahead: torch.Tensor,
                   scale: float, weight_decay: float) -> tuple[float, int]:
    """E epochs of x <- x + inertia - scale eta_l (clip(grad f(x + lookahead)) + wd x).

    The gradient is taken with the parameters moved to the lookahead point and restored
    from a copy (not by subtracting, which would not give x_k back bit for bit).
    """
    flat, module = task.model, task.model.module
    n = flat.num_params
    params, inertia, lookahead = flat.params[:n], inertia[:n], lookahead[:n]
    moved = bool(lookahead.any())  # host sync: once per client, before the loop
    anchor = torch.empty_like(params)
    loss_fn = task.loss_fn or local_sgd.cross_entropy
    module.train()
    total, steps = torch.zeros((), device=params.device), 0
    for x, y in task.data.batches(ctx.local_epochs, ctx.batch_size):
        flat.zero_grad()
        if moved:
            anchor.copy_(params)
            params.add_(lookahead)
        loss = loss_fn(module, x, y)
        loss.backward()
        if moved:
            params.copy_(anchor)
        local_sgd.sgd_step(params, flat.grads, scale * ctx.lr, weight_decay, ctx.grad_clip)
        params.add_(inertia)
        total += loss.detach()
        steps += 1
    return float(total) / max(steps, 1), steps  # host sync: once per client, its loss
