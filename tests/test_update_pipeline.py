"""The update pipeline's shared pieces (issue 48): the clip factor written once for every
step (``local_sgd.clip_factor``), and a client group's gradient hook
(``group_sgd.train``'s ``gradient``), the group form of ``local_sgd.train``'s
``gradient_fn`` through which SAM, and later DP-SGD, plug in."""

import pytest
import torch

from fedmpi.algorithms import ClientTask, RoundContext, group_sgd, local_sgd, sam
from fedmpi.algorithms.base import ClientData
from fedmpi.flat import FlatModel
from fedmpi.models import build_model


class Samples(ClientData):
    def __init__(self, n, key):
        g = torch.Generator().manual_seed(key)
        self.x = torch.randn(n, 1, 16, 16, generator=g)
        self.y, self.num_samples = torch.randint(0, 4, (n,), generator=g), n

    def batches(self, epochs, batch_size):
        for _ in range(epochs):
            for s in range(0, self.num_samples, batch_size):
                yield self.x[s:s + batch_size], self.y[s:s + batch_size]


def test_clip_factor_is_the_closed_form():
    g = torch.tensor([[3.0, 4.0], [0.3, 0.4]], dtype=torch.float64)
    rows = local_sgd.clip_factor(g, 1.0, rows=True)
    assert rows.shape == (2, 1)
    assert rows[:, 0].tolist() == pytest.approx([1.0 / (5.0 + 1e-6), 1.0], rel=1e-12)
    whole = 1.0 / (25.25 ** 0.5 + 1e-6)
    assert float(local_sgd.clip_factor(g, 1.0)) == pytest.approx(whole, rel=1e-12)
    assert local_sgd.host_clip_factor(g, 1.0) == pytest.approx(whole, rel=1e-12)
    assert local_sgd.host_clip_factor(g, 10.0) == 1.0
    assert local_sgd.CLIP_EPS == 1e-6


def test_a_group_gradient_hook_is_called_and_its_gradient_is_the_step():
    """Under plain SGD a hook that zeroes the gradient leaves every client where it
    started, while the default gradient moves them; the hook sees each step's active
    rows (clients of 9 and 5 samples, batches of 4: 3 and 2 steps an epoch)."""
    torch.manual_seed(0)
    flat = FlatModel(build_model("2nn", 1, 4, 16, hidden=[12]), "cpu")
    tasks = [ClientTask(client=i, data=Samples(n, i), model=flat, device=torch.device("cpu"))
             for i, n in enumerate((9, 5))]
    ctx = RoundContext(round=1, phase="train", lr=0.05, lr_prev=0.05, global_lr=1.0,
                       weight_decay=0.0, grad_clip=0.0, local_epochs=1, batch_size=4,
                       num_clients=2, participants=(0, 1), seed=0)
    x = flat.params.detach().clone()
    seen = []

    def zero(model, a, xb, yb, weights, autocast):
        seen.append(a)
        losses, grads = model.gradient(a, xb, yb, weights, autocast)
        return losses, grads.zero_()

    held = group_sgd.local_update(tasks, x, ctx, gradient=zero)
    assert seen == [2, 2, 1]
    assert all(torch.equal(u.delta, torch.zeros_like(u.delta)) for u in held)
    assert all(u.loss > 0 for u in held)
    moved = group_sgd.local_update(tasks, x, ctx)
    assert all(u.delta.abs().max() > 0 for u in moved)
    assert sam.group_gradient(0.0) is None   # rho = 0 keeps a group's plain step
