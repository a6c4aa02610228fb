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

from dataclasses import dataclass, field

from ..errors import UsageError
from ..models.ssl import build_ssl_model
from . import local_sgd
from .base import Algorithm, Params, register
from .ssl_losses import on_projections, simclr_head


@dataclass(frozen=True)
class SSLParams(Params):
    """The projection head every self-supervised method here shares."""

    proj_dim: int = field(default=512, metadata={"doc": "projector output size (FedU^2: 512)"})
    proj_hidden: int = field(default=2048, metadata={"doc": "projector hidden width"})
    head_norm: str = field(default="layer", metadata={
        "doc": "normalisation inside the heads: layer | none (the papers' BatchNorm has "
               "running buffers, which fedmpi's models do not keep)"})

    def __post_init__(self):
        for name in ("proj_dim", "proj_hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"algorithm.{name}={value!r}: must be a positive integer")
        if self.head_norm not in ("layer", "none"):
            raise UsageError(f"algorithm.head_norm={self.head_norm!r}: must be 'layer' or 'none'")


@register
class FedSimCLR(Algorithm):
    name = "fedsimclr"
    paper = "Chen et al. 2020, arXiv:2002.05709 (federated: Zhuang et al. 2021)"
    supervised = False

    @dataclass(frozen=True)
    class Params(SSLParams):
        temperature: float = field(default=0.07, metadata={
            "doc": "NT-Xent temperature (EasyFL and FedU^2 code default)"})

        def __post_init__(self):
            super().__post_init__()
            if isinstance(self.temperature, bool) or not self.temperature > 0:
                raise UsageError(f"algorithm.temperature={self.temperature!r}: must be > 0")

    def build_model(self, build, name, in_channels, num_classes, image_size, options):
        p = self.params
        options = {k: v for k, v in options.items() if k != "proj_dim"}
        return build_ssl_model(name, in_channels, image_size, options, proj_dim=p.proj_dim,
                               hidden=p.proj_hidden, norm=p.head_norm)

    def local_update(self, task, payload, client_state, ctx):
        batches = task.data.view_batches(ctx.local_epochs, ctx.batch_size)
        return local_sgd.local_update(task, payload["x"], ctx,
                                      loss_fn=on_projections(simclr_head(self.params.temperature)), batches=batches)
