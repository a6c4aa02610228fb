"""The local optimizer and the proximal correction, against hand-computed numbers."""

import torch

from fedmpi.algorithms.fedprox import proximal
from fedmpi.algorithms.local_sgd import sgd_step


def test_plain_step():
    w, g = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    sgd_step(w, g, lr=0.1, weight_decay=0.0, grad_clip=0.0)
    assert torch.allclose(w, torch.tensor([0.95, 2.1]))


def test_weight_decay_outside_clipping():
    # ||g|| = 5 > clip 1: g -> (0.6, 0.8); then w <- w - lr (g_clipped + wd w)
    w, g = torch.tensor([1.0, -1.0]), torch.tensor([3.0, 4.0])
    sgd_step(w, g, lr=0.5, weight_decay=0.1, grad_clip=1.0)
    expected = torch.tensor([1.0 - 0.5 * (0.6 + 0.1), -1.0 - 0.5 * (0.8 - 0.1)])
    assert torch.allclose(w, expected, atol=1e-6)


def test_small_gradient_is_not_clipped():
    w, g = torch.zeros(2), torch.tensor([0.3, 0.4])
    sgd_step(w, g, lr=1.0, weight_decay=0.0, grad_clip=10.0)
    assert torch.allclose(w, -g)


def test_proximal_correction_is_the_gradient_of_the_prox_term():
    anchor, w = torch.randn(5), torch.randn(5, requires_grad=True)
    (0.3 / 2 * (w - anchor).square().sum()).backward()
    g = torch.zeros(5)
    proximal(0.3, anchor)(g, w.detach())
    assert torch.allclose(g, w.grad, atol=1e-6)
