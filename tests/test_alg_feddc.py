"""FedDC: two rounds by hand, the numpy recursion of the authors' code on quadratic clients
with partial participation, the round-0 reduction, exact FL bytes through the runtime,
and what is refused at config time."""

import numpy as np
import pytest
import torch

from fedmpi import config as cfg
from fedmpi.algorithms import REGISTRY, build, message_sizes
from fedmpi.errors import UsageError

from harness import Simulation, quadratic_task
from helpers import TINY, merged
from test_runtime import run_tiny

CENTERS = {0: [1.0, 0.0], 1: [0.0, 3.0], 2: [-2.0, 1.0], 3: [2.0, 2.0]}
STEPS = {0: 1, 1: 3, 2: 6, 3: 2}
ROUNDS = [[0, 1, 2], [1, 3], [0, 2, 3], [0, 1]]   # partial participation, N = 4


def tasks(steps=STEPS):
    return {c: quadratic_task(c, CENTERS[c], steps=steps[c]) for c in CENTERS}


def test_two_rounds_by_hand():
    # N = 2, client 0 only, f = 0.5 (theta - 4)^2, K = 2, lr 0.5, alpha 0.5.
    # Round 1 (h = c = c_i = 0): g + alpha theta: theta 0 -> 0 + 0.5*4 = 2
    #   -> 2 - 0.5*(-2 + 1) = 2.5;
    #   Delta = 2.5, h_0 = 2.5, c_0 = -2.5 / (2*0.5) = -2.5;
    #   H = 2.5/2 = 1.25, x = 0 + 2.5 + 1.25 = 3.75, c = -2.5/2 = -1.25.
    # Round 2: offset = alpha (h - x) + c - c_i = 0.5*(2.5 - 3.75) - 1.25 + 2.5 = 0.625;
    #   theta 3.75: g = -0.25 + 1.875 + 0.625 = 2.25 -> 2.625: g = -1.375 + 1.3125 + 0.625 = 0.5625
    #   -> 2.34375; Delta = -1.40625, h_0 = 1.09375, c_0 = -2.5 + 1.25 + 1.40625 = 0.15625;
    #   H = 1.25 - 0.703125 = 0.546875, x = 3.75 - 1.40625 + 0.546875 = 2.890625,
    #   c = -1.25 + (0.15625 + 2.5)/2 = 0.078125. (All dyadic: exact in float32.)
    sim = Simulation(build("feddc", {"alpha": 0.5}), {0: quadratic_task(0, [4.0], steps=2)},
                     x0=[0.0])
    sim.round([0], t=0, lr=0.5, num_clients=2)
    assert sim.state["x"].tolist() == [3.75] and sim.state["c"].tolist() == [-1.25]
    assert sim.state["h"].tolist() == [1.25]
    assert sim.client_states[0]["h_i"].tolist() == [2.5]
    assert sim.client_states[0]["c_i"].tolist() == [-2.5]
    assert sim.last["train"]["uploads"][0].extras["delta_c"].tolist() == [-2.5]
    sim.round([0], t=1, lr=0.5, num_clients=2)
    assert sim.state["x"].tolist() == [2.890625] and sim.state["c"].tolist() == [0.078125]
    assert sim.state["h"].tolist() == [0.546875]
    assert sim.client_states[0]["h_i"].tolist() == [1.09375]
    assert sim.client_states[0]["c_i"].tolist() == [0.15625]


def feddc_reference(alpha, lr, rounds, x0=(0.5, 0.5)):
    """utils_methods_FedDC.train_FedDC with every weight_list entry 1, in float64: per
    client, plain GD on 0.5||theta - center||^2 + alpha/2||theta - (w - h_i)||^2
    + <theta, c - c_i>; then h_i += theta - w, c_i+ = c_i - c - (theta - w)/(K lr), and the
    server sets w = mean_S theta_i + mean_all h_i, c += sum_S (c_i+ - c_i) / N."""
    n = len(CENTERS)
    w, c = np.array(x0), np.zeros(2)
    h = {i: np.zeros(2) for i in CENTERS}
    c_i = {i: np.zeros(2) for i in CENTERS}
    for who in rounds:
        thetas, dc_sum = [], np.zeros(2)
        for i in who:
            theta = w.copy()
            for _ in range(STEPS[i]):
                grad = (theta - np.array(CENTERS[i])) + alpha * (theta - (w - h[i])) + (c - c_i[i])
                theta = theta - lr * grad
            h[i] = h[i] + (theta - w)
            new = c_i[i] - c - (theta - w) / (STEPS[i] * lr)
            dc_sum += new - c_i[i]
            c_i[i] = new
            thetas.append(theta)
        w = np.mean(thetas, axis=0) + np.mean([h[i] for i in CENTERS], axis=0)
        c = c + dc_sum / n
    return w, c, h, c_i


