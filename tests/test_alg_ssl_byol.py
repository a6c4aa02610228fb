"""FedSimSiam, FedBYOL, FedU, FedEMA: local updates against independent re-derivations on a
tiny SSLNet (fixed views, plain modules and autograd), the client state rules (target
init, DAPU, FedEMA's mu_k and lambda_k), the FedU(mu = inf) == FedBYOL reduction, and real
runs: single process vs `mpirun -n 3` bitwise, FL bytes d down / d up."""

import copy
import math

import numpy as np
import pytest
import torch

from fedmpi import config as cfgmod
from fedmpi.algorithms import build
from fedmpi.algorithms.base import ClientData, ClientTask, RoundContext
from fedmpi.algorithms.byol import predictor_size
from fedmpi.algorithms.ssl_losses import byol_loss, simsiam_loss
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.models import build_model
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

from conftest import fedmpi, mpirun_configs, needs_mpi
from helpers import SSL, merged

HEADS = {"proj_dim": 6, "proj_hidden": 8, "pred_hidden": 5}
BACKBONE = {"hidden": 8, "channels": [2, 3]}
B, TAU = 4, 0.9


class FixedViews(ClientData):
    """Two fixed 'augmented' views of 2B images: the steps are reproducible by hand."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.v1, self.v2 = torch.rand(2 * B, 1, 16, 16, generator=g), torch.rand(2 * B, 1, 16, 16, generator=g)
        self.y = torch.zeros(2 * B, dtype=torch.long)
        self.num_samples = 2 * B

    def view_batches(self, epochs, batch_size):
        for _ in range(epochs):
            for i in range(0, self.num_samples, batch_size):
                yield (self.v1[i:i + batch_size], self.v2[i:i + batch_size]), self.y[i:i + batch_size]


def setup(name, seed=0, **params):
    alg = build(name, {**HEADS, **params})
    torch.manual_seed(seed)
    flat = FlatModel(alg.build_model(build_model, "cnn", 1, 10, 16, dict(BACKBONE)))
    task = ClientTask(client=0, data=FixedViews(seed), model=flat, device=torch.device("cpu"))
    return alg, task


def ctx(lr=0.1, round=0):
    return RoundContext(round=round, phase="train", lr=lr, lr_prev=lr, global_lr=1.0,
                        weight_decay=0.0, grad_clip=0.0, local_epochs=1, batch_size=B,
                        num_clients=1, participants=(0,), seed=0)


def empty_state(alg, d):
    """What the store hands out for a client without state."""
    return {k: torch.zeros(n) for k, n in alg.client_state_sizes(d).items()}


def module_at(task, vector):
    module = copy.deepcopy(task.model.module)
    FlatModel(module).load(vector)   # a fresh (NCHW) copy of the same values
    return module


def conv_divergence(a, b):
    """mean over the encoder's 4-D weights of ||W_a - W_b||_2, from named parameters."""
    pa, pb = dict(a.encoder.named_parameters()), dict(b.encoder.named_parameters())
    norms = [torch.linalg.vector_norm(pa[k] - pb[k]).item() for k in pa if pa[k].dim() == 4]
    return sum(norms) / len(norms)


def byol_by_hand(online, target, data, lr, tau):
    """Plain-module BYOL: SGD on the online net, then xi <- tau xi + (1 - tau) theta."""
    online, target = copy.deepcopy(online), copy.deepcopy(target)
    thetas = []   # theta after each step
    for (v1, v2), _ in data.view_batches(1, B):
        p1, p2 = online.predict(online.project(v1)), online.predict(online.project(v2))
        with torch.no_grad():
            t1, t2 = target.project(v1), target.project(v2)
        loss = byol_loss(p1, p2, t1, t2)
        grads = torch.autograd.grad(loss, list(online.parameters()))
        with torch.no_grad():
            for w, g in zip(online.parameters(), grads):
                w.sub_(lr * g)
            for xi, (name, w) in zip(target.parameters(), online.named_parameters()):
                xi.mul_(tau).add_(w, alpha=1 - tau)
        thetas.append(flat_of(online))
    return online, target, thetas


