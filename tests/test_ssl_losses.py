"""SSL losses against hand-computed values on 2 x 2 inputs; stop-gradients; the EMA update."""

import math

import pytest
import torch

from fedmpi.algorithms.ssl_losses import byol_loss, ema_update, nt_xent, simsiam_loss
from fedmpi.errors import UsageError


def t(rows, grad=False):
    return torch.tensor(rows, dtype=torch.float64, requires_grad=grad)


def test_nt_xent_aligned_views():
    """z = (e1, e2, e1, e2): each anchor has its positive at sim 1 and two negatives at 0,
    so every anchor's loss is -log(e^{1/T} / (e^{1/T} + 2))."""
    for temperature in (1.0, 0.5):
        expected = math.log(1 + 2 * math.exp(-1 / temperature))
        loss = nt_xent(t([[1, 0], [0, 1]]), t([[1, 0], [0, 1]]), temperature)
        assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_nt_xent_normalises_and_masks_self():
    """Positives orthogonal, one negative aligned: log(e^0 + e^0 + e^1) - 0 = log(2 + e).
    Unmasked self-similarity (1/T on the diagonal) would give a different value."""
    loss = nt_xent(t([[2, 0], [0, 3]]), t([[0, 5], [0.5, 0]]), temperature=1.0)
    assert loss.item() == pytest.approx(math.log(2 + math.e), rel=1e-12)


def test_nt_xent_gradient_reaches_both_views():
    z1, z2 = t([[1, 0.2], [0.3, 1]], grad=True), t([[0.5, 1], [1, -0.4]], grad=True)
    nt_xent(z1, z2).backward()
    assert z1.grad.abs().sum() > 0 and z2.grad.abs().sum() > 0
    with pytest.raises(UsageError, match="temperature"):
        nt_xent(z1, z2, temperature=0.0)


def test_byol_loss_hand_values_and_stop_gradient():
    """Row 0: (2 - 2cos((1,0),(0,1))) + (2 - 2cos((1,1),(1,0))) = 2 + 2 - sqrt2;
    row 1: (2 - 2cos((3,0),(1,0))) + (2 - 2cos((0,1),(0,-1))) = 0 + 4; mean = 4 - sqrt2/2."""
    p1, p2 = t([[1, 0], [3, 0]], grad=True), t([[1, 1], [0, 1]], grad=True)
    t1, t2 = t([[1, 0], [0, -1]], grad=True), t([[0, 1], [1, 0]], grad=True)
    loss = byol_loss(p1, p2, t1, t2)
    assert loss.item() == pytest.approx(4 - math.sqrt(2) / 2, rel=1e-12)
    loss.backward()
    assert t1.grad is None and t2.grad is None
    assert p1.grad.abs().sum() > 0


def test_simsiam_loss_hand_values_and_stop_gradient():
    """cos(p1, z2) = (1, -1/sqrt2), cos(p2, z1) = (1, 0): -((1 - 1/sqrt2)/2 + 1/2) / 2."""
    p1, p2 = t([[1, 0], [1, 1]], grad=True), t([[0, 1], [1, 0]], grad=True)
    z1, z2 = t([[0, 2], [0, 1]], grad=True), t([[1, 0], [-1, 0]], grad=True)
    loss = simsiam_loss(p1, p2, z1, z2)
    assert loss.item() == pytest.approx(-((1 - 1 / math.sqrt(2)) / 2 + 0.5) / 2, rel=1e-12)
    loss.backward()
    assert z1.grad is None and z2.grad is None


def test_identical_predictions_give_the_loss_minimum():
    x = t([[1, 2], [-3, 0.5], [0.1, 0.1]])
    assert byol_loss(x, x, x, x).item() == pytest.approx(0, abs=1e-12)
    assert simsiam_loss(x, x, x, x).item() == pytest.approx(-1, abs=1e-12)


def test_ema_update_in_place():
    target, online = t([1, 2]), t([3, 6])
    ema_update(target, online, 0.9)
    assert torch.allclose(target, t([1.2, 2.4]), atol=1e-15)
    targets, onlines = [t([0.0]), t([[1.0, 1.0]])], [t([10.0]), t([[3.0, -1.0]])]
    ema_update(targets, onlines, 0.5)
    assert targets[0].item() == 5 and targets[1].tolist() == [[2.0, 0.0]]
    ema_update(target, online, 0.0)
    assert torch.equal(target, online)
    with pytest.raises(UsageError, match="tau"):
        ema_update(target, online, 1.5)


def test_ema_update_on_parameters_needs_no_grad_context():
    module = torch.nn.Linear(2, 2)
    twin = torch.nn.Linear(2, 2)
    ema_update(list(twin.parameters()), list(module.parameters()), 0.0)
    assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), module.parameters()))
