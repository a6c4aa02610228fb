"""FedMLB: Multi-Level Branched Regularization for Federated Learning.

Kim, Kim and Han, ICML 2022, https://arxiv.org/abs/2207.06936
[code: jinkyu032/FedMLB local_update_method/FedMLB.py, models/resnet_FedMLB.py; the same
loss in geehokim/FedACG clients/base_client.py with configs/client/MLB.yaml]

The model's ``features`` is a chain of L blocks B^1..B^L (``Classifier.blocks``; ResNet-18:
stem, layer1, layer2, layer3, layer4 + pool), then the classifier C. Client i trains from
x^t on, per batch,

    CE(z_M, y) + lambda1 * (1/L) sum_l CE(z_l, y)
               + lambda2 * (1/L) sum_l KL( softmax(z_l / tau) || softmax(z_M / tau) ),

z_M = C_loc(B^L_loc(...B^1_loc(x))) the main pathway (the local model), and for each level
l = 1..L the hybrid pathway z_l = C_glob(B^L_glob(...B^{l+1}_glob(h_l))) that feeds the local
model's output after block l, h_l = B^l_loc(...B^1_loc(x)), through the frozen received
global model's remaining blocks and its classifier (l = L: the local features through the
global classifier alone). The h_l are those of the main pathway's forward, computed once.
KL is the batch mean of sum_c p_c (log p_c - log q_c). Server: FedAvg (n_i-weighted).
Messages d down, d up; no client or server state beyond x.

Paper vs code, and the choices here (each as the authors' code has it):
- the KL compares each hybrid output with the MAIN pathway's (the local model's) output,
  not with the global model's; its target p is the hybrid's softened output, the
  argument q the main pathway's [code: KD(this_log_prob, log_probs, T) =
  KLDivLoss(batchmean)(log_softmax(z_M/T), softmax(z_l/T))], so KL(hybrid || main);
- the hybrid output is not detached: the KL's gradient reaches the local blocks through
  both pathways (the global blocks are frozen, the gradient passes through them to h_l);
- no tau^2 factor on the KL;
- both branch terms are the mean over the L levels (sum / num_branch);
- the main CE's weight is 1 (the code's lambda1 = 1, FedACG's ce_loss.weight = 1);
  ``lambda1`` here is the code's lambda2 (hybrid CE), ``lambda2`` its lambda3 (KL), the
  paper's naming;
- every level takes part (the code's select_level = -1, FedACG's branch_level [0..4] on
  ResNet-18's five blocks); a subset of levels is not offered;
- the frozen global copy runs in eval mode (``local_sgd.frozen_copy``): the models here
  have no BatchNorm, so this matters only for VGG-11's dropout, which the global pathway
  then does not draw (the authors' ResNet has no dropout; their copy stays in train mode).
Defaults lambda1 = lambda2 = 1, tau = 1: the code's argparse defaults (lambda1 = lambda2 =
lambda3 = 1, temp = 1), which the README's CIFAR-100 command keeps; FedACG's
configs/client/MLB.yaml has the same (branch_cls_weight 1, branch_kl_weight 1, Temp 1).
lambda1 = lambda2 = 0 is FedAvg bit for bit (no hybrid pathway is computed).

A model must declare its blocks (cnn: 3, resnet18: 5, vgg11: 6; see each model's
``blocks``); one that declares none (2nn, mlp, lstm) is refused at config time, naming
model.name, and again at local-update time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UsageError
from ..models import COMMON_OPTIONS, MODELS
from ..models.classifier import Classifier
from . import local_sgd
from .base import Upload, register
from .fedavg import FedAvg
from .local_sgd import FrozenCopies
from .params import Params, param


def models_with_blocks() -> tuple[str, ...]:
    """The registry's models whose class declares ``blocks`` (overrides Classifier's)."""
    return tuple(name for name, spec in MODELS.items()
                 if getattr(spec.cls, "blocks", Classifier.blocks) is not Classifier.blocks)


def _no_blocks(got: str = "") -> UsageError:
    allowed = ", ".join(map(repr, models_with_blocks()))
    return UsageError(f"config field model.name: fedmlb needs a model that declares blocks, "
                      f"one of {allowed}{got}")


def _candidates(model_options: dict) -> list[str]:
    """The registry's models whose options are exactly the keys of the resolved
    ``model_options`` (check_model gets no name; the option sets tell the models apart,
    except 2nn and mlp, which both declare no blocks)."""
    keys = set(model_options) - set(COMMON_OPTIONS)
    return [name for name, spec in MODELS.items() if keys <= set(spec.options)
            and {k for k, o in spec.options.items() if not o.when_given} <= keys]


def kd(p_logits: torch.Tensor, q_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """KL(softmax(p/tau) || softmax(q/tau)), the batch mean of the per-sample sums; the
    gradient reaches both arguments [code: FedMLB.py KD]."""
    return F.kl_div(F.log_softmax(q_logits / tau, dim=1), F.softmax(p_logits / tau, dim=1),
                    reduction="batchmean")


def mlb_loss(local_blocks, glob, glob_blocks, lambda1: float, lambda2: float, tau: float):
    """loss_fn(module, x, y): the main pathway through ``local_blocks`` and the module's
    classifier, and (when a weight is > 0) the L hybrid pathways through the frozen
    global model ``glob``'s ``glob_blocks[l+1:]`` and classifier."""
    levels = len(local_blocks)

    def loss(module, x, y):
        h, outs = x, []
        for block in local_blocks:
            h = block(h)
            outs.append(h)
        z_main = module.classifier(h)
        total = F.cross_entropy(z_main, y)
        if not (lambda1 or lambda2):
            return total
        ce_sum = kl_sum = 0.0
        for level, h_l in enumerate(outs):
            z = h_l
            for block in glob_blocks[level + 1:]:
                z = block(z)
            z = glob.classifier(z)
            if lambda1:
                ce_sum = ce_sum + F.cross_entropy(z, y)
            if lambda2:
                kl_sum = kl_sum + kd(z, z_main, tau)
        if lambda1:
            total = total + lambda1 * (ce_sum / levels)
        if lambda2:
            total = total + lambda2 * (kl_sum / levels)
        return total
    return loss


