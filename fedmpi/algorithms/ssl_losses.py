"""Self-supervised losses of the FUSL clients and BYOL's EMA target update (pure).

- SimCLR, Chen et al., "A Simple Framework for Contrastive Learning of Visual
  Representations", ICML 2020, https://arxiv.org/abs/2002.05709: NT-Xent over the 2B
  views, z normalised, similarities sim_ij = z_i . z_j / T, self-similarity masked out,
  positive of view i = the other view of the same image; mean over the 2B anchors.
  (FedU2's nt_xent_loss zeroes sim_ii instead of masking it; fedmpi
  takes the standard masked form.)
- BYOL, Grill et al., "Bootstrap Your Own Latent", NeurIPS 2020,
  https://arxiv.org/abs/2006.07733: mean_i [2 - 2cos(p1_i, sg t2_i) + 2 - 2cos(p2_i, sg t1_i)];
  target xi <- tau xi + (1 - tau) theta after every step.
- SimSiam, Chen & He, "Exploring Simple Siamese Representation Learning", CVPR 2021,
  https://arxiv.org/abs/2011.10566: -(cos(p1, sg z2) + cos(p2, sg z1)) / 2, batch means.

sg = stop-gradient (detach). Cosines normalise with F.normalize (eps 1e-12 on the norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedmpi.errors import UsageError


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float = 0.07) -> torch.Tensor:
    """SimCLR's NT-Xent of two [B, D] views (normalised here), mean over 2B anchors."""
    if temperature <= 0:
        raise UsageError(f"temperature={temperature}: must be > 0")
    b = z1.shape[0]
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    logits = (z @ z.T) / temperature
    logits = logits.masked_fill(torch.eye(2 * b, dtype=torch.bool, device=z.device), float("-inf"))
    partner = torch.arange(2 * b, device=z.device).roll(b)  # b..2b-1, 0..b-1; made on the device
    return F.cross_entropy(logits, partner)


def _cosine(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Row-wise cos(p_i, sg t_i), [B]."""
    return (F.normalize(p, dim=1) * F.normalize(t.detach(), dim=1)).sum(dim=1)


def byol_loss(p1: torch.Tensor, p2: torch.Tensor, t1: torch.Tensor,
              t2: torch.Tensor) -> torch.Tensor:
    """mean_i [2 - 2cos(p1_i, sg t2_i)] + mean_i [2 - 2cos(p2_i, sg t1_i)], in [0, 8]."""
    return (4 - 2 * _cosine(p1, t2) - 2 * _cosine(p2, t1)).mean()


def simsiam_loss(p1: torch.Tensor, p2: torch.Tensor, z1: torch.Tensor,
                 z2: torch.Tensor) -> torch.Tensor:
    """-(mean cos(p1, sg z2) + mean cos(p2, sg z1)) / 2, in [-1, 1]."""
    return -(_cosine(p1, z2).mean() + _cosine(p2, z1).mean()) / 2


def on_projections(head):
    """A local-SGD loss_fn over ((view1, view2), y) batches from a ``head(module, z, both)``
    loss on the projections z = g(f(both)) of both views, stacked (view 1 first) in one
    forward; the FUSL methods differ only in the head."""
    def loss(module, views, y) -> torch.Tensor:
        both = torch.cat(views)
        return head(module, module.project(both), both)
    return loss


def halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(view 1 rows, view 2 rows) of a stacked two-view batch."""
    b = t.shape[0] // 2
    return t[:b], t[b:]


def simclr_head(temperature: float):
    return lambda module, z, both: nt_xent(*halves(z), temperature)


def simsiam_head(module, z, both) -> torch.Tensor:
    p1, p2 = halves(module.predict(z))
    return simsiam_loss(p1, p2, *halves(z))


def byol_head(target_module):
    """BYOL against ``target_module`` (no gradient through the target)."""
    def head(module, z, both) -> torch.Tensor:
        p1, p2 = halves(module.predict(z))
        with torch.no_grad():
            t1, t2 = halves(target_module.project(both))
        return byol_loss(p1, p2, t1, t2)
    return head


@torch.no_grad()
def ema_update(target_params, online_params, tau: float) -> None:
    """xi <- tau xi + (1 - tau) theta, in place; tensors or equally long iterables of them.

    Flat buffers work directly: an SSLNet's encoder and projector are a prefix of its flat
    parameters, laid out exactly as its ``target_copy()`` (see fedmpi.models.ssl).
    """
    if not 0 <= tau <= 1:
        raise UsageError(f"ema tau={tau}: must be in [0, 1]")
    targets = [target_params] if isinstance(target_params, torch.Tensor) else list(target_params)
    onlines = [online_params] if isinstance(online_params, torch.Tensor) else list(online_params)
    if len(targets) != len(onlines):
        raise ValueError(f"ema_update: {len(targets)} target tensors but {len(onlines)} online")
    for xi, theta in zip(targets, onlines):
        xi.mul_(tau).add_(theta, alpha=1 - tau)

