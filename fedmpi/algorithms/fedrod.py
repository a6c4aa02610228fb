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
Messages: d_shared down and up, d_shared = d - (F + 1) C.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import local_sgd
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base.features(x)
        return self.base.classifier(h) + self.personal_head(h)


def rod_objective(data):
    """loss_fn(module, x, y): the balanced softmax on G's logits plus the cross-entropy of
    the personalised logits with only P's gradient (counts read once, at the first step)."""
    shift = None

    def loss(module, x, y):
        nonlocal shift
        h = module.features(x)
        generic = module.classifier(h)
        if shift is None:
            shift = data.label_counts(generic.shape[1]).to(generic.dtype).log()
        personal = generic.detach() + module.personal_head(h.detach())
        return F.cross_entropy(generic + shift, y) + F.cross_entropy(personal, y)
    return loss


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
