"""Local SGD on the flat model, the training loop every client update is built from.

One step is: zero the flat gradient, forward, loss, backward (autograd writes into the
flat gradient buffer), let the algorithm correct the gradient (proximal term, control
variates, momentum: one vector operation each), clip it to ``grad_clip``, and step
``w <- w - lr * (g + wd * w)``; with ``train.momentum``, torch.optim.SGD's heavy-ball or
Nesterov step on that, one vector operation more. ``lr`` follows the local schedule
(fedmpi.algorithms.schedule). A method whose gradient needs more than one backward
per step (SAM: a second pass at a perturbed point) replaces the first part with its own
``gradient_fn``. Weight decay sits outside the clipping, as in the authors'
code (FL-Simulator, FedACG). No torch.optim: the step is two vector operations, and the
first optimizer a process builds costs ~0.75 s of lazy imports (measured on a 2-core CPU).

``train.optimizer = "adam"`` (``adam_step``) replaces the last part with torch.optim.Adam's
step (single-tensor form, L2 weight decay added to the clipped gradient, torch's bias
correction) on the same flat buffers; its two moment buffers are made once per local
update, at zero, as an FL client that builds a new optimizer every round (FedU^2's code).
Methods whose formulas assume SGD steps refuse it at config time
(``Algorithm.local_sgd_only``).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F

from ..flat import FlatModel
from . import schedule
from .base import ClientTask, RoundContext, Upload

# correction(grads, params) modifies the flat gradient in place before clipping.
Correction = Callable[[torch.Tensor, torch.Tensor], None]
# gradient_fn(task, x, y, loss_fn) fills task.model.grads for one batch, leaves the
# parameters as it found them and returns the batch's loss (what train reports).
GradientFn = Callable[[ClientTask, torch.Tensor, torch.Tensor, Callable], torch.Tensor]

CLIP_EPS = 1e-6   # the clip factor's guard on ||g|| (torch.nn.utils.clip_grad_norm_'s)


def clip_factor(grads: torch.Tensor, bound: float, rows: bool = False) -> torch.Tensor:
    """min(1, bound / (||g|| + CLIP_EPS)) as a tensor (no host sync): one factor over all
    of ``grads``, or with ``rows`` one per row [a, 1], each client of a group clipped to
    its own norm."""
    if rows:
        return norm_clip_factor(torch.linalg.vector_norm(grads, dim=1, keepdim=True), bound)
    return norm_clip_factor(torch.linalg.vector_norm(grads), bound)


def norm_clip_factor(norm: torch.Tensor, bound: float) -> torch.Tensor:
    """``clip_factor`` of a norm already computed (a group's plain step sums its own)."""
    return torch.clamp(bound / (norm + CLIP_EPS), max=1.0)


def host_clip_factor(grads: torch.Tensor, bound: float) -> float:
    """``clip_factor`` read as a host float, for the CPU path, where reading it costs no
    wait and a scalar folds into an update's alpha (one pass over the buffer fewer)."""
    norm = float(torch.linalg.vector_norm(grads))   # host sync: CPU only, no wait
    return min(1.0, bound / (norm + CLIP_EPS))


def rows_of(vector: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    """The part of ``vector`` a correction applies to ``grads``: the first n values of a
    vector over the flat state (parameters, then float buffers; n = the parameters'
    count), or of a client group's (fedmpi.algorithms.group_sgd) per-client stack [G, d]
    the rows of the clients in ``grads`` [a, n]. One correction serves both paths."""
    n = grads.shape[-1]
    if vector.dim() == 1:
        return vector[:n]
    return vector[:grads.shape[0], :n]


def sgd_step(params: torch.Tensor, grads: torch.Tensor, lr: float, weight_decay: float,
             grad_clip: float, velocity: torch.Tensor | None = None, momentum: float = 0.0,
             nesterov: bool = False) -> None:
    """w <- w - lr (clip(g) + wd w), in two passes over the buffer (norm, fused update).

    With a ``velocity`` buffer: torch.optim.SGD's momentum (dampening 0) on what the plain
    step would apply, v <- momentum v + clip(g) + wd w, then w <- w - lr v, or with
    Nesterov w <- w - lr (clip(g) + wd w + momentum v).

    On the CPU the clip factor is read as a host scalar and folded into the update's
    alpha; on a GPU it stays a tensor so the loop never waits for the device.
    """
    scale = 1.0
    if grad_clip > 0:
        if grads.device.type == "cpu":
            scale = host_clip_factor(grads, grad_clip)  # host sync: CPU only, no wait
        else:
            grads.mul_(clip_factor(grads, grad_clip))
    if velocity is not None:
        velocity.mul_(momentum).add_(grads, alpha=scale)
        if weight_decay:
            velocity.add_(params, alpha=weight_decay)
        if not nesterov:
            params.add_(velocity, alpha=-lr)
            return
    if weight_decay:
        params.mul_(1.0 - lr * weight_decay)
    params.add_(grads, alpha=-lr * scale)
    if velocity is not None:   # Nesterov's look-ahead term
        params.add_(velocity, alpha=-lr * momentum)


class AdamMoments:
    """Adam's state over the flat gradient, for one local update: the first and second
    moments (zero at the start), the step count t (a host integer, so the bias
    corrections are host floats and a GPU never waits), and a scratch buffer for the
    denominator (no allocation per step)."""

    def __init__(self, like: torch.Tensor):
        self.exp_avg = torch.zeros_like(like)
        self.exp_avg_sq = torch.zeros_like(like)
        self.denom = torch.empty_like(like)
        self.step = 0


def adam_step(params: torch.Tensor, grads: torch.Tensor, lr: float, weight_decay: float,
              grad_clip: float, moments: AdamMoments, betas: tuple[float, float] = (0.9, 0.999),
              eps: float = 1e-8) -> None:
    """torch.optim.Adam's step (amsgrad off, L2 weight decay, torch 2.x single-tensor
    order of operations) on g = clip(grads) + wd w, the weight decay after the clipping
    as in ``sgd_step``:

        m <- m + (1 - b1)(g - m),  v <- b2 v + (1 - b2) g^2,
        w <- w - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps).

    ``grads`` is overwritten with g (the next step zeroes it anyway)."""
    if grad_clip > 0:
        if grads.device.type == "cpu":
            scale = host_clip_factor(grads, grad_clip)  # host sync: CPU only, no wait
            if scale < 1.0:
                grads.mul_(scale)
        else:
            grads.mul_(clip_factor(grads, grad_clip))
    if weight_decay:
        grads.add_(params, alpha=weight_decay)
    beta1, beta2 = betas
    moments.step += 1
    t = float(moments.step)   # torch reads its step tensor as a float
    moments.exp_avg.lerp_(grads, 1 - beta1)
    moments.exp_avg_sq.mul_(beta2).addcmul_(grads, grads, value=1 - beta2)
    step_size = lr / (1 - beta1 ** t)
    bias_correction2_sqrt = (1 - beta2 ** t) ** 0.5
    denom = torch.sqrt(moments.exp_avg_sq, out=moments.denom)
    denom.div_(bias_correction2_sqrt).add_(eps)
    params.addcdiv_(moments.exp_avg, denom, value=-step_size)


def cross_entropy(module, x, y) -> torch.Tensor:
    return F.cross_entropy(module(x), y)


def autocast(loss_fn: Callable, task: ClientTask) -> Callable:
    """``loss_fn`` with its forward and loss under autocast to ``task.autocast`` (bf16);
    the backward that follows runs outside, as autocast asks. Unchanged without one."""
    if task.autocast is None:
        return loss_fn
    device_type = torch.device(task.device).type

    def reduced(module, x, y):
        with torch.autocast(device_type, dtype=task.autocast):
            return loss_fn(module, x, y).float()
    return reduced


def loss_gradient(task: ClientTask, x, y, loss_fn) -> torch.Tensor:
    """The default ``gradient_fn``: the loss's gradient at the current parameters."""
    task.model.zero_grad()
    loss = loss_fn(task.model.module, x, y)
    loss.backward()
    return loss


def train(task: ClientTask, ctx: RoundContext, correction: Correction | None = None,
          loss_fn: Callable | None = None,
          gradient_fn: GradientFn | None = None, batches=None,
          trainable: tuple[int, int] | None = None) -> tuple[float, int]:
    """Run E local epochs from the model's current parameters (``batches``: another
    source of (x, y) than ``task.data.batches``, e.g. self-supervised view pairs).
    ``trainable``: the run of parameter coordinates the steps move (FedRep's head or
    body, FedBABU's body); the others are frozen (no gradient, no weight decay, and no
    backward through layers below every trainable one).

    Returns (mean training loss over steps, number of steps). The loss is accumulated on
    the device and read once, so a GPU never synchronises inside the loop.
    """
    flat, module = task.model, task.model.module
    loss_fn = autocast(loss_fn or task.loss_fn or cross_entropy, task)
    if task.private is not None:   # DP-SGD: Poisson batches, clipped and noised gradients
        batches, gradient_fn = task.private.batches(task, ctx), task.private.gradient
    gradient_fn = gradient_fn or loss_gradient
    module.train()
    total = torch.zeros((), device=flat.params.device)
    steps = 0
    if batches is None:
        batches = task.data.batches(ctx.local_epochs, ctx.batch_size)
    lrs = step_lrs(task, ctx)
    lo, hi = trainable or (0, flat.num_params)
    params, grads = flat.params[lo:hi], flat.grads[lo:hi]
    velocity = torch.zeros_like(grads) if ctx.momentum else None
    adam = AdamMoments(grads) if ctx.optimizer == "adam" else None
    with frozen_outside(flat, trainable):
        for x, y in batches:
            loss = gradient_fn(task, x, y, loss_fn)
            if correction is not None:
                correction(flat.grads, flat.params[:flat.num_params])
            lr = ctx.lr if lrs is None else lrs[min(steps, len(lrs) - 1)]
            if adam is None:
                sgd_step(params, grads, lr, ctx.weight_decay, ctx.grad_clip, velocity,
                         ctx.momentum, ctx.nesterov)
            else:
                adam_step(params, grads, lr, ctx.weight_decay, ctx.grad_clip, adam,
                          ctx.adam_betas, ctx.adam_eps)
            total += loss.detach()
            steps += 1
    return float(total) / max(steps, 1), steps  # host sync: once per client, its loss


@contextmanager
def frozen_outside(flat: FlatModel, trainable: tuple[int, int] | None):
    """The parameters outside the run ``trainable`` without gradients while in the block
    (autograd then neither computes nor writes theirs); nothing without a run."""
    if trainable is None:
        yield
        return
    lo, hi = trainable
    frozen = [p for slot, p in zip(flat.layout, flat.module.parameters())
              if p.requires_grad and not lo <= slot.offset < hi]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


def step_lrs(task: ClientTask, ctx: RoundContext) -> list[float] | None:
    """The learning rate of each of the client's local steps; None when all are ctx.lr."""
    if schedule.constant_within_round(ctx):
        return None
    per_epoch = task.data.num_steps(1, ctx.batch_size)
    total = task.data.num_steps(ctx.local_epochs, ctx.batch_size)
    return [ctx.lr * schedule.local_factor(ctx, k, per_epoch, total) for k in range(max(total, 1))]


def local_update(task: ClientTask, x: torch.Tensor, ctx: RoundContext,
                 correction: Correction | None = None,
                 gradient_fn: GradientFn | None = None, loss_fn: Callable | None = None,
                 batches=None) -> Upload:
    """Load x, train, and return Delta = x_K - x (the common case of every method)."""
    task.model.load(x)
    loss, steps = train(task, ctx, correction, loss_fn, gradient_fn, batches)
    delta = task.model.params - x
    return Upload(delta=delta, num_samples=task.data.num_samples, loss=loss, steps=steps)


def frozen_copy(flat: FlatModel) -> FlatModel:
    """A second flat model with ``flat``'s architecture and storage order, in eval mode and
    without gradients: the fixed reference models of MOON (global and previous) and
    FedMRUR (the received global model G), loaded with ``load``."""
    twin = FlatModel(copy.deepcopy(flat.module), flat.params.device, dtype=flat.params.dtype,
                     channels_last=flat.channels_last)
    twin.module.eval().requires_grad_(False)
    return twin


class FrozenCopies:
    """``count`` frozen copies of a worker's flat model (``frozen_copy``), made on first use
    and again only for another flat model: the fixed reference models a client loss reads
    (MOON's global and previous models, the global model of FedNTD, FedMLB and FedX)."""

    def __init__(self, count: int = 1):
        self.count = count
        self._flat, self._copies = None, ()

    def of(self, flat: FlatModel) -> tuple[FlatModel, ...]:
        if self._flat is not flat:
            self._flat, self._copies = flat, tuple(frozen_copy(flat) for _ in range(self.count))
        return self._copies

