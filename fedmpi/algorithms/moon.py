"""MOON: Model-Contrastive Federated Learning.

Li, He and Song, CVPR 2021, https://arxiv.org/abs/2103.16257

Client i trains from x^t on  CE(w) + mu * l_con  with, per sample,

    l_con = -log( e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau}) ),

z = the projection head's output of the local model, z_glob that of the received global
model and z_prev that of the client's model after its previous participation (both
frozen); the batch mean is taken. Server: FedAvg (n_i-weighted). Messages d down, d up;
client state: the previous local model (d) and a flag saying it exists (1).

The head is the model option ``model.proj_dim`` (Linear(F, F) -> ReLU -> Linear(F, proj_dim)
on the features, aggregated with the rest of the model; MOON uses 256). Unlike
QinbinLi/MOON's ModelFedCon the classifier reads the features, not the projection.
Defaults tau = 0.5, mu = 5 are the CIFAR-10 example of the QinbinLi/MOON README (the paper
uses smaller mu on CIFAR-100 and Tiny-ImageNet). A client's first participation has no
previous model: ``first_participation = "skip"`` trains on CE alone, which is what the
authors' code computes while its model pool is empty (only the positive pair: l_con = 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UsageError
from . import local_sgd
from .base import Upload, register
from .fedavg import FedAvg
from .local_sgd import FrozenCopies
from .params import Params, param

FIRST_PARTICIPATION = ("skip",)
_NO_HEAD = ("config field model.proj_dim: moon needs a projection head; "
            "set model.proj_dim > 0 (MOON uses 256)")


def model_contrastive(z, z_glob, z_prev, tau: float) -> torch.Tensor:
    """l_con averaged over the batch: cross-entropy with the positive pair as class 0."""
    logits = torch.stack([F.cosine_similarity(z, z_glob, dim=1),
                          F.cosine_similarity(z, z_prev, dim=1)], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


def moon_loss(glob, prev, mu: float, tau: float):
    """loss_fn(module, x, y) = CE + mu l_con with z_glob, z_prev from the frozen modules
    (CE alone when there is no previous model)."""
    def loss(module, x, y):
        h = module.features(x)
        ce = F.cross_entropy(module.classifier(h), y)
        if prev is None:
            return ce
        with torch.no_grad():
            z_glob = glob.project(glob.features(x))
            z_prev = prev.project(prev.features(x))
        return ce + mu * model_contrastive(module.project(h), z_glob, z_prev, tau)
    return loss


@register
class Moon(FedAvg):
    name = "moon"
    paper = "Li, He and Song 2021, arXiv:2103.16257"

    @dataclass(frozen=True)
    class Params(Params):
        mu: float = param(5.0, ">= 0", "weight mu of the contrastive loss")
        tau: float = param(0.5, "> 0", "temperature tau of the contrastive loss")
        first_participation: str = param("skip", FIRST_PARTICIPATION, "no previous model yet: "
                                         "'skip' = CE only (authors' code, empty model pool)")

    def __init__(self, params=None):
        super().__init__(params)
        self._frozen = FrozenCopies(2)   # the worker's global and previous models

    def client_state_sizes(self, d):
        return {"prev_model": d, "has_prev": 1}

    def check_model(self, model_options):
        if not model_options.get("proj_dim"):
            raise UsageError(_NO_HEAD)

    def local_update(self, task, payload, client_state, ctx):
        if getattr(task.model.module, "projector", None) is None:
            raise UsageError(_NO_HEAD)
        glob, prev = self._frozen.of(task.model)
        x = payload["x"]
        glob.load(x)
        has_prev = bool(client_state["has_prev"].item())  # host sync: once per client
        if has_prev:
            prev.load(client_state["prev_model"])
        p = self.params
        task.model.load(x)
        loss_fn = moon_loss(glob.module, prev.module if has_prev else None, p.mu, p.tau)
        loss, steps = local_sgd.train(task, ctx, loss_fn=loss_fn)
        w = task.model.params
        state = {"prev_model": w.clone(), "has_prev": torch.ones(1, device=w.device)}
        return Upload(delta=w - x, num_samples=task.data.num_samples, loss=loss, steps=steps,
                      state=state)

    def refined_upload(self, upload, x, w, w_new, steps, ctx):
        """FNR-FL: as FedAvg, and the previous local model kept for the next round is w_new."""
        new, change = super().refined_upload(upload, x, w, w_new, steps, ctx)
        new.state = {**upload.state, "prev_model": w_new.clone()}
        return new, change
