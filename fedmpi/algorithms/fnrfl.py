"""FNR-FL: Feature Norm Regularized Federated Learning.

Full title: "... Transforming Skewed Distributions into Global Insights". Hu, Qiu and
Tang, 2023, https://arxiv.org/abs/2312.06951 (code LonelyMoonDesert/FNR-FL, on NIID-Bench).
A plug-in over a base method (BASES: fedavg, fedprox, fedsam, fedavgm, fedadam, moon,
scaffold, fedacg, fednova, feddyn); ``base`` names it, ``base_params`` are its parameters.

Phase "train" (all sampled S): the base's local update (E_train = train.local_epochs),
then on the public set D_pub the class-average feature norms F_i[l] = mean ||phi(x)||_2
and the accuracy A_i; the base's server update runs. S_re = the floor(n p) clients of
lowest A_i (ties: lower id), and for j in S_re
    Delta_j[l] = sum_{m in S \\ S_re} (F_m[l] - F_j[l])   (paper Alg. 2; code: all m != j).
Phase "refine" (S_re): E_re epochs on D_pub batches B of
    CE(w_j; B) + lambda sum_{l in B} (n_l(B)/|B|) Delta_j[l]
from the client's own trained w_j. The paper's term is a constant (zero gradient);
``regularizer = "differentiable"`` is our extension (NOT in the paper):
lambda sum_l rho_l (Fbar_j[l] - F_j^B[l])^2.

D_pub is read without the training augmentation whatever ``data.augment`` says (F_i, A_i
and the refinement's batches alike): the authors' code reads it through the test
transform, no crop/flip (fedmpi.runtime.clientdata.UNAUGMENTED_STREAMS). Its batches
are reshuffled each epoch (the code's loader is not shuffled) and have train.batch_size.

The merge: the refined w_j' replace w_j in the base's own server update of the round,
i.e. the server restores the state from before the train phase's update and runs the
base's ``server_update`` again on the train phase's sums and rows with each refined
client's contribution replaced (a client sends how its contribution changes; the server
adds that to the train sums, and the refine rows replace the base's train rows). How w_j'
enters each base is the base's own ``refined_upload`` (fedmpi.algorithms.base): by
default, with D_j = w_j' - w_j, its "delta" contribution changes by that of D_j (n_j D_j
n_i-weighted; D_j for SCAFFOLD's and FedACG's plain mean and FedDyn; SCAFFOLD's Delta c_j,
c_i and so c stay the train phase's: the refinement's steps on D_pub are not SCAFFOLD
steps), and the server optimisers (FedAvgM, FedAdam, FedACG) step once on that mean from
the momenta before the round; FedNova's n_j d_j becomes -n_j (w_j' - x^t) / a_j' with
a_j' = a_j + a_re (a_re its a for the K_re plain steps, train.momentum as rho), tau_eff
taking a_j'; FedDyn's grad L_j -= alpha D_j (h stays the mean of the grad L_i); MOON's
previous model becomes w_j'. Other bases are refused at config time (BASES). A round
nobody is refined in (p = 0) is the base's round bit for bit.

w_j stays on the client between the phases (client state "fnr_model", d), with the base's
train values it needs to rebuild its upload (``_kept``: FedNova's a_j, SCAFFOLD's
Delta c_j), so the honest traffic is: train = the base's + (C + 1) up; refine = C down
(Delta_j), d up (w_j' - w_j; FedNova: and a_j'). The refine payload also carries x^t,
which the client holds from the train phase (not counted).
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


# The bases FNR-FL refines over: each says in its ``refined_upload`` how w_j' enters its
# aggregation. Not here: FedCM and MoFedSAM (their momentum counts the participants' local
# steps), FedExP, FedMIM and FedMRUR (per-client values of Delta_i beside the sum), the
# self-supervised methods (no labels for F_i and A_i).
BASES = ("fedavg", "fedprox", "fedsam", "fedavgm", "fedadam", "moon", "scaffold", "fedacg",
         "fednova", "feddyn")


@register
class FNRFL(Algorithm):
    name = "fnrfl"
    paper = "Hu et al. 2023, arXiv:2312.06951"
    phases = ("train", "refine")
    diagnostic_fields = ("fnr_refined", "fnr_public_acc_mean")
    needs_public = True   # F_i, A_i and the refinement read the server's public split

    @dataclass(frozen=True)
    class Params(Params):
        base: str = param("fedavg", doc="base method: " + ", ".join(BASES) + " (the refined "
                                        "models go through its own aggregation)")
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
        self.key = _changed_key(self.base)   # the base's contribution w_j' changes
        self._pending = None   # server, between the phases: (state before, sums, rows, ctx)

    # ---- declarations ----
    def traffic(self, d, phase):
        C = self.params.num_classes
        if phase == "refine":
            return C, d + sum(self._rows(d).values())
        down, up = self.base.traffic(d, "train")
        return down, up + C + 1

    def client_state_sizes(self, d):
        return {**self.base.client_state_sizes(d), "fnr_model": d,
                **{f"fnr_{k}": n for k, n in self._kept(d).items()}}

    def _rows(self, d):
        """The base's gathered rows (w_j' changes them: sent again in the refine phase)."""
        return self.base.gather_sizes(d, "train")

    def _kept(self, d):
        """The base's train values its upload is rebuilt from in the refine phase: its rows
        and its contributions but the one w_j' changes and "weight" (the upload's extras of
        those names: FedNova's a_j, SCAFFOLD's Delta c_j)."""
        sizes = {**self._rows(d), **self.base.contribution_sizes(d, "train")}
        return {k: n for k, n in sizes.items() if k not in (self.key, "weight")}

    def check_training(self, train):
        self.base.check_training(train)

    def gather_sizes(self, d, phase=None):
        """train: the base's + F_i (C) + A_i; refine: the mean penalty and the base's rows
        w_j' changes (FedNova's a_j'); None: all of them."""
        train = {**self.base.gather_sizes(d, "train"), "fnr_feature_norm": self.params.num_classes,
                 "fnr_public_acc": 1}
        refine = {"fnr_penalty": 1, **self._rows(d)}
        return {"train": train, "refine": refine}.get(phase, {**train, **refine})

    def contribution_sizes(self, d, phase=None):
        """train: the base's; refine: how client j's contribution to the base's vector
        ``key`` changes with w_j' (n_j (w_j' - w_j) for FedAvg); None: both."""
        train, refine = self.base.contribution_sizes(d, "train"), {"fnr_refined": d}
        return {"train": train, "refine": refine}.get(phase, {**train, **refine})

    # ---- server ----
    def init_server_state(self, x):
        return {**self.base.init_server_state(x), "fnr_selected": torch.zeros(0, dtype=torch.int64),
                "fnr_signal": torch.zeros(0, self.params.num_classes)}

    def phase_participants(self, state, phase, sampled):
        if phase == "refine":
            return state["fnr_selected"].numpy()  # host sync: none, server state on the CPU
        return self.base.phase_participants(state, phase, sampled)

    def compressible(self, d):
        """None: the refinement rebuilds each client's upload from its local model."""
        return {"up": {}, "down": {}}

    def payload(self, state, ctx):
        if ctx.phase == "train":
            return self.base.payload(state, ctx)
        payload = {"fnr_clients": state["fnr_selected"].float(),
                   "fnr_signal": state["fnr_signal"].reshape(-1)}
        if len(state["fnr_selected"]):
            payload["fnr_x"] = self._pending[0]["x"]   # x^t, before the train phase's update
        return payload

    def server_update(self, state, sums, gathered, ctx):
        if ctx.phase == "train":
            self._pending = None
            if math.floor(len(gathered["client"]) * self.params.p + 1e-9):   # someone is refined
                before = {k: v.clone() for k, v in state.items() if not k.startswith("fnr_")}
                self._pending = (before, {k: v.clone() for k, v in sums.items()},
                                 {k: np.array(v, copy=True) for k, v in gathered.items()}, ctx)
            self.base.server_update(state, sums, gathered, ctx)
            self._select(state, gathered)
        elif len(state["fnr_selected"]):   # p = 0: the base's round as it is
            self._merge(state, sums, gathered)

    def _merge(self, state, sums, gathered) -> None:
        """The base's server update of this round again, from the state before it, on the
        train phase's sums and rows with the refined clients' contributions substituted."""
        before, train_sums, rows, ctx = self._pending
        key = self.key
        merged = {**train_sums, key: train_sums[key] + sums["fnr_refined"]}
        where = np.searchsorted(rows["client"], gathered["client"])
        for name in self._rows(before["x"].numel()):
            rows[name][where] = gathered[name]
        for name, value in before.items():
            state[name] = value
        self.base.server_update(state, merged, rows, ctx)
        self._pending = (None, merged, rows, ctx)   # what diagnostics reports

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

    def eval_params(self, state):
        return self.base.eval_params(state)

    def diagnostics(self, state, sums, gathered, ctx):
        if ctx.phase != "train":   # the base's, recomputed on the merged sums and rows
            if not len(state["fnr_selected"]) or self._pending is None:
                return {}
            _, merged, rows, train_ctx = self._pending
            return self.base.diagnostics(state, merged, rows, train_ctx)
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
        d = task.model.size
        sizes = self.base.client_state_sizes(d)
        base_state = {k: client_state[k] for k in sizes} if sizes else None
        upload = self.base.local_update(task, payload, base_state, ctx)
        norms, acc = fn.class_feature_norms(module, task.public, C)
        upload.extras = {**upload.extras, "fnr_feature_norm": norms.to(upload.delta.device),
                         "fnr_public_acc": torch.tensor([acc])}
        kept = {f"fnr_{k}": upload.extras[k].reshape(-1).float() for k in self._kept(d)}
        upload.state = {**(upload.state or base_state or {}), "fnr_model": task.model.params.clone(),
                        **kept}
        return upload

    def _refine(self, task, payload, client_state, ctx):
        """E_re epochs on public batches from the client's own w_j; uploads how its
        contribution to the base's aggregation changes with w_j' (the base's
        ``refined_upload`` of its train upload, rebuilt from the client state)."""
        # host sync: once per refined client, before training
        row = int((payload["fnr_clients"] == task.client).nonzero()[0, 0])
        signal = payload["fnr_signal"].view(-1, self.params.num_classes)[row]
        w = client_state["fnr_model"]
        task.model.load(w)
        loss_fn = fn.RefineLoss(self.params.regularizer, self.params.lam, signal, task.loss_fn)
        refine_ctx = dataclasses.replace(ctx, local_epochs=self.params.refine_epochs)
        loss, steps = local_sgd.train(dataclasses.replace(task, data=task.public), refine_ctx,
                                      loss_fn=loss_fn)
        w_new, x = task.model.params.clone(), payload.get("fnr_x")   # x^t (a direct call: None)
        d, n = task.model.size, task.data.num_samples
        sizes = self.base.client_state_sizes(d)
        trained = Upload(delta=None if x is None else w - x, num_samples=n, loss=0.0, steps=0,
                         extras={k: client_state[f"fnr_{k}"] for k in self._kept(d)},
                         state={k: client_state[k] for k in sizes} if sizes else None)
        refined, changes = self.base.refined_upload(trained, x, w, w_new, steps, ctx)
        if set(changes) != {self.key}:
            raise ValueError(f"{self.params.base}.refined_upload changed {sorted(changes)}; "
                             f"FNR-FL sends the change of {self.key!r}")
        penalty = torch.tensor([loss_fn.mean_penalty()])
        state = None if refined.state is trained.state else {**client_state, **refined.state}
        return Upload(delta=w_new - w, num_samples=n, loss=loss, steps=steps,
                      extras={"fnr_refined": changes[self.key], "fnr_penalty": penalty,
                              **self.base.gather(refined)},
                      state=state)

    def contribution(self, upload):
        """This phase's contributions: the base's in train, the change of client j's in refine."""
        if "fnr_refined" in upload.extras:
            return {"fnr_refined": upload.extras["fnr_refined"]}
        return self.base.contribution(upload)

    def gather(self, upload):
        if "fnr_refined" in upload.extras:
            return {"fnr_penalty": upload.extras["fnr_penalty"],
                    **{name: upload.extras[name] for name in self._rows(upload.delta.numel())}}
        return {**self.base.gather(upload), "fnr_feature_norm": upload.extras["fnr_feature_norm"],
                "fnr_public_acc": upload.extras["fnr_public_acc"]}


def _build_base(params) -> Algorithm:
    from . import REGISTRY, build   # deferred: __init__ imports this module before build

    if params.base not in BASES or params.base not in REGISTRY:
        raise param_error("base", f"{params.base!r} is not supported; choose one of "
                                  f"{', '.join(BASES)} (the bases whose aggregation the refined "
                                  f"models can go through)")
    try:
        return build(params.base, dict(params.base_params))
    except UsageError as exc:
        raise param_error("base_params", str(exc).removeprefix("config field ")) from None


def _changed_key(base: Algorithm) -> str:
    """The base's contribution a refined model changes: "delta" (the update), or the base's
    only one besides "weight" (FedNova's "normalized")."""
    names = [k for k in base.contribution_sizes(1, "train") if k != "weight"]
    if "delta" in names:
        return "delta"
    (key,) = names
    return key
