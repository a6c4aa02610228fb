"""FedCM, FedSAM, MoFedSAM, FedMRUR and their pieces (SAM, momentum, normalized
aggregation, Lorentz regulariser): hand-checked numbers, numpy re-derivations on quadratic
clients, the reductions between methods, exact FL traffic, and bitwise
single-process == mpirun in deterministic mode."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from fedmpi import config as cfg
from fedmpi.algorithms import build
from fedmpi.algorithms.base import ClientData, ClientTask
from fedmpi.algorithms.fedavg import FedAvg
from fedmpi.algorithms.hyperbolic import lift, lorentz_dist2, lorentz_inner, regularizer
from fedmpi.algorithms.normalized import normalized_update
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

from conftest import mpirun_configs, needs_mpi
from harness import Simulation, quadratic_task
from helpers import TINY, merged

ALGS = ["fedcm", "fedsam", "mofedsam", "fedmrur"]
DOWN = {"fedcm": 2, "fedsam": 1, "mofedsam": 2, "fedmrur": 2}   # payload per client, in d


# ---- numpy re-derivation of the whole family on f_i(w) = 0.5 ||w - c_i||^2 ----------------

def client_ref(x, c, steps, lr, rho, alpha, m, wd, clip, decay="matched"):
    """K steps of v = alpha g~ + (1 - alpha) m, clip, w <- w (1 - lr wd') - lr v (float64),
    wd' = alpha wd ("matched") or wd ("code"). On the quadratic the SAM gradient is
    g~ = (w + rho g/||g||) - c with g = w - c."""
    w = x.copy()
    wd = alpha * wd if decay == "matched" else wd
    for _ in range(steps):
        g = w - c
        if rho:
            g = w + rho * g / (np.linalg.norm(g) + 1e-7) - c
        v = alpha * g + (1 - alpha) * m
        scale = min(1.0, clip / (np.linalg.norm(v) + 1e-6)) if clip else 1.0
        w = w * (1 - lr * wd) - lr * scale * v
    return w - x


def family_ref(rounds, centers, steps, sizes, x0, *, rho=0.0, alpha=1.0, normalized=False,
               momentum=True, wd=0.0, clip=0.0, decay="matched"):
    """Server side: Dbar n_i-weighted (or normalized, unweighted); m = -D / (K lr_prev)."""
    x, D, K = np.array(x0, dtype=np.float64), None, 0.0
    for who, lr, lr_prev in rounds:
        m = -D / (K * lr_prev) if (momentum and D is not None) else np.zeros_like(x)
        deltas = [client_ref(x, np.array(centers[c], dtype=np.float64), steps[c], lr, rho,
                             alpha, m, wd, clip, decay) for c in who]
        n = np.array([sizes[c] for c in who], dtype=np.float64)
        k = np.array([steps[c] for c in who], dtype=np.float64)
        if normalized:
            s = np.sum(deltas, axis=0)
            D = np.mean([np.linalg.norm(d) for d in deltas]) * s / np.linalg.norm(s)
            K = k.mean()
        else:
            D = np.sum([ni * d for ni, d in zip(n, deltas)], axis=0) / n.sum()
            K = float((n * k).sum() / n.sum())
        x = x + D
    return x


CENTERS = {0: [1.0, -2.0, 0.5], 1: [-3.0, 1.0, 2.0], 2: [0.5, 4.0, -1.0]}
STEPS = {0: 2, 1: 3, 2: 5}
SIZES = {0: 20, 1: 30, 2: 50}
X0 = [0.2, -0.1, 0.3]
# lr 0.1 * 0.9^t: lr_prev = lr / 0.9 differs from lr, so the momentum's scale is checked
ROUNDS = [([0, 1, 2], 0.1, 0.1 / 0.9), ([0, 2], 0.09, 0.1), ([1, 2], 0.081, 0.09),
          ([0, 1, 2], 0.0729, 0.081)]


def simulate(name, params, rounds=ROUNDS, wd=0.0, clip=0.0, centers=CENTERS, x0=X0):
    tasks = {c: quadratic_task(c, centers[c], steps=STEPS[c], num_samples=SIZES[c]) for c in centers}
    sim = Simulation(build(name, params), tasks, x0=x0)
    for t, (who, lr, lr_prev) in enumerate(rounds):
        sim.round(who, t=t, lr=lr, lr_prev=lr_prev, weight_decay=wd, grad_clip=clip)
    return sim


@pytest.mark.parametrize("name, params, ref", [
    ("fedcm", {"alpha": 0.3}, {"alpha": 0.3}),
    ("fedcm", {"alpha": 0.3, "decay": "code"}, {"alpha": 0.3, "decay": "code"}),
    ("fedsam", {"rho": 0.4}, {"rho": 0.4, "momentum": False, "decay": "code"}),
    ("mofedsam", {"rho": 0.4, "alpha": 0.2}, {"rho": 0.4, "alpha": 0.2}),
    ("mofedsam", {"rho": 0.4, "alpha": 0.2, "decay": "code"}, {"rho": 0.4, "alpha": 0.2, "decay": "code"}),
    ("fedmrur", {"rho": 0.4, "alpha": 0.2, "regularizer": False},
     {"rho": 0.4, "alpha": 0.2, "normalized": True}),
    ("fedmrur", {"rho": 0.4, "alpha": 0.2, "regularizer": False, "aggregation": "mean"},
     {"rho": 0.4, "alpha": 0.2}),
    ("fedmrur", {"rho": 0.4, "alpha": 0.2, "regularizer": False, "decay": "code"},
     {"rho": 0.4, "alpha": 0.2, "normalized": True, "decay": "code"}),
])
def test_quadratic_rounds_match_numpy_rederivation(name, params, ref):
    # weight decay and a clip norm that binds in the first steps are part of the rule
    sim = simulate(name, params, wd=0.01, clip=3.0)
    expected = family_ref(ROUNDS, CENTERS, STEPS, SIZES, X0, wd=0.01, clip=3.0, **ref)
    np.testing.assert_allclose(sim.state["x"].numpy(), expected, rtol=1e-5, atol=1e-6)


def test_fedsam_one_step_by_hand():
    # client 0: c = (3, 4), w = 0: g = (-3, -4), ||g|| = 5, e = 0.5 g/5 = (-0.3, -0.4),
    #   g~ = w + e - c = (-3.3, -4.4), w1 = -0.1 g~ = (0.33, 0.44)
    # client 1: c = (0, -2): g = (0, 2), e = (0, 0.5), g~ = (0, 2.5), w1 = (0, -0.25)
    # FedAvg weights n = 10, 30: x = 0.25 (0.33, 0.44) + 0.75 (0, -0.25) = (0.0825, -0.0775)
    tasks = {0: quadratic_task(0, [3.0, 4.0], num_samples=10),
             1: quadratic_task(1, [0.0, -2.0], num_samples=30)}
    sim = Simulation(build("fedsam", {"rho": 0.5}), tasks, x0=[0.0, 0.0])
    sim.round([0, 1], lr=0.1)
    np.testing.assert_allclose(sim.state["x"].numpy(), [0.0825, -0.0775], atol=1e-6)


def test_fedcm_momentum_by_hand():
    # c = 1, w = 0, lr 0.5, alpha 0.5, one step per round.
    # round 0: m = 0, g = -1, v = -0.5, w = 0.25 -> D = 0.25, K = 1
    # round 1: m = -0.25 / (1 * 0.5) = -0.5; g = 0.25 - 1 = -0.75,
    #          v = 0.5 (-0.75) + 0.5 (-0.5) = -0.625, w = 0.25 + 0.5 * 0.625 = 0.5625
    sim = Simulation(build("fedcm", {"alpha": 0.5}), {0: quadratic_task(0, [1.0])}, x0=[0.0])
    sim.round([0], t=0, lr=0.5)
    assert torch.allclose(sim.state["x"], torch.tensor([0.25]))
    sim.round([0], t=1, lr=0.5, lr_prev=0.5)
    assert torch.allclose(sim.state["x"], torch.tensor([0.5625]))
    assert sim.state["D"].item() == pytest.approx(0.3125) and sim.state["K"].item() == 1


def test_fedmrur_normalized_step_by_hand():
    # orthogonal updates (0.5, 0) and (0, 0.5): FedAvg moves (0.25, 0.25), length 0.354;
    # FedMRUR keeps the mean length 0.5 along the sum's direction: (0.3536, 0.3536)
    tasks = {0: quadratic_task(0, [1.0, 0.0]), 1: quadratic_task(1, [0.0, 1.0])}
    sim = Simulation(build("fedmrur", {"rho": 0.0, "alpha": 1.0, "regularizer": False}), tasks,
                     x0=[0.0, 0.0])
    sim.round([0, 1], lr=0.5)
    np.testing.assert_allclose(sim.state["x"].numpy(), [0.5 / math.sqrt(2)] * 2, rtol=1e-6)


# ---- reductions ------------------------------------------------

def assert_same_model(a, b):
    np.testing.assert_allclose(a.state["x"].numpy(), b.state["x"].numpy(), rtol=1e-6, atol=1e-7)


def test_fedcm_alpha_one_is_fedavg():
    assert_same_model(simulate("fedcm", {"alpha": 1.0}, wd=0.01, clip=3.0),
                      simulate("fedavg", {}, wd=0.01, clip=3.0))


def test_mofedsam_alpha_one_is_fedsam():
    assert_same_model(simulate("mofedsam", {"alpha": 1.0, "rho": 0.3}, wd=0.01, clip=3.0),
                      simulate("fedsam", {"rho": 0.3}, wd=0.01, clip=3.0))


def test_fedsam_rho_zero_is_fedavg():
    assert_same_model(simulate("fedsam", {"rho": 0.0}, wd=0.01), simulate("fedavg", {}, wd=0.01))


class FedAvgNormalized(FedAvg):
    """FedAvg clients + FedMRUR's normalized aggregation (not registered)."""

    def contribution(self, upload):
        return {"delta": upload.delta, "weight": torch.ones(1)}

    def server_update(self, state, sums, gathered, ctx):
        state["x"].add_(normalized_update(sums["delta"], gathered["update_norm"]), alpha=ctx.global_lr)


def test_fedmrur_rho_zero_alpha_one_is_fedavg_with_normalized_aggregation():
    tasks = {c: quadratic_task(c, CENTERS[c], steps=STEPS[c], num_samples=SIZES[c]) for c in CENTERS}
    ref = Simulation(FedAvgNormalized(), tasks, x0=X0)
    for t, (who, lr, lr_prev) in enumerate(ROUNDS):
        ref.round(who, t=t, lr=lr, lr_prev=lr_prev, weight_decay=0.01, grad_clip=3.0)
    mrur = simulate("fedmrur", {"rho": 0.0, "alpha": 1.0, "regularizer": False}, wd=0.01, clip=3.0)
    assert_same_model(mrur, ref)


def test_normalized_aggregation_equal_and_orthogonal_updates():
    delta = torch.tensor([0.3, -1.2, 0.7, 2.0])
    D = normalized_update(4 * delta, [float(delta.norm())] * 4)
    assert torch.allclose(D, delta, atol=1e-6)
    eye = 1.5 * torch.eye(4)   # 4 orthogonal updates of norm 1.5
    D = normalized_update(eye.sum(0), [1.5] * 4)
    assert float(D.norm()) == pytest.approx(1.5, rel=1e-6)
    assert float(eye.mean(0).norm()) == pytest.approx(1.5 / 2, rel=1e-6)   # FedAvg: /sqrt(S)
    assert torch.equal(normalized_update(torch.zeros(3), [0.0, 0.0]), torch.zeros(3))


def test_lorentz_distance():
    torch.manual_seed(0)
    beta = 1.0
    z1, z2 = torch.randn(64, 7, dtype=torch.float64) * 3, torch.randn(64, 7, dtype=torch.float64) * 3
    a, b = lift(z1, beta), lift(z2, beta)
    assert torch.allclose(lorentz_inner(a, a), torch.full((64,), -beta, dtype=torch.float64))
    d = lorentz_dist2(a, b)
    closed = 2 * (torch.sqrt((beta + z1.square().sum(1)) * (beta + z2.square().sum(1)))
                  - beta - (z1 * z2).sum(1))
    assert torch.allclose(d, closed, rtol=1e-10, atol=1e-10)
    assert torch.allclose(d, -2 * beta - 2 * lorentz_inner(a, b), rtol=1e-9, atol=1e-9)
    assert torch.all(d >= 0)
    z = torch.randn(16, 512) * 10   # float32, large features: still exactly 0 for equal inputs
    assert torch.equal(lorentz_dist2(lift(z, 2.0), lift(z, 2.0)), torch.zeros(16))
    reg, dist2 = regularizer(z, z, 2.0, 1e4)
    assert reg.item() == 1.0 and torch.equal(dist2, torch.zeros(16))


# ---- the regulariser on a model with features/classifier ---------------------------------

class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
        self.classifier = nn.Linear(3, 2)

    def features(self, x):
        return self.body(x)

    def forward(self, x):
        return self.classifier(self.features(x))


class FixedBatches(ClientData):
    def __init__(self, batches):
        self.list, self.num_samples = batches, sum(len(y) for _, y in batches)

    def batches(self, epochs, batch_size):
        for _ in range(epochs):
            yield from self.list

    def num_steps(self, epochs, batch_size):
        return epochs * len(self.list)


def net_tasks(num_clients=2, steps=3):
    g = torch.Generator().manual_seed(1)
    tasks = {}
    for c in range(num_clients):
        batches = [(torch.randn(5, 4, generator=g) * 2, torch.randint(0, 2, (5,), generator=g))
                   for _ in range(steps)]
        tasks[c] = ClientTask(c, FixedBatches(batches), FlatModel(TinyNet()), torch.device("cpu"))
    return tasks


def net_x0():
    torch.manual_seed(5)
    return FlatModel(TinyNet()).params.clone()


def reference_fedmrur_client(x, batches, lr, gamma, sigma, beta, rho):
    """FedMRUR's local steps (alpha = 1, round 0) written independently: autograd on the
    textbook distance 2(sqrt((b+|z|^2)(b+|z_G|^2)) - b - <z, z_G>), G = the received model."""
    model, frozen = TinyNet(), TinyNet()
    nn.utils.vector_to_parameters(x.clone(), model.parameters())
    nn.utils.vector_to_parameters(x.clone(), frozen.parameters())
    params, dists = list(model.parameters()), []

    def objective(xb, yb, zg):
        z = model.features(xb)
        d = 2 * (torch.sqrt((beta + z.square().sum(1)) * (beta + zg.square().sum(1)))
                 - beta - (z * zg).sum(1))
        loss = nn.functional.cross_entropy(model.classifier(z), yb)
        return loss + gamma * torch.exp(d / sigma).mean(), d

    for xb, yb in batches:
        zg = frozen.features(xb).detach()
        f, d = objective(xb, yb, zg)
        dists.append(float(d.detach().mean()))
        g1 = torch.autograd.grad(f, params)
        norm = torch.sqrt(sum(g.square().sum() for g in g1))
        with torch.no_grad():
            e = [rho * g / (norm + 1e-7) for g in g1]
            for p, ei in zip(params, e):
                p.add_(ei)
        g2 = torch.autograd.grad(objective(xb, yb, zg)[0], params)
        with torch.no_grad():
            for p, ei, g in zip(params, e, g2):
                p.sub_(ei).sub_(lr * g)
    return nn.utils.parameters_to_vector(params).detach() - x, float(np.mean(dists))


def test_fedmrur_client_step_matches_independent_autograd():
    # strong regulariser (gamma 0.5, sigma 2) so its gradient is visible after step 1
    params = {"alpha": 1.0, "rho": 0.2, "gamma": 0.5, "sigma": 2.0, "beta": 1.5}
    tasks, x0 = net_tasks(num_clients=1), net_x0()
    sim = Simulation(build("fedmrur", params), tasks, x0=x0)
    diag = sim.round([0], lr=0.5)
    upload = sim.last["train"]["uploads"][0]
    delta, dist = reference_fedmrur_client(x0, tasks[0].data.list, 0.5, 0.5, 2.0, 1.5, 0.2)
    torch.testing.assert_close(upload.delta, delta, rtol=1e-5, atol=1e-6)
    plain = Simulation(build("fedmrur", {**params, "regularizer": False}), net_tasks(1), x0=x0)
    plain.round([0], lr=0.5)
    assert not torch.allclose(plain.last["train"]["uploads"][0].delta, delta, atol=1e-4)
    assert dist > 0 and diag["fedmrur_lorentz_dist2"] == pytest.approx(dist, rel=1e-4)
    assert math.isnan(plain.round([0], lr=0.5)["fedmrur_lorentz_dist2"])


def test_fedmrur_gamma_zero_mean_aggregation_is_mofedsam():
    x0, rounds = net_x0(), [([0, 1], 0.3, 0.3), ([0, 1], 0.3, 0.3), ([1], 0.3, 0.3)]
    mrur = Simulation(build("fedmrur", {"gamma": 0.0, "aggregation": "mean"}), net_tasks(), x0=x0)
    mofedsam = Simulation(build("mofedsam", {"rho": 0.5, "alpha": 0.1}), net_tasks(), x0=x0)
    for t, (who, lr, lr_prev) in enumerate(rounds):
        diag = mrur.round(who, t=t, lr=lr, lr_prev=lr_prev, grad_clip=10.0, weight_decay=5e-4)
        mofedsam.round(who, t=t, lr=lr, lr_prev=lr_prev, grad_clip=10.0, weight_decay=5e-4)
    assert_same_model(mrur, mofedsam)
    assert diag["fedmrur_lorentz_dist2"] > 0   # computed (and logged) even with gamma = 0


@pytest.mark.parametrize("name, params", [
    ("fedcm", {"alpha": 1.5}), ("fedsam", {"rho": -0.1}), ("mofedsam", {"alpha": -0.1}),
    ("fedmrur", {"sigma": 0.0}), ("fedmrur", {"aggregation": "median"}),
    ("fedmrur", {"representation": "pixels"}), ("fedmrur", {"gamma": -1.0}),
])
def test_bad_parameters_name_the_field(name, params):
    with pytest.raises(UsageError, match=f"algorithm.{next(iter(params))}"):
        build(name, params)


# ---- the real runtime: traffic, diagnostics, MPI -----------------------------------------

def tiny(name):
    """TINY for 2 rounds in deterministic mode, evaluated once (the last round), with a
    weight decay (the momentum methods place it as ``decay`` says)."""
    return dict(rounds=2, algorithm={"name": name}, system={"deterministic": True},
                eval={"every": 2}, train={"weight_decay": 1e-3})


@pytest.fixture(scope="module", params=ALGS)
def single(request, tmp_path_factory):
    """(name, d, path): one single-process run of each algorithm, shared by the tests below."""
    name, tmp = request.param, tmp_path_factory.mktemp(request.param)
    values = merged(TINY, **tiny(name))
    values["output"] = str(tmp / "single.h5")
    exp = run_experiment(cfg.from_dict(values), LocalComm(), quiet=True)
    return name, exp.d, tmp / "single.h5"


def test_fl_bytes_are_the_declared_messages(single):
    name, d, path = single
    per_round = TINY["clients"]["per_round"] * d * 4
    with RunFile(path) as run:
        assert run.status == "completed"
        rounds = run.rounds()
        assert rounds["fl_bytes_down"].tolist() == [0] + [DOWN[name] * per_round] * 2   # 0: round 0
        assert rounds["fl_bytes_up"].tolist() == [0] + [per_round] * 2
        assert np.isfinite(rounds["test_loss"][-1])
        if name == "fedmrur":   # the regulariser is active and its log is the clients' mean
            assert np.all(rounds["fedmrur_lorentz_dist2"][1:] > 0)
            clients = run.clients()["lorentz_dist2"]
            np.testing.assert_allclose(rounds["fedmrur_lorentz_dist2"][1:],
                                       clients.reshape(2, -1).mean(axis=1), rtol=1e-12)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """Every algorithm's run under one real ``mpirun -n 3``."""
    return mpirun_configs(3, {name: merged(TINY, **tiny(name)) for name in ALGS},
                          tmp_path_factory.mktemp("n3"))


@pytest.mark.slow
@needs_mpi
def test_mpirun_is_bitwise_single_process(single, three_ranks):
    name, _, path = single
    with RunFile(path) as a, RunFile(three_ranks[name]) as b:
        assert b.status == "completed" and b.attrs["world_size"] == 3
        assert np.array_equal(a.model(), b.model())
        assert np.array_equal(a.rounds()["train_loss"], b.rounds()["train_loss"], equal_nan=True)
        if name == "fedmrur":
            assert np.array_equal(a.rounds()["fedmrur_lorentz_dist2"], b.rounds()["fedmrur_lorentz_dist2"],
                                  equal_nan=True)
