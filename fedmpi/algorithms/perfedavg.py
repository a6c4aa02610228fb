"""Per-FedAvg: Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach.

Fallah, Mokhtari, Ozdaglar, NeurIPS 2020, https://arxiv.org/abs/2002.07948

FedAvg of a MAML objective: each local step takes two batches D, D' of the client's
stream (three with the Hessian-free variant) and moves w by the gradient of
f(w - alpha grad f(w; D); D'):

- ``variant = "fo"`` (first order): w <- w - lr grad f(w_tmp; D'), w_tmp = w - alpha
  grad f(w; D);
- ``"hf"`` (Hessian-free): w <- w - lr (I - alpha H(w; D'')) grad f(w_tmp; D'), the
  Hessian-vector product by double back-propagation on a third batch.

A local update of E epochs therefore takes E n / (2B) steps (E n / (3B) for "hf"). The
upload is Delta_i = w_{i,K} - x^t and the server is FedAvg's. Personalisation is the
meta-model's adaptation on the client's data at evaluation: fine-tuning
(``eval.client_finetune_epochs``; the paper takes one step of size alpha). Messages d
down, d up; no client state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import grad, grad_and_value, vmap

from . import group_sgd, local_sgd
from .base import register
from .fedavg import FedAvg
from .params import Params, param


@register
class PerFedAvg(FedAvg):
    name = "perfedavg"
    paper = "Fallah et al. 2020, arXiv:2002.07948"
    local_sgd_only = "its step is the meta-gradient's (the inner step is plain SGD)"

    @dataclass(frozen=True)
    class Params(Params):
        alpha: float = param(0.01, "> 0", "the inner (adaptation) step size alpha")
        variant: str = param("fo", ("fo", "hf"), "'fo': first order; 'hf': Hessian-free")

    def local_update(self, task, payload, client_state, ctx):
        x, p = payload["x"], self.params
        group = 3 if p.variant == "hf" else 2

        def gradient(task, xb, yb, loss_fn):
            return meta_gradient(task, xb, yb, loss_fn, p.alpha, p.variant == "hf")

        def grouped(batches):   # (D, D'[, D'']) from consecutive batches of the stream
            it = iter(batches)
            while True:
                part = [next(it, None) for _ in range(group)]
                if part[-1] is None:
                    return
                yield tuple(b[0] for b in part), tuple(b[1] for b in part)

        batches = grouped(task.data.batches(ctx.local_epochs, ctx.batch_size))
        return local_sgd.local_update(task, x, ctx, gradient_fn=gradient, batches=batches)

    def local_update_group(self, tasks, payload, client_states, ctx):
        p = self.params
        return group_sgd.local_update(tasks, payload["x"], ctx, take=3 if p.variant == "hf" else 2,
                                      gradient=group_meta_gradient(p.alpha, p.variant == "hf"))


def meta_gradient(task, xb, yb, loss_fn, alpha: float, hessian: bool) -> torch.Tensor:
    """Fill ``task.model.grads`` with the meta-gradient at the current w for the batches
    (D, D'[, D'']): grad f(w_tmp; D'), w_tmp = w - alpha grad f(w; D), times (I - alpha
    H(w; D'')) with ``hessian``; the parameters are left as they were. Returns the loss
    at w_tmp on D'."""
    flat = task.model
    n, w = flat.num_params, flat.params.clone()
    local_sgd.loss_gradient(task, xb[0], yb[0], loss_fn)
    flat.params[:n].sub_(flat.grads, alpha=alpha)                       # w_tmp
    loss = local_sgd.loss_gradient(task, xb[1], yb[1], loss_fn)          # grad f(w_tmp; D')
    flat.params.copy_(w)
    if hessian:   # H v by double back-propagation, in the flat storage order
        outer, params = flat.grads.clone(), list(flat.module.parameters())
        flat.zero_grad()
        first = torch.autograd.grad(loss_fn(flat.module, xb[2], yb[2]), params,
                                    create_graph=True)
        dot = sum((g * flat._view(outer, s)).sum() for g, s in zip(first, flat.layout))
        for s, h in zip(flat.layout, torch.autograd.grad(dot, params)):
            flat._view(flat.grads, s).copy_(h)
        flat.grads.mul_(-alpha).add_(outer)
    return loss


def group_meta_gradient(alpha: float, hessian: bool):
    """``meta_gradient`` for a client group: a ``group_sgd.train`` hook (``take`` 2, or 3
    with ``hessian``) leaving every active row's meta-gradient in ``grad_rows``; the rows'
    parameters restored by copy. H v by reverse-over-reverse differentiation of each row's
    loss on D'' under vmap, as the sequential path's double back-propagation."""
    hvp = None

    def gradient(model, a, xs, ys, weights, autocast):
        nonlocal hvp
        params = model.rows[:a, :model.flat.num_params]
        saved = params.clone()
        _, first = model.gradient(a, xs[0], ys[0], weights[0], autocast)
        params.sub_(first, alpha=alpha)                                      # w_tmp
        losses, outer = model.gradient(a, xs[1], ys[1], weights[1], autocast)
        params.copy_(saved)
        if not hessian:
            return losses, outer
        if hvp is None:   # H v = the gradient of (the gradient . v)
            def dot(p, v, x, y, w=None):
                return sum((g * v[k]).sum() for k, g in grad(model.loss)(p, x, y, w).items())
            hvp = vmap(grad_and_value(dot))
        outer = outer.clone()
        args = (model.named(outer), xs[2], ys[2]) + \
            ((weights[2],) if weights[2] is not None else ())
        _, pieces = model.vmapped(hvp, a, args, autocast)
        return losses, model.concatenated(a, pieces).mul_(-alpha).add_(outer)
    return gradient
