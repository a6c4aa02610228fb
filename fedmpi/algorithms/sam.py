"""Sharpness-aware minimisation's gradient, as a ``gradient_fn`` for ``local_sgd.train``.

Foret et al., "Sharpness-Aware Minimization for Efficiently Improving Generalization",
ICLR 2021, https://arxiv.org/abs/2010.01412; in FL as FedSAM/MoFedSAM (Qu et al. 2022)
and inside FedMRUR:

    g1 = grad f(w);  e = rho g1 / (||g1||_2 + 1e-7)  (one norm over all parameters);
    g~ = grad f(w + e) on the SAME batch;  restore w;  the step then uses g~.

The flat gradient holds g~ afterwards, so clipping, momentum mixing and the SGD step of
``local_sgd.train`` apply to it unchanged [code: FL-Simulator optimizer/ESAM.py].
"""

from __future__ import annotations

import torch

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
