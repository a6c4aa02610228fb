"""Client corrections on a model with float buffers (BatchNorm running statistics).

The flat state is the parameters, then the float buffers (fedmpi.flat.FlatModel), and
the flat gradient has only the parameters' num_params entries. A correction that a
client adds to that gradient from a server vector (FedProx's anchor x^t, the momentum m of
FedCM, MoFedSAM and FedMRUR) must use the vector's first num_params values: the full
vector has a different length (a shape error), and its buffer part has no gradient.
fedmpi's own models have no buffers, so these tests build one that has."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedmpi.algorithms import ClientTask, build
from fedmpi.algorithms.base import ClientData
from fedmpi.flat import FlatModel

from harness import Simulation

LR = 0.1
P = 34   # parameters; the flat state has 42 values


class BatchNormNet(nn.Module):
    """features = ReLU(BN(Linear(3, 4))), classifier = Linear(4, 2): P = 34 parameters and
    8 float buffers (running mean and variance; num_batches_tracked is int64)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU())
        self.classifier = nn.Linear(4, 2)

    def forward(self, x):
        return self.classifier(self.features(x))


class FixedBatches(ClientData):
    """``steps`` fixed batches of 4 samples per epoch."""

    def __init__(self, seed: int, steps: int = 2):
        g = torch.Generator().manual_seed(seed)
        self.data = [(torch.randn(4, 3, generator=g), torch.tensor([0, 1, 1, 0]))
                     for _ in range(steps)]
        self.num_samples = 4 * steps

    def batches(self, epochs, batch_size):
        for _ in range(epochs):
            yield from self.data

    def num_steps(self, epochs, batch_size):
        return epochs * len(self.data)


def network():
    torch.manual_seed(0)
    return BatchNormNet()


def tasks(clients=(0, 1)):
    return {c: ClientTask(c, FixedBatches(c), FlatModel(network()), torch.device("cpu"))
            for c in clients}


def simulation(name, params):
    flat = FlatModel(network())
    assert flat.size == P + 8 and flat.num_params == P   # the buffers after the parameters
    return Simulation(build(name, params), tasks(), x0=flat.params.clone())


def reference_update(x, data, correction):
    """Delta of LR-SGD steps w <- w - LR (g(w) + correction(w)) on a plain module loaded
    with x (parameters by name, then the buffers), in torch autograd; returns the flat
    Delta (parameters, then buffers) as FlatModel lays it out."""
    module = network()
    layout = FlatModel(copy.deepcopy(module))
    module.load_state_dict(layout.state_dict_of(x), strict=False)
    params = list(module.parameters())
    for xb, yb in data.batches(1, 4):
        loss = F.cross_entropy(module(xb), yb)
        grads = torch.autograd.grad(loss, params)
        w = torch.cat([p.detach().reshape(-1) for p in params])
        g = torch.cat([gr.reshape(-1) for gr in grads]) + correction(w)
        with torch.no_grad():
            offset = 0
            for p in params:
                p.sub_(LR * g[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
    flat = FlatModel(module)
    return flat.params - x


def test_fedprox_anchors_only_the_parameters():
    mu = 0.5
    sim = simulation("fedprox", {"mu": mu})
    for t in range(2):
        x = sim.state["x"].clone()
        sim.round([0, 1], t=t, lr=LR)
        uploads = sim.last["train"]["uploads"]
        for c in (0, 1):
            expected = reference_update(x, sim.tasks[c].data, lambda w: mu * (w - x[:P]))
            torch.testing.assert_close(uploads[c].delta, expected, rtol=1e-5, atol=1e-6)
    # the running statistics trained and were averaged with the rest
    assert not torch.equal(sim.state["x"][P:], FlatModel(network()).params[P:])
    assert torch.isfinite(sim.state["x"]).all()


def test_fedcm_momentum_is_cut_to_the_parameters():
    alpha = 0.3
    sim = simulation("fedcm", {"alpha": alpha})
    sim.round([0, 1], t=0, lr=LR)         # m = 0: alpha g only
    assert float(sim.state["K"]) == 2.0
    d = sim.state["D"].clone()
    assert d[P:].abs().sum() > 0         # D has a buffer part, which m must not use
    m = -d[:P] / (2 * LR)
    x = sim.state["x"].clone()
    sim.round([0, 1], t=1, lr=LR)
    uploads = sim.last["train"]["uploads"]
    for c in (0, 1):
        # v = alpha g + (1 - alpha) m = alpha (g + ((1 - alpha) / alpha) m)
        expected = reference_update_mixed(x, sim.tasks[c].data, alpha, m)
        torch.testing.assert_close(uploads[c].delta, expected, rtol=1e-5, atol=1e-6)


def reference_update_mixed(x, data, alpha, m):
    """FedCM's local steps w <- w - LR (alpha g + (1 - alpha) m), by autograd."""
    module = network()
    module.load_state_dict(FlatModel(copy.deepcopy(module)).state_dict_of(x), strict=False)
    params = list(module.parameters())
    for xb, yb in data.batches(1, 4):
        grads = torch.autograd.grad(F.cross_entropy(module(xb), yb), params)
        v = alpha * torch.cat([g.reshape(-1) for g in grads]) + (1 - alpha) * m
        with torch.no_grad():
            offset = 0
            for p in params:
                p.sub_(LR * v[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
    return FlatModel(module).params - x


@pytest.mark.parametrize("name, params", [
    ("mofedsam", {}), ("fedmrur", {}), ("fedmrur", {"aggregation": "mean"})])
def test_sam_methods_with_momentum_run_on_a_batchnorm_model(name, params):
    sim = simulation(name, params)
    start = sim.state["x"].clone()
    for t in range(2):
        sim.round([0, 1], t=t, lr=LR)
    x = sim.state["x"]
    assert torch.isfinite(x).all() and x.shape == start.shape
    assert not torch.equal(x[:P], start[:P]) and not torch.equal(x[P:], start[P:])
    assert np.isfinite(float(sim.state["K"]))


@pytest.mark.parametrize("name, params", [
    ("fedavg", {}), ("scaffold", {}), ("feddyn", {}), ("fedacg", {}), ("fednova", {"mu": 0.1}),
    ("fedmim", {}), ("fedsam", {}), ("fedavgm", {}), ("fedadam", {}), ("fedexp", {})])
def test_the_other_supervised_methods_run_on_a_batchnorm_model(name, params):
    # the methods whose corrections or server steps touch the flat state: two rounds on the
    # model with buffers, without a shape error, finite, parameters and buffers moved
    sim = simulation(name, params)
    start = sim.state["x"].clone()
    for t in range(2):
        sim.round([0, 1], t=t, lr=LR, num_clients=2)
    x = sim.state["x"]
    assert torch.isfinite(x).all() and x.shape == start.shape
    assert not torch.equal(x[:P], start[:P]) and not torch.equal(x[P:], start[P:])
