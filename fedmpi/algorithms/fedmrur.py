"""FedMRUR: Federated Learning with Manifold Regularization and Normalized Update Reaggregation.

An, Shen, Hu, Luo, NeurIPS 2023, https://arxiv.org/abs/2311.05924 (Algorithm 1).
MoFedSAM's client on a regularised loss, a normalized server step:

    client p: m = -D^t / (K eta_l^{t-1});  G = frozen copy of the received x^t
      F_p(w) = CE(w; X, y) + gamma R(w),
      R(w) = mean_b exp(dL2(Lift(z_b(w)), Lift(z_G,b)) / sigma)   (``hyperbolic``)
      each step: w~ = w + rho grad F_p(w) / ||grad F_p(w)||  (same batch, same z_G),
                 v = alpha grad F_p(w~) + (1 - alpha) m,  w <- w - eta_l (clip(v) + c wd w)
                 (c as FedCM's ``decay``: alpha by default, 1 as FL-Simulator)
      upload Delta_p = w_K - x^t
    server: D^{t+1} = (1/|S| sum_p ||Delta_p||) * sum_p Delta_p / ||sum_p Delta_p||,
            x^{t+1} = x^t + eta_g D^{t+1}

Resolved ambiguities: "+" in the global step (Alg. 1 line 16 has "-"
while Delta_p = w_K - w_0); the momentum is the normalized D^t in gradient units; z = the
penultimate features (``representation``), z_G computed once per batch without grad and
shared by both SAM passes; per-sample exp, then the batch mean.

Messages: 2d down (x, m), d up. The server keeps D and K (the participants' mean step
count, see ``momentum``). Ablations: ``aggregation = "mean"`` (H-only: MoFedSAM's
n_i-weighted mean), ``regularizer = false`` (N-only). The mean dL2 over each client's
batches is gathered; its mean over clients is the round's ``fedmrur_lorentz_dist2``, to
show the regulariser is active (NaN with the regulariser off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..flat import FlatModel
from . import hyperbolic, local_sgd, momentum, server_opt
from .base import register
from .mofedsam import MoFedSAM
from .normalized import normalized_update
from .params import param
from .sam import sam_gradient


@register
class FedMRUR(MoFedSAM):
    name = "fedmrur"
    paper = "An et al. 2023, arXiv:2311.05924"
    diagnostic_fields = ("fedmrur_lorentz_dist2",)

    @dataclass(frozen=True)
    class Params(MoFedSAM.Params):
        rho: float = param(0.5, ">= 0", "SAM perturbation radius rho (paper 0.5)")
        gamma: float = param(0.005, ">= 0", "weight gamma of the hyperbolic regulariser R")
        sigma: float = param(1e4, "> 0", "temperature sigma in exp(dL2 / sigma)")
        beta: float = param(1.0, "> 0", "Lorentz model parameter beta (<a, a>_L = -beta)")
        aggregation: str = param("normalized", ("normalized", "mean"), "'normalized' (paper) or "
                                 "'mean' (MoFedSAM's n_i-weighted mean: H-only ablation)")
        regularizer: bool = param(True, doc="add gamma R to the local loss (false: N-only ablation)")
        representation: str = param("features", ("features", "logits"),
                                    "z: 'features' (penultimate, module.features) or 'logits'")

    def __init__(self, params=None):
        super().__init__(params)
        self._frozen: dict[str, FlatModel] = {}   # device -> the frozen global model G

    def gather_sizes(self, d, phase=None):
        return {"lorentz_dist2": 1}

    # ---- server ----
    def contribution(self, upload):
        if self.params.aggregation == "mean":
            return super().contribution(upload)
        return server_opt.count_once(upload)   # the weight is unused: the sum is normalised

    def server_update(self, state, sums, gathered, ctx):
        if self.params.aggregation == "mean":
            return super().server_update(state, sums, gathered, ctx)
        state["D"] = normalized_update(sums["delta"], gathered["update_norm"])
        state["x"].add_(state["D"], alpha=ctx.global_lr)
        state["K"][0] = momentum.mean_steps(gathered, weighted=False)

    def diagnostics(self, state, sums, gathered, ctx):
        return {"fedmrur_lorentz_dist2": float(np.mean(gathered["lorentz_dist2"]))}

    # ---- client ----
    def local_update(self, task, payload, client_state, ctx):
        x = payload["x"]
        if not self.params.regularizer:
            gradient, dist_sum = sam_gradient(self.params.rho), None
        else:
            gradient, dist_sum = self.regularized_sam(task, self.global_model(task, x))
        upload = local_sgd.local_update(task, x, self.decayed(ctx), self.correction(payload),
                                        gradient_fn=gradient)
        # host sync: once per client, after training
        mean = math.nan if dist_sum is None else float(dist_sum) / max(upload.steps, 1)
        upload.extras["lorentz_dist2"] = torch.tensor([mean], dtype=torch.float64)
        return upload

    def gather(self, upload):
        return {"lorentz_dist2": upload.extras["lorentz_dist2"]}

    def global_model(self, task, x) -> FlatModel:
        """G: a second FlatModel of the task's architecture, built once per device."""
        key = str(task.device)
        frozen = self._frozen.get(key)
        if frozen is None or frozen.layout != task.model.layout:
            frozen = local_sgd.frozen_copy(task.model)   # eval: no dropout noise in z_G
            self._frozen[key] = frozen
        frozen.load(x)
        return frozen

    def regularized_sam(self, task, frozen: FlatModel):
        """A SAM gradient_fn on F_p = loss + gamma R, and the running sum of batch-mean dL2."""
        p, sam = self.params, sam_gradient(self.params.rho)
        dist_sum = torch.zeros((), device=task.device)

        def gradient(task, xb, yb, loss_fn):
            with torch.no_grad():
                z_global = representation(frozen.module, xb, p.representation)
            at_w = []   # (loss, mean dL2) of each pass; the first is at w

            def objective(module, xb, yb):
                loss, z = loss_and_representation(module, xb, yb, loss_fn, p.representation)
                reg, dist2 = hyperbolic.regularizer(z, z_global, p.beta, p.sigma)
                at_w.append((loss.detach(), dist2.detach().mean()))
                return loss + p.gamma * reg

            sam(task, xb, yb, objective)
            dist_sum.add_(at_w[0][1])
            return at_w[0][0]   # the task loss at w, as for every other method
        return gradient, dist_sum


def representation(module, x, kind: str) -> torch.Tensor:
    return module(x) if kind == "logits" else module.features(x)


def loss_and_representation(module, x, y, loss_fn, kind: str):
    """(task loss, z) with one forward pass when the loss is the usual cross-entropy."""
    if loss_fn is not local_sgd.cross_entropy:
        return loss_fn(module, x, y), representation(module, x, kind)
    z = module.features(x)
    logits = module.classifier(z)
    return F.cross_entropy(logits, y), (logits if kind == "logits" else z)
