"""The local optimizer: momentum, Nesterov and the learning-rate schedules, against closed
forms on quadratic clients and against torch.optim.SGD; config checks; a real run's lr."""

import math

import numpy as np
import pytest
import torch

from fedmpi import config as cfg
from fedmpi.algorithms import build
from fedmpi.algorithms.local_sgd import sgd_step
from fedmpi.algorithms.schedule import local_factor, round_lr
from fedmpi.comm import LocalComm
from fedmpi.config.schema import TrainConfig
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

from harness import Simulation, context, quadratic_task
from helpers import TINY, merged


def one_client_update(steps, epochs=1, **optimizer) -> float:
    """FedAvg, one client with f(w) = (w - 1)^2 / 2 from w = 0: the trained model (eta_g 1)."""
    sim = Simulation(build("fedavg", {}), {0: quadratic_task(0, [1.0], steps=steps)}, x0=[0.0])
    sim.round([0], local_epochs=epochs, **optimizer)
    return float(sim.state["x"][0])


def test_heavy_ball_two_steps_closed_form():
    # g0 = -1: v1 = -1, w1 = eta;  g1 = eta - 1: v2 = -mu + eta - 1, w2 = eta (2 - eta + mu)
    eta, mu = 0.1, 0.9
    w = one_client_update(2, lr=eta, momentum=mu)
    assert w == pytest.approx(eta * (2 - eta + mu), rel=1e-6)
    assert one_client_update(2, lr=eta) == pytest.approx(eta * (2 - eta), rel=1e-6)


