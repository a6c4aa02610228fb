"""Sharpness-aware minimisation's gradient, as a ``gradient_fn`` for ``local_sgd.train``
and as a client group's ``gradient`` hook for ``group_sgd.train``.

Foret et al., "Sharpness-Aware Minimization for Efficiently Improving Generalization",
ICLR 2021, https://arxiv.org/abs/2010.01412; in FL as FedSAM/MoFedSAM (Qu et al. 2022)
and inside FedMRUR:

    g1 = grad f(w);  e = rho g1 / (||g1||_2 + 1e-7)  (one norm over all parameters);
    g~ = grad f(w + e) on the SAME batch;  restore w;  the step then uses g~.

The flat gradient holds g~ afterwards, so clipping, momentum mixing and the SGD step of
``local_sgd.train`` apply to it unchanged [code: FL-Simulator optimizer/ESAM.py]. In a
client group every row is perturbed by its own gradient's norm.
"""

from __future__ import annotations

import torch

from .group_sgd import GroupGradient
from .local_sgd import GradientFn, loss_gradient

EPS = 1e-7  # FL-Simulator ESAM's guard on ||g1||


def sam_gradient(rho: float) -> GradientFn:
    """A ``gradient_fn`` leaving g~ in the flat gradient; returns the loss at w."""
    def gradient(task, x, y, loss_fn) -> torch.Tensor:
        loss = loss_gradient(task, x, y, loss_fn)
        if rho == 0:  # w + e = w: the second pass would repeat the first
            return loss
        perturbed_gradient(task, x, y, loss_fn, rho)
        return loss
    return gradient


def perturbed_gradient(task, x, y, loss_fn, rho: float) -> None:
    """Given g1 in the flat gradient: replace it by the gradient at w + e, restore w."""
    flat = task.model
    w = flat.params[:flat.num_params]
    norm = torch.linalg.vector_norm(flat.grads)
    saved = w.clone()  # restoring by copy keeps w bit-exact (w + e - e need not be w)
    if w.device.type == "cpu":
        w.add_(flat.grads, alpha=rho / (float(norm) + EPS))  # host sync: CPU only, no wait
    else:  # no host sync inside the loop on a GPU
        w.add_(flat.grads * (rho / (norm + EPS)))
    loss_gradient(task, x, y, loss_fn)
    w.copy_(saved)


def group_gradient(rho: float) -> GroupGradient | None:
    """``sam_gradient`` for a client group: a ``group_sgd.train`` hook leaving each row's
    g~ in ``grad_rows``; None when rho = 0 (w + e = w: the default gradient, and the
    group keeps its plain step)."""
    if rho == 0:
        return None

    def gradient(model, a: int, x, y, weights, autocast):
        losses, grads = model.gradient(a, x, y, weights, autocast)
        group_perturbed_gradient(model, a, x, y, weights, autocast, rho)
        return losses, grads
    return gradient


def group_perturbed_gradient(model, a: int, x, y, weights, autocast, rho: float) -> None:
    """``perturbed_gradient`` for the first a rows of a GroupModel: given g in
    ``grad_rows[:a]``, replace it by the gradient at w + e, e = rho g / (||g|| + EPS)
    with each row's own norm; w restored by copy (bit-exact)."""
    params, grads = model.rows[:a, :model.flat.num_params], model.grad_rows[:a]
    saved = params.clone()
    norms = torch.linalg.vector_norm(grads, dim=1, keepdim=True)
    params.add_(grads * (rho / (norms + EPS)))
    model.gradient(a, x, y, weights, autocast)
    params.copy_(saved)
