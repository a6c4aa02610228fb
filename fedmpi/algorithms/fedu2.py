"""FedU^2: a flexible uniform regulariser (FUR) on the clients and an efficient unified
aggregator (EUA) on the server, over a SimCLR, SimSiam or BYOL client.

Liao et al., "Rethinking the Representation in Federated Unsupervised Learning with
Non-IID Data", CVPR 2024, https://arxiv.org/abs/2403.16398 (code: XeniaLLL/FedU2).

Client k, from the global model: E epochs of the backbone's loss plus the regulariser,

    L = l_ssl(Z^1, Z^2) + lambda_U (l_u(Z^1) + l_u(Z^2)),   Z^v = g(f(x^v)),

with l_u = FUR (fedmpi.algorithms.fur): ``fur = "paper"`` is the unbalanced-OT distance of
the l2-normalised Z to B fresh uniform-sphere samples at the scale where it is active
(c = 0.5||z - s||^2, unit mass; the printed scale gives pi* = 0 and no gradient);
``fur = "code"`` is the released code's tangent-space sliced Wasserstein on the raw
projections (normalised for SimCLR only), weight 0.01; ``fur = "none"`` is the EUA-only
ablation. BYOL's target stays on the client as in FedBYOL (EasyFL's convention; the FedU^2
code averages it with the rest). Upload Delta_k = theta_k - x^t.

Server, ``aggregator = "eua"``: p* = argmin_{p in simplex} p^T G p over the directions
v_k = -2 Delta_k / s_k (G from the inner products <Delta_k, Delta_l>, computed by the
runtime where the updates are: fedmpi.runtime.gram), then

    x^{t+1} = x^t - eta_s sum_k p*_k v_k = x^t + eta_s sum_k (2 p*_k / s_k) Delta_k,

s_k = ||Delta_k||^2 (``eua = "paper"``) or ||Delta_k|| (``eua = "code"``, the default);
fedmpi.algorithms.eua solves the QP exactly. Step length: the paper leaves eta_s open;
the released code (src/my/algo/commons/mtl.py, method 'EUA') takes one SGD step
x <- x - lr sum_k p*_k 2 (x - theta_k) / ||x - theta_k|| with lr = gmodel_lr = 8 (its
cross-silo example, for ResNet-18). ``eua_step = "fixed"`` with ``eua_lr = 8`` (default),
with the default ``eua = "code"``, is that rule: the step's length is at most 2 eta_s
whatever the size of the updates. ``eua_step = "matched"`` is fedmpi's own option, in no
reference: eta_s = eta_g mean_k(s_k) / 2, the one value for which K identical updates
move x exactly as FedAvg does, so the step follows the updates' scale (on the 28x28 CNN,
where client updates have norm 0.1-0.7, the code's lr 8 is 20-100x FedAvg's step).
``aggregator = "fedavg"`` is the FUR-only ablation. Messages d down, d up (a deployment
uploads each model; the simulator's own Gram traffic is in mpi_bytes, not fl_bytes).
Left out (code-only extras): the rotation-prediction head and the
"EvenClient" step equalisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import eua
from .base import register
from .byol import BYOLParams
from .fedbyol import OnBackbone
from .fur import STEPS, tangent_sw_uniformity, uot_uniformity
from .mixins import GramAggregation
from .params import param
from .ssl_losses import halves

BACKBONES = ("byol", "simclr", "simsiam")
FUR_VARIANTS = ("paper", "code", "none")
AGGREGATORS = ("eua", "fedavg")
EUA_STEPS = ("fixed", "matched")
LAMBDA_U = {"paper": 0.1, "code": 0.01, "none": 0.0}


@dataclass(frozen=True)
class FedU2Params(BYOLParams):
    backbone: str = param("byol", BACKBONES,
                          "client method: byol | simclr | simsiam (the paper's comparison uses BYOL)")
    temperature: float = param(0.07, "(0, inf)", "NT-Xent temperature (simclr)")
    fur: str = param("paper", FUR_VARIANTS,
                     "regulariser: paper (UOT, active scale) | code (tangent sliced W2) | none "
                     "(the EUA-only ablation)")
    lambda_u: float | None = param(None, "[0, inf)",
                                   "regulariser weight; default 0.1 with fur = paper, 0.01 with fur = code")
    tau_a: float = param(0.8, "(0, inf)", "UOT marginal penalty tau_a (paper)")
    tau_b: float = param(0.8, "(0, inf)", "UOT marginal penalty tau_b (paper)")
    uot_iters: int = param(50, ">= 1", "UOT projected-descent steps (at most)")
    uot_step: str = param("eq6", STEPS,
                          "UOT step: eq6 (the paper's) | projected (the projected gradient, faster)")
    sw_projections: int = param(6, ">= 1", "random directions per tangent point (fur = code)")
    aggregator: str = param("eua", AGGREGATORS, "server: eua | fedavg (the FUR-only ablation)")
    eua: str = param("code", eua.VARIANTS,
                     "EUA direction scaling: code (Delta / ||Delta||) | paper (Delta / ||Delta||^2)")
    eua_step: str = param("fixed", EUA_STEPS,
                          "EUA step length: fixed (eta_s = eua_lr; with eua = code and eua_lr = 8 "
                          "the released code's rule) | matched (fedmpi's own, in no reference: "
                          "eta_g mean_k(s_k) / 2, so identical updates move x as FedAvg would)")
    eua_lr: float = param(8.0, "(0, inf)",
                          "EUA server step eta_s with eua_step = fixed (the code's gmodel_lr in its "
                          "cross-silo example: 8)")

    def __post_init__(self):
        if self.lambda_u is None and self.fur in LAMBDA_U:   # a bad fur is named by the check
            object.__setattr__(self, "lambda_u", LAMBDA_U[self.fur])
        super().__post_init__()


def with_uniformity(head, params: FedU2Params):
    """``head`` + lambda_U (l_u(Z^1) + l_u(Z^2)) on the projections Z of each view."""
    lam = params.lambda_u
    if params.fur == "none" or lam == 0:
        return head

    def fur(z: torch.Tensor) -> torch.Tensor:
        if params.fur == "paper":
            return uot_uniformity(F.normalize(z, dim=1), None, params.tau_a, params.tau_b,
                                  iters=params.uot_iters, step=params.uot_step)
        if params.backbone == "simclr":
            z = F.normalize(z, dim=1)
        return tangent_sw_uniformity(z, None, projections=params.sw_projections)

    def regularised(module, z, both) -> torch.Tensor:
        z1, z2 = halves(z)
        return head(module, z, both) + lam * (fur(z1) + fur(z2))
    return regularised


@register
class FedU2(GramAggregation, OnBackbone):
    name = "fedu2"
    paper = "Liao et al. 2024, arXiv:2403.16398"
    Params = FedU2Params
    # EUA's weights p*: the largest, the smallest, and exp(entropy) (how many clients count)
    diagnostic_fields = ("eua_weight_max", "eua_weight_min", "eua_clients_effective")

    def __init__(self, params=None):
        super().__init__(params)
        self._weights = None   # server: p* of the last EUA step, for ``diagnostics``

    # ---- client ----
    def regularised(self, head):
        return with_uniformity(head, self.params)

    # ---- server ----
    def gram_weighted(self, phase):
        return self.params.aggregator == "eua"

    def contribution_sizes(self, d, phase=None):
        return {"weight": 1} if self.gram_weighted("train") else super().contribution_sizes(d, phase)

    def contribution(self, upload):
        if not self.gram_weighted("train"):
            return super().contribution(upload)
        return {"weight": torch.tensor([float(upload.num_samples)], device=upload.delta.device)}

    def gram_coefficients(self, inner, ctx):
        norms = np.sqrt(np.clip(np.diag(inner), 0, None))
        self._weights = eua.eua_weights(inner, self.params.eua, norms)
        coef = eua.update_coefficients(self._weights, norms, self.params.eua)
        if self.params.eua_step == "fixed":
            return self.params.eua_lr * coef
        scales = norms ** 2 if self.params.eua == "paper" else norms
        return ctx.global_lr * float(scales.mean()) / 2 * coef  # host sync: none, server numpy

    def server_update(self, state, sums, gathered, ctx):
        if not self.gram_weighted(ctx.phase):
            return super().server_update(state, sums, gathered, ctx)
        state["x"].add_(sums["delta"])   # the coefficients carry the step length

    def diagnostics(self, state, sums, gathered, ctx):
        p = self._weights
        if p is None:
            return {name: math.nan for name in self.diagnostic_fields}
        positive = p[p > 0]
        # host sync: none, server diagnostics on numpy
        return {"eua_weight_max": float(p.max()), "eua_weight_min": float(p.min()),
                "eua_clients_effective": float(np.exp(-(positive * np.log(positive)).sum()))}