def test_matches_the_authors_recursion_under_partial_participation():
    alpha, lr = 0.3, 0.1
    sim = Simulation(build("feddc", {"alpha": alpha}), tasks(), x0=[0.5, 0.5])
    for t, who in enumerate(ROUNDS):
        sim.round(who, t=t, lr=lr, num_clients=4)
    w, c, h, c_i = feddc_reference(alpha, lr, ROUNDS)
    np.testing.assert_allclose(sim.state["x"].numpy(), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sim.state["c"].numpy(), c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sim.state["h"].numpy(), np.mean(list(h.values()), axis=0),
                               rtol=1e-5, atol=1e-6)
    for i in CENTERS:
        for name, ref in (("h_i", h[i]), ("c_i", c_i[i])):
            np.testing.assert_allclose(sim.client_states[i][name].numpy(), ref,
                                       rtol=1e-5, atol=1e-6)


def test_round_zero_with_one_step_is_an_extrapolated_fedavg():
    # h = c = c_i = 0 and the penalty vanishes at theta = w: each client's one step is
    # FedAvg's, and x^1 = mean theta_i + (1/N) sum_S Delta_i = x^0 + (1 + S/N) mean Delta_i
    # whatever alpha is. No setting of FedDC is FedAvg from round 1 on: the server adds
    # the clients' mean drift, and alpha = 0 (refused) would not remove that.
    one_step = {c: 1 for c in CENTERS}
    fedavg = Simulation(build("fedavg", {}), tasks(one_step), x0=[0.5, 0.5])
    fedavg.round([0, 1, 2], lr=0.1, num_clients=4)
    step = fedavg.state["x"].numpy() - 0.5
    for alpha in (0.01, 0.1, 1.0):
        dc = Simulation(build("feddc", {"alpha": alpha}), tasks(one_step), x0=[0.5, 0.5])
        dc.round([0, 1, 2], lr=0.1, num_clients=4)
        for c in (0, 1, 2):
            torch.testing.assert_close(dc.last["train"]["uploads"][c].delta,
                                       fedavg.last["train"]["uploads"][c].delta)
        np.testing.assert_allclose(dc.state["x"].numpy(), 0.5 + (1 + 3 / 4) * step, rtol=1e-6)


def test_control_variates_are_scaffolds():
    # The correction term is SCAFFOLD's option II: at alpha -> 0 the clients' steps and
    # c, c_i follow SCAFFOLD's exactly in round 0 (same x, zero state); the penalty of a
    # small alpha moves them by O(alpha).
    sc = Simulation(build("scaffold", {}), tasks(), x0=[0.5, 0.5])
    dc = Simulation(build("feddc", {"alpha": 1e-30}), tasks(), x0=[0.5, 0.5])
    for sim in (sc, dc):
        sim.round([0, 1, 2], lr=0.1, num_clients=4)
    np.testing.assert_allclose(dc.state["c"].numpy(), sc.state["c"].numpy(), rtol=1e-6)
    for i in (0, 1, 2):
        np.testing.assert_allclose(dc.client_states[i]["c_i"].numpy(),
                                   sc.client_states[i]["c_i"].numpy(), rtol=1e-6)


def test_declared_messages_and_state():
    alg = build("feddc", {})
    assert message_sizes(REGISTRY["feddc"]) == "down 2d, up 2d"
    assert alg.client_state_sizes(7) == {"h_i": 7, "c_i": 7}
    assert set(alg.init_server_state(torch.zeros(7))) == {"x", "c", "h"}
    assert alg.params.alpha == 0.01