def flat_of(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


# ---- local updates by hand -------------------------------------------------------------

def test_simsiam_loss_at_lr_zero_is_the_formula_and_nothing_moves():
    alg, task = setup("fedsimsiam")
    x = task.model.params.clone()
    up = alg.local_update(task, {"x": x}, {}, ctx(lr=0.0))
    m, data = task.model.module, task.data
    losses = []
    for (v1, v2), _ in data.view_batches(1, B):
        z1, z2 = m.project(v1), m.project(v2)
        losses.append(simsiam_loss(m.predict(z1), m.predict(z2), z1, z2).item())
    assert up.steps == 2 and torch.equal(up.delta, torch.zeros_like(x)) and up.state is None
    assert abs(up.loss - np.mean(losses)) < 1e-6
    assert alg.client_state_sizes(len(x)) == {} and alg.traffic(len(x), "train") == (len(x), len(x))


def test_byol_two_steps_match_the_ema_recursion_and_target_starts_from_global():
    alg, task = setup("fedbyol", tau_ema=TAU)
    d = task.model.size
    n = d - predictor_size(alg.params)
    assert alg.client_state_sizes(d) == {"target": n, "seen": 1}
    x = task.model.params.clone()
    online0 = module_at(task, x)
    up = alg.local_update(task, {"x": x}, empty_state(alg, d), ctx(lr=0.1))
    # independent: the target at first participation is the global encoder + projector
    online, target, (theta1, theta2) = byol_by_hand(online0, online0.target_copy(), task.data,
                                                   0.1, TAU)
    assert up.steps == 2 and up.state["seen"].item() == 1
    assert torch.allclose(x + up.delta, flat_of(online), atol=1e-6)
    assert torch.allclose(up.state["target"], flat_of(target), atol=1e-6)
    # the recursion unrolled: xi_2 = tau^2 xi_0 + tau (1 - tau) theta_1 + (1 - tau) theta_2
    unrolled = TAU ** 2 * x[:n] + TAU * (1 - TAU) * theta1[:n] + (1 - TAU) * theta2[:n]
    assert torch.allclose(up.state["target"], unrolled, atol=1e-6)
    assert not torch.allclose(theta1, theta2, atol=1e-4) and not torch.allclose(theta1[:n], x[:n], atol=1e-4)


def test_byol_later_participation_keeps_its_own_target():
    """lr = 0: theta stays x, so after K = 2 steps xi = tau^2 xi_0 + (1 - tau^2) x."""
    alg, task = setup("fedbyol", tau_ema=TAU)
    d = task.model.size
    n = alg.target_size(d)
    x = task.model.params.clone()
    xi0 = torch.randn(n)
    state = {"target": xi0.clone(), "seen": torch.ones(1)}
    up = alg.local_update(task, {"x": x}, state, ctx(lr=0.0))
    assert torch.allclose(up.state["target"], TAU ** 2 * xi0 + (1 - TAU ** 2) * x[:n], atol=1e-6)
    first = alg.local_update(task, {"x": x}, empty_state(alg, d), ctx(lr=0.0))
    assert torch.allclose(first.state["target"], x[:n], atol=1e-7)   # xi_0 = global


# ---- FedU: DAPU -----------------------------------------------------------------------

@pytest.mark.parametrize("mu, divergence, uses", [
    (0.0, 0.5, "local"), (0.0, 0.0, "local"), (math.inf, 0.5, "global"),
    (0.4, 0.5, "local"), (0.4, 0.3, "global")])
def test_fedu_predictor_choice_flips_with_mu(mu, divergence, uses):
    alg, task = setup("fedu", mu=mu)
    d = task.model.size
    n = alg.target_size(d)
    x = task.model.params.clone()
    local = torch.randn(d - n)
    state = {"target": x[:n].clone(), "seen": torch.ones(1), "predictor": local.clone(),
             "divergence": torch.tensor([divergence])}
    up = alg.local_update(task, {"x": x}, state, ctx(lr=0.0))   # lr 0: the start is kept
    assert torch.equal(up.state["predictor"], local if uses == "local" else x[n:])
    assert up.state["divergence"].item() == 0.0
    first = alg.local_update(task, {"x": x}, empty_state(alg, d), ctx(lr=0.0))
    assert torch.equal(first.state["predictor"], x[n:])   # first participation: global


def test_fedu_stores_the_divergence_of_its_last_training():
    alg, task = setup("fedu", mu=0.0)
    d = task.model.size
    x = task.model.params.clone()
    before = module_at(task, x)
    up = alg.local_update(task, {"x": x}, empty_state(alg, d), ctx(lr=0.1))
    after = module_at(task, x + up.delta)
    assert abs(up.state["divergence"].item() - conv_divergence(after, before)) < 1e-6
    assert up.state["divergence"].item() > 0
    assert alg.client_state_sizes(d) == {"target": alg.target_size(d), "seen": 1,
                                         "predictor": predictor_size(alg.params), "divergence": 1}


# ---- FedEMA: mu_k = min(lambda_k delta_k, 1), lambda_k once ---------------------------

def test_fedema_lambda_once_and_mu_from_the_state():
    alg, task = setup("fedema", tau=0.7)
    d = task.model.size
    n = alg.target_size(d)
    x = task.model.params.clone()
    before = module_at(task, x)
    s1 = alg.local_update(task, {"x": x}, empty_state(alg, d), ctx(lr=0.1, round=0)).state
    delta1 = conv_divergence(module_at(task, s1["online"]), before)
    assert abs(s1["divergence"].item() - delta1) < 1e-6
    assert abs(s1["lam"].item() - 0.7 / delta1) < 1e-4 * 0.7 / delta1
    assert s1["mu"].item() == 0 and s1["last_round"].item() == 0
    # round 1 (trained in round 0): mu = min(lambda delta, 1) = tau; lr 0 keeps the start
    x2 = x + 0.01 * torch.randn(d)
    s2 = alg.local_update(task, {"x": x2}, {k: v.clone() for k, v in s1.items()}, ctx(0.0, 1)).state
    mu = min(s1["lam"].item() * s1["divergence"].item(), 1.0)
    assert abs(mu - 0.7) < 1e-6 and abs(s2["mu"].item() - mu) < 1e-7
    assert torch.allclose(s2["online"], mu * s1["online"] + (1 - mu) * x2, atol=1e-6)
    assert s2["lam"].item() == s1["lam"].item()                 # computed once
    assert s2["divergence"].item() == 0.0 and s2["last_round"].item() == 1
    # the local target is kept; two lr-0 steps pull it towards the (mixed) online start
    t = alg.params.tau_ema
    start = s2["online"][:n]
    assert torch.allclose(s2["target"], t ** 2 * s1["target"] + (1 - t ** 2) * start, atol=1e-6)


def test_fedema_caps_mu_at_one_and_skips_the_ema_after_a_missed_round():
    alg, task = setup("fedema")
    d = task.model.size
    n = alg.target_size(d)
    x = task.model.params.clone()
    local, xi = torch.randn(d), torch.randn(n)
    state = {"target": xi, "seen": torch.ones(1), "online": local, "divergence": torch.tensor([0.5]),
             "lam": torch.tensor([10.0]), "last_round": torch.tensor([4.0]), "mu": torch.zeros(1)}
    capped = alg.local_update(task, {"x": x}, dict(state), ctx(0.0, 5)).state
    assert capped["mu"].item() == 1.0 and torch.allclose(capped["online"], local)
    missed = alg.local_update(task, {"x": x}, dict(state), ctx(0.0, 6)).state
    assert missed["mu"].item() == 0.0 and torch.equal(missed["online"], x)
    assert torch.allclose(missed["target"], x[:n], atol=1e-7)    # target reset to global
    assert set(alg.client_state_sizes(d)) == {"target", "seen", "online", "divergence", "lam",
                                              "last_round", "mu"}
    assert alg.client_state_sizes(d)["online"] == d


@pytest.mark.parametrize("name, field, value", [
    ("fedsimsiam", "pred_hidden", 0), ("fedbyol", "tau_ema", 1.5), ("fedu", "mu", -1.0),
    ("fedema", "tau", 0.0)])
def test_bad_parameters_name_the_field(name, field, value):
    with pytest.raises(UsageError, match=f"algorithm.{field}"):
        build(name, {field: value})


# ---- real runs ---------------------------------------------------------------------------

def run_single(tmp_path, name, **algorithm):
    values = merged(SSL, algorithm={"name": name, **algorithm})
    values["output"] = str(tmp_path / f"{name}.h5")
    exp = run_experiment(cfgmod.from_dict(values), LocalComm(), quiet=True)
    return exp, RunFile(values["output"])


@pytest.mark.slow
def test_fedu_with_infinite_mu_is_fedbyol_and_with_zero_mu_is_not(tmp_path):
    _, byol = run_single(tmp_path, "fedbyol")
    _, fedu = run_single(tmp_path, "fedu", mu=math.inf)
    (tmp_path / "local").mkdir()
    _, local = run_single(tmp_path / "local", "fedu", mu=0.0)   # clients 1, 2 train twice
    with byol, fedu, local:
        assert np.array_equal(byol.model(), fedu.model())
        assert not np.array_equal(byol.model(), local.model())


MPI_CASES = ["fedsimsiam", "fedbyol", "fedu", "fedema"]


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """Each case under one real ``mpirun -n 3``."""
    return mpirun_configs(3, {name: merged(SSL, algorithm={"name": name}) for name in MPI_CASES},
                          tmp_path_factory.mktemp("n3"))


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("name", MPI_CASES)
def test_mpirun_is_bitwise_single_process_and_traffic_is_d_d(tmp_path, three_ranks, name):
    exp, single = run_single(tmp_path, name)
    with single as a, RunFile(three_ranks[name]) as b:
        assert np.array_equal(a.model(), b.model())
        assert np.array_equal(a.rounds()["train_loss"], b.rounds()["train_loss"], equal_nan=True)
        assert np.array_equal(a.rounds()["test_acc"], b.rounds()["test_acc"])   # round 0's kNN too
        per_round = [0] + [SSL["clients"]["per_round"] * exp.d * 4] * SSL["rounds"]   # 0: round 0
        for run in (a, b):
            assert run.rounds()["fl_bytes_down"].tolist() == per_round
            assert run.rounds()["fl_bytes_up"].tolist() == per_round
        assert np.all(np.isfinite(a.rounds()["train_loss"][1:]))


def test_cli_lists_the_four_algorithms_with_their_parameters():
    out = fedmpi(["algorithms"], check=True).stdout
    for name in ("fedsimsiam", "fedbyol", "fedu", "fedema"):
        assert name in out
    for param in ("pred_hidden", "tau_ema", "mu", "tau"):
        assert param in out
