"""FedNTD: Preservation of the Global Knowledge by Not-True Distillation in Federated Learning.

Lee, Jeong, Shin, Bae and Yun, NeurIPS 2022, https://arxiv.org/abs/2106.03097

Client i trains from x^t on  CE(w) + beta * L_NTD  with, per batch,

    L_NTD = (1/B) sum_b KL( q~_glob(x_b) || q~(x_b) ),
    q~_c(x) = exp(z_c / tau) / sum_{c' != y} exp(z_c' / tau)   for every class c != y,

z the local model's logits and z_glob (in q~_glob) those of the received global model x^t,
frozen (a second copy of the model, ``local_sgd.frozen_copy``, in eval mode: VGG's
dropout is off in the teacher). The "not-true" logits are a sample's logits with its own
label's removed (the other C - 1 in class order); the KL is summed over them and averaged
over the batch. Server: FedAvg (n_i-weighted). Messages d down, d up; no client or server
state.

Paper vs the authors' code (Lee-Gihun/FedNTD, algorithms/fedntd/criterion.py): the code
is the formula above: ``nn.KLDivLoss(reduction="batchmean")`` of log_softmax(local / tau)
against softmax(global / tau), with **no tau^2 factor** (Hinton's KD scales by tau^2; the
authors do not, and FedACG's ``KD`` does not either), so none here.
Defaults tau = 1, beta = 1: the authors' config/fedntd.json (``"params": {"tau": 1,
"beta": 1}``; the class's own defaults tau = 3, beta = 1 are overridden by it).
FedACG's code (geehokim/FedACG, configs/client/NTD.yaml, clients/base_client.py) weighs
the two terms as a convex pair, 0.7 CE + 0.3 NTD with Temp = 1: the same direction as
beta = 3/7 here with the local learning rate scaled by 0.7; fedmpi keeps the paper's
and the authors' CE + beta NTD.
beta = 0 trains on CE alone (FedAvg's local update, bit for bit; the teacher is not run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import local_sgd
from .base import register
from .fedavg import FedAvg
from .local_sgd import FrozenCopies
from .params import Params, param


def not_true(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B, C - 1]: each row of ``logits`` [B, C] without its label's entry, the other
    classes in order. A gather at computed positions (j, or j + 1 from the label on), not
    a boolean mask, whose indexing reads its count back to the host on a GPU."""
    b, c = logits.shape
    j = torch.arange(c - 1, device=logits.device).expand(b, c - 1)
    return logits.gather(1, j + (j >= y.unsqueeze(1)).long())


def ntd_loss(logits: torch.Tensor, global_logits: torch.Tensor, y: torch.Tensor,
             tau: float) -> torch.Tensor:
    """KL(softmax(global not-true / tau) || softmax(local not-true / tau)), summed over the
    C - 1 classes and averaged over the batch (KLDivLoss "batchmean"), no tau^2."""
    log_q = F.log_softmax(not_true(logits, y) / tau, dim=1)
    q_glob = F.softmax(not_true(global_logits, y) / tau, dim=1)
    return F.kl_div(log_q, q_glob, reduction="batchmean")


def ntd_objective(glob, beta: float, tau: float):
    """loss_fn(module, x, y) = CE + beta L_NTD with the frozen global module ``glob``."""
    def loss(module, x, y):
        logits = module(x)
        with torch.no_grad():
            global_logits = glob(x)
        return F.cross_entropy(logits, y) + beta * ntd_loss(logits, global_logits, y, tau)
    return loss


@register
class FedNTD(FedAvg):
    name = "fedntd"
    paper = "Lee et al. 2022, arXiv:2106.03097"

    @dataclass(frozen=True)
    class Params(Params):
        tau: float = param(1.0, "> 0", "temperature tau of the not-true softmax "
                                       "(authors' config: 1)")
        beta: float = param(1.0, ">= 0", "weight beta of the not-true distillation "
                                         "(authors' config: 1; 0 = FedAvg)")

    def __init__(self, params=None):
        super().__init__(params)
        self._frozen = FrozenCopies()   # the worker's frozen global model

    def local_update(self, task, payload, client_state, ctx):
        x, p = payload["x"], self.params
        if p.beta == 0:
            return local_sgd.local_update(task, x, ctx)
        glob = self._frozen.of(task.model)[0]
        glob.load(x)
        loss_fn = ntd_objective(glob.module, p.beta, p.tau)
        return local_sgd.local_update(task, x, ctx, loss_fn=loss_fn)