def test_nesterov_two_steps_closed_form():
    # w1 = eta (1 + mu);  g1 = w1 - 1, v2 = -mu + g1, w2 = w1 - eta (g1 + mu v2)
    eta, mu = 0.1, 0.9
    w1 = eta * (1 + mu)
    g1 = w1 - 1
    expected = w1 - eta * (g1 + mu * (-mu + g1))
    assert one_client_update(2, lr=eta, momentum=mu, nesterov=True) == pytest.approx(expected,
                                                                                     rel=1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_step_is_torch_sgd_with_weight_decay(nesterov):
    torch.manual_seed(0)
    ours, ref = torch.randn(7), None
    ref = ours.clone().requires_grad_(True)
    opt = torch.optim.SGD([ref], lr=0.05, momentum=0.8, weight_decay=0.01, nesterov=nesterov)
    velocity = torch.zeros(7)
    for _ in range(5):
        target = torch.randn(7)
        opt.zero_grad()
        (ref - target).square().sum().backward()
        opt.step()
        grads = 2 * (ours - target)
        sgd_step(ours, grads, 0.05, 0.01, 0.0, velocity, 0.8, nesterov)
    assert torch.allclose(ours, ref.detach(), atol=1e-6)


def test_momentum_clips_the_gradient_before_the_buffer():
    # ||g|| = 5, clip 1: the buffer takes (0.6, 0.8), weight decay outside the clipping
    w, v = torch.tensor([1.0, -1.0]), torch.tensor([1.0, 1.0])
    sgd_step(w, torch.tensor([3.0, 4.0]), 0.5, 0.1, 1.0, v, 0.5)
    assert torch.allclose(v, torch.tensor([0.5 + 0.6 + 0.1, 0.5 + 0.8 - 0.1]), atol=1e-6)
    assert torch.allclose(w, torch.tensor([1.0 - 0.5 * 1.2, -1.0 - 0.5 * 1.2]), atol=1e-6)


def test_momentum_buffer_starts_at_zero_in_every_local_update():
    # Two rounds of one client from the same model give the same update: no carried buffer.
    sim = Simulation(build("fedavg", {}), {0: quadratic_task(0, [1.0], steps=3)}, x0=[0.0])
    sim.round([0], lr=0.1, momentum=0.9)
    first = float(sim.state["x"][0])
    sim.state["x"].zero_()
    sim.round([0], lr=0.1, momentum=0.9)
    assert float(sim.state["x"][0]) == first


def closed_form(lrs) -> float:
    """Plain SGD on (w - 1)^2 / 2 from 0: w_K = 1 - prod_k (1 - eta_k)."""
    return 1 - float(np.prod([1 - lr for lr in lrs]))


@pytest.mark.parametrize("kind, options, lrs", [
    ("step", {"local_decay": 0.5}, [0.2, 0.2, 0.1, 0.1]),          # 2 epochs of 2 steps
    ("cosine", {}, [0.2 * (1 + math.cos(math.pi * k / 4)) / 2 for k in range(4)]),
    ("constant", {"local_warmup": 3}, [0.2 / 3, 0.4 / 3, 0.2, 0.2]),
])
def test_local_schedules_closed_form(kind, options, lrs):
    w = one_client_update(2, epochs=2, lr=0.2, local_schedule=kind, **options)
    assert w == pytest.approx(closed_form(lrs), rel=1e-6)


def test_local_factor_values():
    ctx = context(local_schedule="cosine", local_warmup=2)
    assert [local_factor(ctx, k, 2, 4) for k in range(4)] == pytest.approx(
        [0.5, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2])


@pytest.mark.parametrize("fields, expected", [
    ({"lr_decay": 0.9}, [1.0, 0.9, 0.81, 0.729]),
    ({"lr_schedule": "step", "lr_decay": 0.1, "lr_step": 2}, [1.0, 1.0, 0.1, 0.1]),
    ({"lr_schedule": "cosine", "lr_min": 0.2}, [1.0, 0.2 + 0.8 * (1 + math.cos(math.pi / 4)) / 2,
                                                 0.6, 0.2 + 0.8 * (1 + math.cos(3 * math.pi / 4)) / 2]),
    ({"warmup_rounds": 2, "lr_decay": 0.5}, [0.5, 0.5, 0.25, 0.125]),
])
def test_round_schedules_closed_form(fields, expected):
    train = TrainConfig(lr=1.0, **fields)
    assert [round_lr(train, t, 4) for t in range(4)] == pytest.approx(expected)


def test_a_run_records_its_schedule_and_trains_with_momentum(tmp_path):
    values = merged(TINY, output=str(tmp_path / "r.h5"), rounds=3,
                    train={"lr": 0.1, "lr_schedule": "cosine", "lr_min": 0.01, "momentum": 0.9,
                           "nesterov": True, "local_schedule": "step", "local_decay": 0.5},
                    eval={"at_start": False})
    run_experiment(cfg.from_dict(values), LocalComm(), quiet=True)
    with RunFile(tmp_path / "r.h5") as f:
        lr = f.rounds()["lr"]
        assert f.config["train"]["momentum"] == 0.9
    assert lr == pytest.approx([0.01 + 0.09 * (1 + math.cos(math.pi * t / 3)) / 2
                                for t in range(3)])


@pytest.mark.parametrize("key, value, field", [
    ("lr_schedule", "linear", "train.lr_schedule"),
    ("local_schedule", "exp", "train.local_schedule"),
    ("momentum", 1.0, "train.momentum"),
    ("momentum", -0.1, "train.momentum"),
    ("lr_step", 0, "train.lr_step"),
    ("local_decay", 0.0, "train.local_decay"),
    ("warmup_rounds", -1, "train.warmup_rounds"),
])
def test_bad_optimizer_fields_are_refused_by_name(key, value, field):
    with pytest.raises(UsageError, match=f"config field {field}:"):
        cfg.from_dict(merged(TINY, train={key: value}))


def test_nesterov_without_momentum_and_cosine_floor_above_lr_are_refused():
    with pytest.raises(UsageError, match="config field train.nesterov: needs train.momentum"):
        cfg.from_dict(merged(TINY, train={"nesterov": True}))
    with pytest.raises(UsageError, match="config field train.lr_min"):
        cfg.from_dict(merged(TINY, train={"lr_schedule": "cosine", "lr": 0.1, "lr_min": 0.2}))


@pytest.mark.parametrize("name", ["scaffold", "fednova"])
def test_methods_dividing_by_k_eta_refuse_a_local_schedule(name):
    with pytest.raises(UsageError, match=f"train.local_schedule: 'cosine' is not allowed with {name}"):
        cfg.from_dict(merged(TINY, algorithm={"name": name}, train={"local_schedule": "cosine"}))
    cfg.from_dict(merged(TINY, algorithm={"name": name}, train={"momentum": 0.9}))


def test_fednova_counts_train_momentum_in_a_i():
    sim = Simulation(build("fednova", {}), {0: quadratic_task(0, [1.0], steps=4)}, x0=[0.0])
    sim.round([0], lr=0.1, momentum=0.5)
    a = float(sim.last["train"]["gathered"]["a"][0])
    assert a == pytest.approx((4 - 0.5 * (1 - 0.5 ** 4) / 0.5) / 0.5)
    with pytest.raises(UsageError, match="algorithm.rho: must be 0 with train.momentum"):
        cfg.from_dict(merged(TINY, algorithm={"name": "fednova", "rho": 0.5},
                             train={"momentum": 0.9}))
