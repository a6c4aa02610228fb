"""FedSimCLR: SimCLR clients averaged by FedAvg (the FUSL baseline of FedU/FedEMA/FedU^2).

Chen et al., "A Simple Framework for Contrastive Learning of Visual Representations",
ICML 2020, https://arxiv.org/abs/2002.05709; federated as in Zhuang et al. (FedU, ICCV
2021) and Liao et al. (FedU^2, CVPR 2024).

Client: E epochs of SGD on NT-Xent(g(f(x1)), g(f(x2)); T) over two augmented views of
each batch (random resized crop, colour jitter, grayscale, flip), from the global
encoder f and projector g; upload Delta_i = w_K - x^t.
Server: x^{t+1} = x^t + eta_g * sum_i n_i Delta_i / sum_i n_i. Messages d down, d up.
The global model is scored by the kNN accuracy of its encoder (k = 200, T = 0.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Algorithm, register
from .mixins import SelfSupervised
from .params import Params, param
from .ssl_losses import simclr_head


@dataclass(frozen=True)
class SSLParams(Params):
    """The projection head every self-supervised method here shares."""

    proj_dim: int = param(512, ">= 1", "projector output size (FedU^2: 512)")
    proj_hidden: int = param(2048, ">= 1", "projector hidden width")
    head_norm: str = param("layer", ("layer", "none"),
                           "normalisation inside the heads: layer | none (the papers' BatchNorm "
                           "has running buffers, which fedmpi's models do not keep)")


@register
class FedSimCLR(SelfSupervised, Algorithm):
    name = "fedsimclr"
    paper = "Chen et al. 2020, arXiv:2002.05709 (federated: Zhuang et al. 2021)"

    @dataclass(frozen=True)
    class Params(SSLParams):
        temperature: float = param(0.07, "> 0", "NT-Xent temperature (EasyFL and FedU^2 code default)")

    def local_update(self, task, payload, client_state, ctx):
        return self.train_on_views(task, payload["x"], ctx, simclr_head(self.params.temperature))
