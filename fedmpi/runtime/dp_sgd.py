"""Sample-level (record-level) differential privacy inside the clients: DP-SGD (Abadi et
al., "Deep Learning with Differential Privacy", CCS 2016) as every local step of a client
(``privacy.mechanism = "sample"``), for cross-silo users whose unit of privacy is a record.

Each local step of client i:

1. a Poisson batch: each of its n_i samples independently with probability
   q_i = min(1, B / n_i), from its keyed stream (``ClientData.poisson_batches``); the
   client takes E ceil(n_i / B) steps a round, as without DP;
2. each sample's gradient clipped to L2 norm C (``privacy.clip``) and summed: for a
   model of Linear and Conv2d layers without forming the per-sample gradients
   (``dp_ghost``: the ghost norm and book-keeping), else as the rows of a client group of
   one sample each (``group_sgd.GroupModel``: torch.func's vmap);
3. their sum plus N(0, sigma^2 C^2) per coordinate from the stream keyed by (seed, round,
   client, phase, step), divided by the expected batch size q_i n_i (never the realised
   one), is the step's gradient. ``train.grad_clip`` is off for these steps (the noised
   gradient is not clipped again); momentum, weight decay and the method's
   data-independent corrections (FedProx, SCAFFOLD, ...) follow as post-processing.

A client's round is ``SelfComposedDpEvent(PoissonSampledDpEvent(q_i, Gaussian(sigma)),
E ceil(n_i / B))``, and its rounds compose; the smallest client spends the most (epsilon
grows like E B / n_i), so ``/rounds/epsilon`` is the smallest client's after t rounds,
had it taken part in all of them (fedmpi.privacy.sample_epsilon).
"""

from __future__ import annotations

import torch

from ..algorithms.group_sgd import group_model
from ..algorithms.local_sgd import CLIP_EPS
from .dp_ghost import ghost_of
from .rng import torch_generator


class PrivateSteps:
    """One client's DP-SGD steps in one round (``ClientTask.private``)."""

    def __init__(self, config, key: tuple[int, int, int]):
        p = config.privacy
        self.clip, self.std = float(p.clip), float(p.noise_multiplier) * float(p.clip)
        self.noise = torch_generator(config.seed, "dp-sgd-noise", *key)
        self.expected = 1.0

    def batches(self, task, ctx):
        n, b = task.data.num_samples, ctx.batch_size
        rate = min(1.0, b / n) if n else 1.0
        self.expected = rate * n
        return task.data.poisson_batches(task.data.num_steps(ctx.local_epochs, b), rate)

    def gradient(self, task, x, y, loss_fn=None):
        """Writes the private gradient into the flat model's gradient; returns the batch's
        mean loss (0 for an empty batch)."""
        flat = task.model
        grads = flat.grads
        count = len(y)
        ghost = ghost_of(flat) if count else None
        losses = ghost.clipped_sum(x, y, self.clip, task.autocast) if ghost else None
        if losses is not None:
            loss = losses.mean()
        elif count:
            model = group_model(flat)
            model.buffer(count).copy_(flat.params.detach().expand(count, -1))
            losses, rows = model.gradient(count, x.unsqueeze(1), y.unsqueeze(1), None,
                                          task.autocast)
            norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
            rows.mul_(torch.clamp(self.clip / (norms + CLIP_EPS), max=1.0))   # in the buffer
            torch.sum(rows, dim=0, out=grads)
            loss = losses.mean()
        else:
            grads.zero_()
            loss = torch.zeros((), device=grads.device)
        if self.std:
            noise = torch.randn(grads.numel(), generator=self.noise)
            grads.add_(noise.to(device=grads.device, dtype=grads.dtype), alpha=self.std)
        grads.div_(self.expected)
        return loss