# ---- through the runtime ---------------------------------------------------------------

# 6 clients, 4 per round: at least two clients train in both rounds, from stored state.
SMALL = merged(TINY, rounds=2, clients={"num": 6, "per_round": 4}, system={"deterministic": True},
               algorithm={"name": "feddc"})


def test_fl_bytes_are_the_declared_closed_form(tmp_path):
    c, exp, run = run_tiny(tmp_path, "feddc", base=SMALL)
    with run:
        assert run.status == "completed"
        assert run.config["algorithm"] == {"name": "feddc", "alpha": 0.01}
        rounds = run.rounds()
        per_client = 2 * exp.d * 4                      # 2d values of 4 bytes, each way
        assert rounds["fl_bytes_down"].tolist() == [0] + [4 * per_client] * 2
        assert rounds["fl_bytes_up"].tolist() == [0] + [4 * per_client] * 2
        assert np.all(run.clients()["bytes_up"] == per_client)
        assert np.all(np.isfinite(rounds["test_loss"]))
        assert np.all(np.isfinite(run.model()))
    assert len(exp.store) == 6          # whoever trained has a stored h_i, c_i


# ---- refused ---------------------------------------------------------------------------

@pytest.mark.parametrize("params,message", [
    ({"alpha": 0.0}, "config field algorithm.alpha: must be > 0, got 0.0"),
    ({"alpha": -0.01}, "config field algorithm.alpha: must be > 0, got -0.01"),
    ({"alpha": "big"}, "config field algorithm.alpha: expected float, got 'big'"),
    ({"alpha": float("nan")}, "config field algorithm.alpha: must be a finite number, got nan"),
    ({"alpha": float("inf")}, "config field algorithm.alpha: must be a finite number, got inf"),
    ({"mu": 0.1}, "config field algorithm.mu: feddc has no such parameter; allowed: alpha"),
])
def test_bad_parameters_are_one_line(params, message):
    with pytest.raises(UsageError) as err:
        build("feddc", params)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("over,message", [
    ({"train": {"local_schedule": "cosine"}},
     "config field train.local_schedule: 'cosine' is not allowed with feddc (the control "
     "variate's K eta_l"),
    ({"train": {"local_warmup": 3}},
     "config field train.local_warmup: 3 is not allowed with feddc"),
    ({"train": {"global_lr": 0.5}}, "config field train.global_lr: must be 1 with feddc"),
    ({"system": {"client_group": 4}},
     "config field system.client_group: algorithm 'feddc' has no group form"),
    ({"system_model": {"policy": "fedbuff", "profiles": "lognormal", "step_time": 0.05}},
     "config field system_model.policy: asynchronous FL serves methods with FedAvg's server "
     "side; 'feddc' has its own"),
    ({"system_model": {"policy": "fedasync", "profiles": "lognormal", "step_time": 0.05}},
     "config field system_model.policy: asynchronous FL serves methods with FedAvg's server "
     "side; 'feddc' has its own"),
    ({"algorithm": {"name": "fnrfl", "base": "feddc"}, "data": {"public_size": 32}},
     "config field algorithm.base: 'feddc' is not supported"),
])
def test_what_feddc_cannot_serve_is_refused_at_config_time(over, message):
    with pytest.raises(UsageError) as err:
        cfg.from_dict(merged(SMALL, **over))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_adam_local_steps_are_refused():
    if "optimizer" not in {f.name for f in cfg.TrainConfig.__dataclass_fields__.values()}:
        pytest.skip("no train.optimizer in this tree")
    with pytest.raises(UsageError) as err:
        cfg.from_dict(merged(SMALL, train={"optimizer": "adam"}))
    assert str(err.value).startswith("config field train.optimizer: 'adam' is not allowed "
                                     "with 'feddc'") and "\n" not in str(err.value)


def test_momentum_and_the_defaults_are_accepted():
    c = cfg.from_dict(merged(SMALL, train={"momentum": 0.9}))
    assert c.algorithm.params == {"alpha": 0.01}
