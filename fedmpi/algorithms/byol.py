"""BYOL client pieces shared by FedBYOL, FedU and FedEMA (pure, no MPI).

Grill et al., "Bootstrap Your Own Latent", NeurIPS 2020, https://arxiv.org/abs/2006.07733;
federated by Zhuang et al. (FedU, ICCV 2021, https://arxiv.org/abs/2108.06492; FedEMA,
ICLR 2022, https://arxiv.org/abs/2204.04385).

Online network theta = encoder f, projector g, predictor q; target xi = encoder + projector,
no gradient. Per step on views x1, x2:  z_v = g(f(x_v)), p_v = q(z_v), t_v = g_xi(f_xi(x_v)),

    L = mean_i [2 - 2cos(p1_i, sg t2_i)] + mean_i [2 - 2cos(p2_i, sg t1_i)],

SGD on theta, then  xi <- tau xi + (1 - tau) theta_[f, g]  (tau = 0.99, after every step).
The SSLNet's flat buffer is [encoder, projector, predictor] (fedmpi.models.ssl), so xi is the
flat prefix of length d - |q| and the EMA is one vector operation.

Divergence (FedU's DAPU, FedEMA's mu_k; EasyFL client.py _calculate_divergence): the mean
over the encoder's convolution weights of ||W_end - W_start||_2. Models without
convolutions (an MLP backbone) fall back to every >= 2-D encoder weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UsageError
from ..flat import FlatModel
from . import local_sgd
from .fedsimsiam import PredictorParams
from .params import param
from .ssl_losses import byol_head, ema_update, on_projections


@dataclass(frozen=True)
class BYOLParams(PredictorParams):
    """PredictorParams + the target's EMA rate."""

    tau_ema: float = param(0.99, "[0, 1]",
                           "target EMA rate: xi <- tau xi + (1 - tau) theta after every local step")


def predictor_size(params: PredictorParams) -> int:
    """|q| of mlp_head(proj_dim, pred_hidden, proj_dim): two Linears (+ LayerNorm)."""
    p, h = params.proj_dim, params.pred_hidden
    return 2 * p * h + h + p + (2 * h if params.head_norm == "layer" else 0)


def target_model(online: FlatModel) -> FlatModel:
    """A flat model over ``online.module.target_copy()``, in the same storage order, so
    its flat vector is the prefix [encoder, projector] of the online one."""
    target = FlatModel(online.module.target_copy(), online.params.device,
                       dtype=online.params.dtype, channels_last=online.channels_last)
    target.module.requires_grad_(False)
    return target


def ema_after_each_step(batches, target: torch.Tensor, online: torch.Tensor, tau: float):
    """Yield ``batches``; each time the trainer asks for the next one (its step is done,
    including after the last) apply xi <- tau xi + (1 - tau) theta[:len(xi)]."""
    n = target.numel()
    for batch in batches:
        yield batch
        ema_update(target, online[:n], tau)


def byol_train(task, ctx, target: FlatModel, tau: float, head=byol_head) -> tuple[float, int]:
    """E local epochs of BYOL from the loaded online model, updating ``target`` in place;
    ``head(target_module)`` is the loss head on the projections (FedU^2 adds FUR to it)."""
    target.module.train(True)   # same mode as the online network (no running statistics)
    batches = task.data.view_batches(ctx.local_epochs, ctx.batch_size)
    batches = ema_after_each_step(batches, target.params, task.model.params, tau)
    return local_sgd.train(task, ctx, loss_fn=on_projections(head(target.module)), batches=batches)


def divergence_slots(flat: FlatModel) -> list:
    """The encoder's convolution weights (else every >= 2-D encoder weight)."""
    encoder = [s for s in flat.layout[:len(list(flat.module.parameters()))]
               if s.name.startswith("encoder.") and s.name.endswith("weight")]
    return [s for s in encoder if len(s.shape) == 4] or [s for s in encoder if len(s.shape) >= 2]


def encoder_divergence(flat: FlatModel, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """delta = mean over divergence_slots of ||W_end - W_start||_2, a 1-element tensor
    (a slot's storage order does not change its norm)."""
    slots = divergence_slots(flat)
    if not slots:
        raise UsageError("model: the encoder has no weight matrices to measure divergence on")
    norms = [torch.linalg.vector_norm(end[s.offset:s.offset + s.numel]
                                      - start[s.offset:s.offset + s.numel]) for s in slots]
    return torch.stack(norms).mean().reshape(1)