@register
class FedMLB(FedAvg):
    name = "fedmlb"
    paper = "Kim, Kim and Han 2022, arXiv:2207.06936"

    @dataclass(frozen=True)
    class Params(Params):
        lambda1: float = param(1.0, ">= 0", "weight lambda1 of the hybrid pathways' mean "
                               "cross-entropy (authors' code: lambda2 = 1)")
        lambda2: float = param(1.0, ">= 0", "weight lambda2 of the mean KL(hybrid || main) "
                               "(authors' code: lambda3 = 1)")
        tau: float = param(1.0, "> 0", "softmax temperature tau of the KL (authors' code: "
                           "temp = 1; no tau^2 factor)")

    def __init__(self, params=None):
        super().__init__(params)
        self._frozen = FrozenCopies()   # the worker's frozen global model

    def check_model(self, model_options):
        names = _candidates(model_options)
        if names and not set(names) & set(models_with_blocks()):
            raise _no_blocks(f"; got {' or '.join(map(repr, names))}")

    def local_update(self, task, payload, client_state, ctx):
        module = task.model.module
        blocks = module.blocks() if hasattr(module, "blocks") else None
        if blocks is None:
            raise _no_blocks(f"; got {type(module).__name__}, which declares none")
        x = payload["x"]
        p = self.params
        glob = glob_blocks = None
        if p.lambda1 or p.lambda2:
            glob, = self._frozen.of(task.model)
            glob.load(x)
            glob_blocks = glob.module.blocks()
        task.model.load(x)
        loss_fn = mlb_loss(blocks, glob.module if glob else None, glob_blocks,
                           p.lambda1, p.lambda2, p.tau)
        loss, steps = local_sgd.train(task, ctx, loss_fn=loss_fn)
        w = task.model.params
        return Upload(delta=w - x, num_samples=task.data.num_samples, loss=loss, steps=steps)
