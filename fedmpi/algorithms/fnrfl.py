"""FNR-FL: Feature Norm Regularized Federated Learning.

Full title: "... Transforming Skewed Distributions into Global Insights". Hu, Qiu and
Tang, 2023, https://arxiv.org/abs/2312.06951 (code LonelyMoonDesert/FNR-FL).
A plug-in over a base method (FedAvg, FedProx, SCAFFOLD, MOON,
FedNova): ``base`` names it, ``base_params`` are its parameters.

Phase "train" (all sampled S): the base's local update (E_train = train.local_epochs),
then on the public set D_pub the class-average feature norms F_i[l] = mean ||phi(x)||_2
and the accuracy A_i; the base's server update runs. S_re = the floor(n p) clients of
lowest A_i (ties: lower id), and for j in S_re
    Delta_j[l] = sum_{m in S \\ S_re} (F_m[l] - F_j[l])   (paper Alg. 2; code: all m != j).
Phase "refine" (S_re): E_re epochs on D_pub batches B of
    CE(w_j; B) + lambda sum_{l in B} (n_l(B)/|B|) Delta_j[l]
from the client's own trained w_j; the refined models replace w_j in
w^{t+1} = sum_i (n_i / sum n) w_i, i.e. x += eta_g sum_j n_j (w_j' - w_j) / sum_S n.
The paper's term is a constant (zero gradient); ``regularizer = "differentiable"`` is
our extension (NOT in the paper): lambda sum_l rho_l (Fbar_j[l] - F_j^B[l])^2.

w_j stays on the client between the phases (client state "fnr_model", d), so the honest
traffic is: train = the base's + (C + 1) up; refine = C down (Delta_j), d up (w_j').
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UsageError
from . import feature_norms as fn
from . import local_sgd
from .base import Algorithm, Upload, register
from .params import Params, param, param_error


@register
class FNRFL(Algorithm):
    name = "fnrfl"
    paper = "Hu et al. 2023, arXiv:2312.06951"
    phases = ("train", "refine")
    diagnostic_fields = ("fnr_refined", "fnr_public_acc_mean")
    needs_public = True   # F_i, A_i and the refinement read the server's public split

    @dataclass(frozen=True)
    class Params(Params):
        base: str = param("fedavg", doc="base method: fedavg, fedprox, scaffold, moon, fednova "
                                        "(any one-phase method)")
        base_params: dict = param({}, doc="the base's parameters, e.g. {mu = 0.01} "
                                          "(resolved: every one written out)")
        p: float = param(0.5, "[0, 1]", "p: the floor(n p) clients of lowest public accuracy "
                                        "are refined (code 0.5)")
        lam: float = param(1.0, ">= 0", "lambda, regulariser weight (code 1.0, README 0.5)")
        refine_epochs: int = param(5, ">= 1", "E_re, epochs over the public set when refining")
        num_classes: int = param(10, ">= 1", "C, length of F_i (must match the model)")
        delta_over: str = param("unselected", ("unselected", "all_others"),
                                "m in Delta_j: 'unselected' = S minus S_re (paper Alg. 2); "
                                "'all_others' = every m != j (code)")
        regularizer: str = param("faithful", ("faithful", "differentiable"),
                                 "'faithful': the paper's constant term (no gradient); 'differentiable': "
                                 "squared distance to the mean class norms (NOT in the paper)")

        def __post_init__(self):
            super().__post_init__()
            if self.regularizer == "differentiable" and self.delta_over == "unselected" and self.p == 1:
                raise param_error("p", "p = 1 leaves no unrefined client to take the target norms from")
            resolved = dataclasses.asdict(_build_base(self).params)
            object.__setattr__(self, "base_params", resolved)

    def __init__(self, params=None):
        super().__init__(params)
        self.base = _build_base(self.params)
        self.diagnostic_fields = tuple(self.base.diagnostic_fields) + FNRFL.diagnostic_fields

    # ---- declarations ----
    def traffic(self, d, phase):
        C = self.params.num_classes
        if phase == "refine":
            return C, d
        down, up = self.base.traffic(d, "train")
        return down, up + C + 1

    def client_state_sizes(self, d):
        return {**self.base.client_state_sizes(d), "fnr_model": d}

    def gather_sizes(self, d, phase=None):
        """train: the base's + F_i (C) + A_i; refine: the mean penalty; None: all of them."""
        train = {**self.base.gather_sizes(d, "train"), "fnr_feature_norm": self.params.num_classes,
                 "fnr_public_acc": 1}
        refine = {"fnr_penalty": 1}
        return {"train": train, "refine": refine}.get(phase, {**train, **refine})

    def contribution_sizes(self, d, phase=None):
        """train: the base's; refine: n_j (w_j' - w_j); None: both."""
        train, refine = self.base.contribution_sizes(d, "train"), {"fnr_refined": d}
        return {"train": train, "refine": refine}.get(phase, {**train, **refine})

    # ---- server ----
    def init_server_state(self, x):
        return {**self.base.init_server_state(x), "fnr_selected": torch.zeros(0, dtype=torch.int64),
                "fnr_signal": torch.zeros(0, self.params.num_classes), "fnr_weight": torch.ones(1)}

    def phase_participants(self, state, phase, sampled):
        if phase == "refine":
            return state["fnr_selected"].numpy()  # host sync: none, server state on the CPU
        return self.base.phase_participants(state, phase, sampled)

    def payload(self, state, ctx):
        if ctx.phase == "train":
            return self.base.payload(state, ctx)
        return {"fnr_clients": state["fnr_selected"].float(),
                "fnr_signal": state["fnr_signal"].reshape(-1)}

    def server_update(self, state, sums, gathered, ctx):
        if ctx.phase == "train":
            self.base.server_update(state, sums, gathered, ctx)
            self._select(state, gathered)
        else:  # the refined w_j' replace w_j in the n_i-weighted average
            # host sync: server, once per round
            state["x"].add_(sums["fnr_refined"], alpha=ctx.global_lr / float(state["fnr_weight"]))

    def _select(self, state, gathered) -> None:
        """S_re = floor(n p) lowest A_i (stable: ties go to the lower client id) and their signals."""
        acc = gathered["fnr_public_acc"]
        norms = gathered["fnr_feature_norm"].reshape(len(acc), -1)
        count = math.floor(len(acc) * self.params.p + 1e-9)  # 10 * 0.3 must give 3
        chosen = np.sort(np.argsort(acc, kind="stable")[:count])
        signal = (fn.norm_differences if self.params.regularizer == "faithful" else fn.norm_targets)(
            norms, chosen, self.params.delta_over)
        state["fnr_selected"] = torch.as_tensor(gathered["client"][chosen].astype(np.int64))
        state["fnr_signal"] = torch.as_tensor(signal, dtype=torch.float32)
        # host sync: none, server numpy
        state["fnr_weight"] = torch.tensor([float(gathered["n_samples"].sum())])

    def eval_params(self, state):
        return self.base.eval_params(state)

    def diagnostics(self, state, sums, gathered, ctx):
        if ctx.phase != "train":
            return {}
        return {**self.base.diagnostics(state, sums, gathered, ctx),
                "fnr_refined": float(len(state["fnr_selected"])),
                "fnr_public_acc_mean": float(np.mean(gathered["fnr_public_acc"]))}

    # ---- client ----
    def local_update(self, task, payload, client_state, ctx):
        if ctx.phase == "train":
            return self._train(task, payload, client_state, ctx)
        return self._refine(task, payload, client_state, ctx)

    def _train(self, task, payload, client_state, ctx):
        """The base's update, then F_i and A_i of the trained model (left in task.model)."""
        C, module = self.params.num_classes, task.model.module
        out = getattr(getattr(module, "classifier", None), "out_features", C)
        if out != C:
            raise param_error("num_classes", f"{C}, but the model has {out} classes")
        sizes = self.base.client_state_sizes(task.model.size)
        base_state = {k: client_state[k] for k in sizes} if sizes else None
        upload = self.base.local_update(task, payload, base_state, ctx)
        norms, acc = fn.class_feature_norms(module, task.public, C)
        upload.extras = {**upload.extras, "fnr_feature_norm": norms.to(upload.delta.device),
                         "fnr_public_acc": torch.tensor([acc])}
        upload.state = {**(upload.state or base_state or {}), "fnr_model": task.model.params.clone()}
        return upload

    def _refine(self, task, payload, client_state, ctx):
        """E_re epochs on public batches from the client's own w_j; uploads w_j' - w_j."""
        # host sync: once per refined client, before training
        row = int((payload["fnr_clients"] == task.client).nonzero()[0, 0])
        signal = payload["fnr_signal"].view(-1, self.params.num_classes)[row]
        w = client_state["fnr_model"]
        task.model.load(w)
        loss_fn = fn.RefineLoss(self.params.regularizer, self.params.lam, signal, task.loss_fn)
        refine_ctx = dataclasses.replace(ctx, local_epochs=self.params.refine_epochs)
        loss, steps = local_sgd.train(dataclasses.replace(task, data=task.public), refine_ctx,
                                      loss_fn=loss_fn)
        delta = task.model.params - w
        n = task.data.num_samples
        penalty = torch.tensor([loss_fn.mean_penalty()])
        return Upload(delta=delta, num_samples=n, loss=loss, steps=steps,
                      extras={"fnr_refined": delta * n, "fnr_penalty": penalty})

    def contribution(self, upload):
        """This phase's contributions: the base's in train, n_j (w_j' - w_j) in refine."""
        if "fnr_refined" in upload.extras:
            return {"fnr_refined": upload.extras["fnr_refined"]}
        return self.base.contribution(upload)

    def gather(self, upload):
        if "fnr_refined" in upload.extras:
            return {"fnr_penalty": upload.extras["fnr_penalty"]}
        return {**self.base.gather(upload), "fnr_feature_norm": upload.extras["fnr_feature_norm"],
                "fnr_public_acc": upload.extras["fnr_public_acc"]}


def _build_base(params) -> Algorithm:
    from . import REGISTRY, build

    if params.base == FNRFL.name or params.base not in REGISTRY:
        allowed = ", ".join(sorted(set(REGISTRY) - {FNRFL.name}))
        raise param_error("base", f"{params.base!r} is not allowed; choose one of {allowed}")
    if REGISTRY[params.base].phases != ("train",):
        raise param_error("base", f"{params.base} has phases {REGISTRY[params.base].phases}; "
                            "a base needs the single phase 'train'")
    try:
        return build(params.base, dict(params.base_params))
    except UsageError as exc:
        raise param_error("base_params", str(exc).removeprefix("config field ")) from None
