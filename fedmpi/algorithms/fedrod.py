"""FedRoD: On Bridging Generic and Personalized Federated Learning for Image
Classification.

Chen, Chao, ICLR 2022, https://arxiv.org/abs/2107.00778

The model gets a second, personalised head P next to its generic head G (both linear on
the body's features h): the generic prediction is G(h), a client's personalised one
G(h) + P_i(h). Each local step minimises, over the step's batch,

    BSM(G(h), y) + CE(G(h).detach() + P(h.detach()), y),

the balanced softmax (the logits shifted by log n_{i,c}, the client's label counts: a
class it lacks takes no part) training the body and G, the cross-entropy of the
personalised logits training P alone. The body and G are FedAvg's and travel; P is a
private layer (fedmpi.runtime.partial) each client keeps. P starts at zero, so the
global model (whose P stays the initial one) predicts G(h): ``test_acc`` is the generic
model's, and per-client evaluation's personal scores are each client's G + P_i.
Messages: d_shared down and up, d_shared = d - (F + 1) C. In a client group each row
starts from its client's merged model and the same objective is differentiated for every
row at once (``torch.func.vmap``, each row with its own label counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from . import group_sgd, local_sgd
from .base import register
from .params import Params
from .private import PrivateLayers


class WithPersonalHead(nn.Module):
    """``base`` (a Classifier) with a personalised linear head beside its classifier:
    forward = classifier(h) + personal_head(h), the personal head zero at the start."""

    def __init__(self, base: nn.Module, num_classes: int):
        super().__init__()
        self.base = base
        width = base.classifier.in_features
        self.personal_head = nn.Linear(width, num_classes)
        nn.init.zeros_(self.personal_head.weight)
        nn.init.zeros_(self.personal_head.bias)

    @property
    def classifier(self) -> nn.Module:
        return self.base.classifier

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.features(x)

    def forward(self, x: torch.Tensor, heads: bool = False):
        """G(h) + P(h); with ``heads``, the objective's two: the generic logits G(h) and
        the personalised ones G(h).detach() + P(h.detach()) (a keyword of forward, so
        that ``torch.func.functional_call`` reaches them)."""
        h = self.base.features(x)
        generic = self.base.classifier(h)
        if heads:
            return generic, generic.detach() + self.personal_head(h.detach())
        return generic + self.personal_head(h)


def rod_loss(generic, personal, y, shift, weights=None) -> torch.Tensor:
    """BSM(G(h), y) + CE(personal, y): each sample's, weighted (padding: 0), or the mean."""
    if weights is None:
        return F.cross_entropy(generic + shift, y) + F.cross_entropy(personal, y)
    per = F.cross_entropy(generic + shift, y, reduction="none") \
        + F.cross_entropy(personal, y, reduction="none")
    return (per * weights).sum()


def rod_objective(data):
    """loss_fn(module, x, y): the balanced softmax on G's logits plus the cross-entropy of
    the personalised logits with only P's gradient (counts read once, at the first step)."""
    shift = None

    def loss(module, x, y):
        nonlocal shift
        generic, personal = module(x, heads=True)
        if shift is None:
            shift = data.label_counts(generic.shape[1]).to(generic.dtype).log()
        return rod_loss(generic, personal, y, shift)
    return loss


def rod_group_gradient(tasks, num_classes: int):
    """``rod_objective`` for a client group: a ``group_sgd.train`` hook differentiating
    every active row's loss at once, each row with its client's label counts."""
    flat = tasks[0].model
    module = flat.module
    shifts = torch.stack([t.data.label_counts(num_classes) for t in tasks]).to(
        device=flat.params.device, dtype=flat.params.dtype).log()

    def loss(params, x, y, shift, weights=None):
        generic, personal = functional_call(module, params, (x,), {"heads": True})
        return rod_loss(generic, personal, y, shift, weights)

    step = vmap(grad_and_value(loss))

    def gradient(model, a, x, y, weights, autocast):
        args = (x, y, shifts[:a]) if weights is None else (x, y, shifts[:a], weights)
        losses, pieces = model.vmapped(step, a, args, autocast)
        return losses, model.concatenated(a, pieces)
    return gradient


@register
class FedRoD(PrivateLayers):
    name = "fedrod"
    paper = "Chen and Chao 2022, arXiv:2107.00778"

    @dataclass(frozen=True)
    class Params(Params):
        pass

    def build_model(self, build, name, in_channels, num_classes, image_size, options):
        return WithPersonalHead(build(name, in_channels, num_classes, image_size, **options),
                                num_classes)

    def private_layers(self, module):
        return ["personal_head"]

    def local_update(self, task, payload, client_state, ctx):
        return local_sgd.local_update(task, payload["x"], ctx, loss_fn=rod_objective(task.data))

    def local_update_group(self, tasks, payload, client_states, ctx):
        classes = tasks[0].model.module.personal_head.out_features
        return group_sgd.local_update(tasks, payload["x"], ctx,
                                      gradient=rod_group_gradient(tasks, classes))
