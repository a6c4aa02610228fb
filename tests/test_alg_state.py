"""SCAFFOLD, FedDyn, FedNova and MOON: closed forms on quadratic clients, the reductions
between methods, MOON's loss and projection head, exact FL traffic through the
runtime, and mpirun -n 3 bitwise equal to one process."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmpi.algorithms import REGISTRY, build, message_sizes
from fedmpi.algorithms.base import ClientData, ClientTask
from fedmpi.algorithms.fednova import normalizer
from fedmpi.algorithms.local_sgd import frozen_copy
from fedmpi.algorithms.moon import model_contrastive
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.models import build_model, check_options
from fedmpi.results import RunFile

from conftest import mpirun_configs, needs_mpi
from harness import Simulation, context, quadratic_task
from helpers import TINY, merged
from test_runtime import run_tiny

CENTERS = {0: [1.0, 0.0], 1: [0.0, 3.0], 2: [-2.0, 1.0], 3: [2.0, 2.0]}
STEPS = {0: 1, 1: 3, 2: 6, 3: 2}
SIZES = {0: 10, 1: 30, 2: 60, 3: 20}
ROUNDS = [[0, 1, 2], [1, 3], [0, 2, 3]]   # partial participation, N = 4


def tasks(equal_sizes=False, steps=STEPS):
    return {c: quadratic_task(c, CENTERS[c], steps=steps[c],
                              num_samples=10 if equal_sizes else SIZES[c]) for c in CENTERS}


def local_gd(x, center, steps, lr, extra=lambda w: 0.0):
    """K plain gradient steps on 0.5||w - center||^2 (+ an extra gradient term), float64."""
    w = x.copy()
    for _ in range(steps):
        w = w - lr * ((w - center) + extra(w))
    return w


# ---- SCAFFOLD --------------------------------------------------------------------------

def test_scaffold_by_hand():
    # N = 2, client 0 only, center 4, K = 2, lr 0.5. Round 1 (c = c_i = 0):
    #   y: 0 -> 2 -> 3;  c_i+ = (0 - 3) / (2 * 0.5) = -3;  c = -3 / N = -1.5;  x = 3.
    # Round 2: g - c_i + c = (y - 4) + 3 - 1.5 = y - 2.5:  y: 3 -> 2.75 -> 2.625;
    #   c_i+ = -3 + 1.5 + (3 - 2.625) / 1 = -1.125;  c = -1.5 + (-1.125 + 3) / 2 = -0.5625.
    sim = Simulation(build("scaffold", {}), {0: quadratic_task(0, [4.0], steps=2)}, x0=[0.0])
    sim.round([0], t=0, lr=0.5, num_clients=2)
    assert sim.state["x"].tolist() == [3.0] and sim.state["c"].tolist() == [-1.5]
    assert sim.client_states[0]["c_i"].tolist() == [-3.0]
    sim.round([0], t=1, lr=0.5, num_clients=2)
    assert sim.state["x"].tolist() == [2.625] and sim.state["c"].tolist() == [-0.5625]
    assert sim.client_states[0]["c_i"].tolist() == [-1.125]


def scaffold_reference(lr, rounds, nominal=None):
    x, c = np.array([0.5, 0.5]), np.zeros(2)
    c_i = {i: np.zeros(2) for i in CENTERS}
    for who in rounds:
        dy, dc = [], []
        for i in who:
            y = local_gd(x, np.array(CENTERS[i]), STEPS[i], lr, lambda w: c - c_i[i])
            k = STEPS[i] if nominal is None else nominal[i]
            c_new = c_i[i] - c + (x - y) / (k * lr)
            dy.append(y - x)
            dc.append(c_new - c_i[i])
            c_i[i] = c_new
        x = x + np.mean(dy, axis=0)
        c = c + np.sum(dc, axis=0) / len(CENTERS)
    return x, c, c_i


@pytest.mark.parametrize("steps", ["actual", "nominal"])
def test_scaffold_matches_numpy_recursion(steps):
    sim = Simulation(build("scaffold", {"steps": steps}), tasks(), x0=[0.5, 0.5])
    for t, who in enumerate(ROUNDS):
        sim.round(who, t=t, lr=0.1, num_clients=4)
    # nominal K = E n_i / B with the harness's B = 1, E = 1
    x, c, c_i = scaffold_reference(0.1, ROUNDS, nominal=SIZES if steps == "nominal" else None)
    np.testing.assert_allclose(sim.state["x"].numpy(), x, rtol=1e-5)
    np.testing.assert_allclose(sim.state["c"].numpy(), c, rtol=1e-5, atol=1e-6)
    for i in CENTERS:
        np.testing.assert_allclose(sim.client_states[i]["c_i"].numpy(), c_i[i],
                                   rtol=1e-5, atol=1e-6)


def test_scaffold_round_zero_is_fedavg():
    # c = c_i = 0: same local steps; equal n_i make FedAvg's n_i-weighted mean SCAFFOLD's plain mean
    scaffold = Simulation(build("scaffold", {}), tasks(equal_sizes=True), x0=[0.5, 0.5])
    fedavg = Simulation(build("fedavg", {}), tasks(equal_sizes=True), x0=[0.5, 0.5])
    for sim in (scaffold, fedavg):
        sim.round([0, 1, 2], lr=0.1, num_clients=4)
    for c in (0, 1, 2):
        assert torch.equal(scaffold.last["train"]["uploads"][c].delta,
                           fedavg.last["train"]["uploads"][c].delta)
    np.testing.assert_allclose(scaffold.state["x"].numpy(), fedavg.state["x"].numpy(), rtol=1e-6)


# ---- FedDyn ----------------------------------------------------------------------------

def test_feddyn_by_hand():
    # N = 1, center 4, one step, lr 0.1, alpha 0.1. Round 1: g = -4 at w = x = 0 -> w = 0.4;
    #   grad_l = -0.04; h = -0.04; x = 0.4 + 0.04 / 0.1 = 0.8 (FedAvg: 0.4).
    # Round 2: g = (0.8 - 4) + 0.04 + 0 = -3.16 -> w = 1.116; grad_l = h = -0.0716; x = 1.832.
    sim = Simulation(build("feddyn", {"alpha": 0.1}), {0: quadratic_task(0, [4.0])}, x0=[0.0])
    sim.round([0], t=0, lr=0.1, num_clients=1)
    np.testing.assert_allclose(sim.state["x"].numpy(), [0.8], rtol=1e-6)
    np.testing.assert_allclose(sim.state["h"].numpy(), [-0.04], rtol=1e-6)
    sim.round([0], t=1, lr=0.1, num_clients=1)
    np.testing.assert_allclose(sim.state["x"].numpy(), [1.832], rtol=1e-6)
    np.testing.assert_allclose(sim.client_states[0]["grad_l"].numpy(), [-0.0716], rtol=1e-6)


def test_feddyn_matches_numpy_recursion():
    alpha, lr, n = 0.3, 0.1, len(CENTERS)
    sim = Simulation(build("feddyn", {"alpha": alpha}), tasks(), x0=[0.5, 0.5])
    for t, who in enumerate(ROUNDS):
        sim.round(who, t=t, lr=lr, num_clients=n)
    x, h = np.array([0.5, 0.5]), np.zeros(2)
    grad_l = {i: np.zeros(2) for i in CENTERS}
    for who in ROUNDS:
        w = {}
        for i in who:
            w[i] = local_gd(x, np.array(CENTERS[i]), STEPS[i], lr,
                            lambda v: alpha * (v - x) - grad_l[i])
            grad_l[i] = grad_l[i] - alpha * (w[i] - x)
        h = h - alpha / n * sum(w[i] - x for i in who)
        x = np.mean([w[i] for i in who], axis=0) - h / alpha
    np.testing.assert_allclose(sim.state["x"].numpy(), x, rtol=1e-5)
    np.testing.assert_allclose(sim.state["h"].numpy(), h, rtol=1e-5)
    for i in CENTERS:
        np.testing.assert_allclose(sim.client_states[i]["grad_l"].numpy(), grad_l[i], rtol=1e-5)


def test_feddyn_round_zero_with_one_step_is_an_extrapolated_fedavg():
    # grad_l = 0 and the prox term vanishes at w = x: the local step is FedAvg's, and
    # x^1 = mean w_i - h/alpha = x^0 + (1 + S/N) mean Delta_i, whatever alpha is.
    one_step = {c: 1 for c in CENTERS}
    fedavg = Simulation(build("fedavg", {}), tasks(equal_sizes=True, steps=one_step), x0=[0.5, 0.5])
    fedavg.round([0, 1, 2], lr=0.1, num_clients=4)
    step = fedavg.state["x"].numpy() - 0.5
    for alpha in (0.01, 0.1, 1.0):
        dyn = Simulation(build("feddyn", {"alpha": alpha}), tasks(equal_sizes=True, steps=one_step),
                         x0=[0.5, 0.5])
        dyn.round([0, 1, 2], lr=0.1, num_clients=4)
        np.testing.assert_allclose(dyn.state["x"].numpy(), 0.5 + (1 + 3 / 4) * step, rtol=1e-6)


def test_feddyn_converges_to_the_global_optimum_where_fedavg_is_biased():
    # Unequal local steps bias FedAvg's fixed point; FedDyn's is argmin sum_i f_i = mean c_i.
    three = {c: CENTERS[c] for c in (0, 1, 2)}
    optimum = np.mean(list(three.values()), axis=0)
    run = {}
    for name, params in (("feddyn", {"alpha": 1.0}), ("fedavg", {})):
        sim = Simulation(build(name, params), {c: quadratic_task(c, three[c], steps=STEPS[c])
                                               for c in three}, x0=[0.5, 0.5])
        for t in range(200):
            sim.round([0, 1, 2], t=t, lr=0.1, num_clients=3)
        run[name] = sim.state["x"].numpy()
    np.testing.assert_allclose(run["feddyn"], optimum, atol=1e-5)
    assert np.abs(run["fedavg"] - optimum).max() > 0.1


# ---- FedNova ---------------------------------------------------------------------------

def test_fednova_normalizers_by_hand():
    assert normalizer(3) == 3.0
    assert normalizer(3, rho=0.5) == 4.25          # sum of 1, 1.5, 1.75
    assert normalizer(3, eta_mu=0.5) == 1.75       # 1, 1 + 0.5, 1 + 0.5 * 1.5
    assert math.isclose(normalizer(5, rho=0.9), sum((1 - 0.9 ** k) / 0.1 for k in range(1, 6)))


@pytest.mark.parametrize("params", [{}, {"rho": 0.5}, {"mu": 1.0}])
def test_fednova_matches_numpy_recursion(params):
    rho, mu, lr = params.get("rho", 0.0), params.get("mu", 0.0), 0.1
    sim = Simulation(build("fednova", params), tasks(), x0=[0.5, 0.5])
    x = np.array([0.5, 0.5])
    for t, who in enumerate(ROUNDS):
        diag = sim.round(who, t=t, lr=lr, num_clients=4)
        a = np.array([normalizer(STEPS[i], rho, lr * mu) for i in who])
        d = []
        for i in who:
            w, v = x.copy(), np.zeros(2)
            for _ in range(STEPS[i]):
                v = rho * v + (w - np.array(CENTERS[i])) + mu * (w - x)
                w = w - lr * v
            d.append(x - w)
        p = np.array([SIZES[i] for i in who], dtype=float)
        p /= p.sum()
        tau_eff = float(p @ a)
        x = x - tau_eff * sum(p[j] * d[j] / a[j] for j in range(len(who)))
        np.testing.assert_allclose(sim.last["train"]["gathered"]["a"], a, rtol=1e-12)
        assert math.isclose(diag["tau_eff"], tau_eff, rel_tol=1e-12)
        np.testing.assert_allclose(sim.state["x"].numpy(), x, rtol=1e-5)


def test_fednova_with_equal_steps_and_plain_sgd_is_fedavg():
    equal = {c: 3 for c in CENTERS}
    nova = Simulation(build("fednova", {}), tasks(steps=equal), x0=[0.5, 0.5])
    avg = Simulation(build("fedavg", {}), tasks(steps=equal), x0=[0.5, 0.5])
    for t, who in enumerate(ROUNDS):
        nova.round(who, t=t, lr=0.1)
        avg.round(who, t=t, lr=0.1)
        np.testing.assert_allclose(nova.state["x"].numpy(), avg.state["x"].numpy(), rtol=1e-6)


# ---- MOON and the projection head ------------------------------------------------------

def test_model_contrastive_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z_glob = torch.tensor([[3.0, 0.0], [0.0, 1.0]])    # cos 1 for both samples
    z_prev = torch.tensor([[0.0, 1.0], [0.0, -1.0]])   # cos 0 and -1
    # tau 0.5: -log(e^2 / (e^2 + e^0)) = log(1 + e^-2); -log(e^2 / (e^2 + e^-2)) = log(1 + e^-4)
    expected = (math.log1p(math.exp(-2)) + math.log1p(math.exp(-4))) / 2
    assert math.isclose(float(model_contrastive(z, z_glob, z_prev, 0.5)), expected, rel_tol=1e-6)


@pytest.mark.parametrize("name,opts,image", [("cnn", {"hidden": 24, "channels": [2, 4]}, 16),
                                             ("vgg11", {"dropout": 0.0}, 8),
                                             ("resnet18", {"stem": "imagenet"}, 8)])
def test_projection_head_is_appended_after_an_unchanged_backbone(name, opts, image):
    torch.manual_seed(0)
    plain = build_model(name, 3, 10, image, **opts).eval()
    torch.manual_seed(0)
    headed = build_model(name, 3, 10, image, **opts, proj_dim=8).eval()
    a, b = FlatModel(plain).params, FlatModel(headed).params
    assert torch.equal(b[:a.numel()], a)   # same parameters, same order, same init
    f = headed.classifier.in_features
    assert b.numel() - a.numel() == f * f + f + 8 * f + 8
    assert [type(m).__name__ for m in headed.projector] == ["Linear", "ReLU", "Linear"]
    x = torch.randn(2, 3, image, image)
    assert torch.equal(headed(x), plain(x))
    assert headed.project(headed.features(x)).shape == (2, 8)
    assert not hasattr(plain, "projector")


def test_proj_dim_option_is_checked_and_recorded_only_when_given():
    assert "proj_dim" not in check_options("cnn", {})
    assert check_options("vgg11", {"proj_dim": 16})["proj_dim"] == 16
    assert check_options("cnn", {"proj_dim": 0})["proj_dim"] == 0
    for bad in (-1, 2.5, True):
        with pytest.raises(UsageError, match=r"^model.proj_dim must be an integer >= 0"):
            check_options("resnet18", {"proj_dim": bad})


class Batches(ClientData):
    def __init__(self, batches):
        self.items, self.num_samples = batches, sum(len(y) for _, y in batches)

    def batches(self, epochs, batch_size):
        yield from self.items * epochs


def moon_task(proj_dim=6, channels_last=True):
    torch.manual_seed(1)
    module = build_model("cnn", 3, 5, 16, hidden=12, channels=[2, 3], proj_dim=proj_dim)
    flat = FlatModel(module, channels_last=channels_last)
    gen = torch.Generator().manual_seed(2)
    data = Batches([(torch.randn(4, 3, 16, 16, generator=gen), torch.tensor([0, 1, 2, 4]))])
    return ClientTask(0, data, flat, torch.device("cpu")), gen


def test_frozen_copy_keeps_the_nhwc_storage_order():
    task, gen = moon_task()
    twin = frozen_copy(task.model)
    v = torch.randn(task.model.size, generator=gen)
    task.model.load(v)
    twin.load(v)
    x = torch.randn(2, 3, 16, 16, generator=gen)
    assert torch.equal(twin.module(x), task.model.module(x))
    assert not any(p.requires_grad for p in twin.module.parameters()) and not twin.module.training


def test_moon_local_step_matches_a_hand_written_reference():
    mu, tau, lr = 5.0, 0.5, 0.05
    task, gen = moon_task()
    flat = task.model
    x = flat.params.detach().clone()
    prev = x + 0.1 * torch.randn(x.numel(), generator=gen)
    state = {"prev_model": prev, "has_prev": torch.ones(1)}
    upload = build("moon", {"mu": mu, "tau": tau}).local_update(task, {"x": x}, state,
                                                                context(lr=lr))

    def module_at(vec):  # a plain module with standard-layout weights from a storage-order vector
        torch.manual_seed(1)
        m = build_model("cnn", 3, 5, 16, hidden=12, channels=[2, 3], proj_dim=6)
        m.load_state_dict(flat.state_dict_of(vec))
        return m

    local, glob, old = module_at(x), module_at(x), module_at(prev)
    xb, yb = task.data.items[0]
    z = local.project(local.features(xb))
    with torch.no_grad():
        zg, zp = glob.project(glob.features(xb)), old.project(old.features(xb))

    def cos(a, b):
        return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))
    pos, neg = torch.exp(cos(z, zg) / tau), torch.exp(cos(z, zp) / tau)
    loss = F.cross_entropy(local(xb), yb) + mu * (-torch.log(pos / (pos + neg))).mean()
    loss.backward()
    after = flat.state_dict_of(flat.params)
    for name, p in local.named_parameters():
        torch.testing.assert_close(after[name], p.detach() - lr * p.grad, rtol=1e-5, atol=1e-6)
    assert math.isclose(upload.loss, loss.item(), rel_tol=1e-5)
    assert torch.equal(upload.state["prev_model"], flat.params)
    assert upload.state["has_prev"].item() == 1
    assert torch.equal(upload.delta, flat.params - x)


def test_moon_first_participation_is_a_fedavg_step():
    task, _ = moon_task()
    x = task.model.params.detach().clone()
    zeros = {"prev_model": torch.zeros_like(x), "has_prev": torch.zeros(1)}
    moon = build("moon", {}).local_update(task, {"x": x}, zeros, context(lr=0.05))
    fedavg = build("fedavg", {}).local_update(task, {"x": x}, None, context(lr=0.05))
    assert torch.equal(moon.delta, fedavg.delta) and moon.loss == fedavg.loss


def test_moon_without_a_projection_head_names_model_proj_dim():
    task, _ = moon_task(proj_dim=0)
    x = task.model.params.detach().clone()
    state = {"prev_model": torch.zeros_like(x), "has_prev": torch.zeros(1)}
    with pytest.raises(UsageError, match=r"model.proj_dim"):
        build("moon", {}).local_update(task, {"x": x}, state, context())


@pytest.mark.parametrize("name,params,field", [
    ("scaffold", {"steps": "float"}, "algorithm.steps"),
    ("feddyn", {"alpha": 0.0}, "algorithm.alpha"),
    ("fednova", {"rho": 1.0}, "algorithm.rho"),
    ("fednova", {"mu": -1.0}, "algorithm.mu"),
    ("fednova", {"rho": 0.9, "mu": 0.1}, "algorithm.mu"),
    ("moon", {"tau": 0.0}, "algorithm.tau"),
    ("moon", {"mu": -1.0}, "algorithm.mu"),
    ("moon", {"first_participation": "global"}, "algorithm.first_participation")])
def test_bad_parameters_raise_a_usage_error_naming_the_field(name, params, field):
    with pytest.raises(UsageError, match=f"^config field {field}: "):
        build(name, params)


def test_declared_messages():
    assert message_sizes(REGISTRY["scaffold"]) == "down 2d, up 2d"
    assert message_sizes(REGISTRY["feddyn"]) == "down d, up d"
    assert message_sizes(REGISTRY["fednova"]) == "down d, up d + 1"
    assert message_sizes(REGISTRY["moon"]) == "down d, up d"
    assert build("moon", {}).client_state_sizes(7) == {"prev_model": 7, "has_prev": 1}


# ---- through the runtime: FL bytes, and mpirun -n 3 == one process ----------------------

# 6 clients, 4 per round: at least two clients train in both rounds, from stored state.
SMALL = merged(TINY, rounds=2, clients={"num": 6, "per_round": 4}, system={"deterministic": True})
CASES = {"scaffold": ({"name": "scaffold"}, {}, (2, 0, 2, 0)),
         "feddyn": ({"name": "feddyn"}, {}, (1, 0, 1, 0)),
         "fednova": ({"name": "fednova", "rho": 0.5}, {}, (1, 0, 1, 1)),
         "moon": ({"name": "moon"}, {"proj_dim": 16}, (1, 0, 1, 0))}


def small_config(name):
    algorithm, model, _ = CASES[name]
    return merged(SMALL, algorithm=algorithm, model=model)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """(config, experiment) of the single-process deterministic run of each case, run once."""
    tmp = tmp_path_factory.mktemp("single")
    out = {}
    for name in CASES:
        c, exp, run = run_tiny(tmp, name, base=small_config(name))
        run.close()
        out[name] = (c, exp)
    return out


@pytest.mark.parametrize("name", CASES)
def test_fl_bytes_are_the_declared_closed_form(single, name):
    c, exp = single[name]
    down_d, down_1, up_d, up_1 = CASES[name][2]
    with RunFile(c.output_path()) as run:
        rounds = run.rounds()
        assert run.status == "completed"
        per_client_down = (down_d * exp.d + down_1) * 4
        per_client_up = (up_d * exp.d + up_1) * 4
        assert rounds["fl_bytes_down"].tolist() == [0] + [4 * per_client_down] * 2   # 0: round 0
        assert rounds["fl_bytes_up"].tolist() == [0] + [4 * per_client_up] * 2
        assert np.all(run.clients()["bytes_up"] == per_client_up)
        stateful = bool(exp.alg.client_state_sizes(exp.d))
        assert len(exp.store) == (6 if stateful else 0)  # whoever trained has a stored state


def test_moon_is_fedavg_until_a_client_has_a_previous_model(single, tmp_path):
    moon = RunFile(single["moon"][0].output_path())
    _, _, avg = run_tiny(tmp_path, "avg", base=merged(small_config("moon"),
                                                      algorithm={"name": "fedavg"}))
    _, _, mu0 = run_tiny(tmp_path, "mu0", base=merged(small_config("moon"),
                                                      algorithm={"name": "moon", "mu": 0.0}))
    with moon, avg, mu0:
        # round 1: every client is new, so x^1 (and its test loss) is FedAvg's, bit for bit
        assert moon.rounds()["round"][1] == 1
        assert moon.rounds()["test_loss"][1] == avg.rounds()["test_loss"][1]
        assert not np.array_equal(moon.model(), avg.model())
        assert np.array_equal(mu0.model(), avg.model())
        assert moon.config["model"]["proj_dim"] == 16
        assert moon.config["algorithm"]["first_participation"] == "skip"


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    """Every case under one real ``mpirun -n 3``."""
    return mpirun_configs(3, {name: small_config(name) for name in CASES},
                          tmp_path_factory.mktemp("n3"))


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("name", CASES)
def test_mpirun_three_ranks_is_bitwise_the_single_process_run(single, three_ranks, name):
    with RunFile(single[name][0].output_path()) as a, RunFile(three_ranks[name]) as b:
        assert b.status == "completed" and b.attrs["world_size"] == 3
        assert np.array_equal(a.model(), b.model())
        assert np.array_equal(a.rounds()["train_loss"], b.rounds()["train_loss"], equal_nan=True)
        assert np.array_equal(a.rounds()["fl_bytes_up"], b.rounds()["fl_bytes_up"])
