"""The quadratic-client harness against FedAvg's closed form (it is what issue-3 tests use)."""

import numpy as np
import torch

from fedmpi.algorithms import build

from harness import Simulation, quadratic_task


def test_fedavg_on_quadratics_matches_closed_form():
    # K local GD steps from x on 0.5||w - c||^2: w_K = c + (1 - lr)^K (x - c)
    centers = {0: [1.0, 0.0], 1: [0.0, 3.0], 2: [-2.0, 1.0]}
    sizes = {0: 10, 1: 30, 2: 60}
    tasks = {c: quadratic_task(c, centers[c], steps=3, num_samples=sizes[c]) for c in centers}
    sim = Simulation(build("fedavg", {}), tasks, x0=[0.5, 0.5])
    x = np.array([0.5, 0.5])
    for t in range(3):
        sim.round([0, 1, 2], t=t, lr=0.1)
        w = {c: np.array(centers[c]) + 0.9 ** 3 * (x - centers[c]) for c in centers}
        x = sum(sizes[c] * w[c] for c in centers) / sum(sizes.values())
    np.testing.assert_allclose(sim.state["x"].numpy(), x, rtol=1e-6)


def test_fedprox_pulls_towards_the_global_model():
    tasks = {0: quadratic_task(0, [4.0], steps=1)}
    prox = Simulation(build("fedprox", {"mu": 1.0}), tasks, x0=[0.0])
    prox.round([0], lr=0.5)
    # one step: g = (w - c) + mu (w - x) = -4 at w = x = 0 -> w = 2
    assert torch.allclose(prox.state["x"], torch.tensor([2.0]))
