"""FedMIM: closed form on quadratic clients, the FedCM reduction,
parameter checks, exact FL bytes and cross-rank bit identity in the real runtime."""

import sys

import numpy as np
import pytest
import torch

from fedmpi import config as cfg
from fedmpi.algorithms import build
from fedmpi.errors import UsageError
from fedmpi.results import RunFile

from conftest import mpirun, needs_mpi
from harness import Simulation, quadratic_task
from helpers import write_config
from test_runtime import run_tiny

CENTERS = {0: [1.0, -2.0, 0.5], 1: [-3.0, 1.0, 2.0], 2: [0.5, 4.0, -1.0]}


def fedmim_reference(centers, steps, schedule, alpha, beta, lrs, wd, clip, x0):
    """FedMIM's update in float64: u_j = x^{t-j} - x^{t-j-1}; per step
    w <- w + sum_j alpha_j u_j / K - (1 - A) lr (clip(w + sum_j beta_j u_j / K - c) + wd w),
    clip as local_sgd.sgd_step (factor min(1, clip / (||g|| + 1e-6))); x <- x + mean Delta.
    Returns the global models and each round's local consistency."""
    J, A = len(alpha), sum(alpha)
    x = np.asarray(x0, dtype=np.float64)
    history = [x.copy() for _ in range(J)]          # x^{t-1}, ..., x^{t-J}
    xs, consistency = [], []
    for t, clients in enumerate(schedule):
        snaps = [x] + history
        u = [snaps[j] - snaps[j + 1] for j in range(J)]
        models = []
        for i in clients:
            K, c = steps[i], np.asarray(centers[i])
            inertia = sum(a * uj for a, uj in zip(alpha, u)) / K
            look = sum(b * uj for b, uj in zip(beta, u)) / K
            w = x.copy()
            for _ in range(K):
                g = (w + look) - c
                if clip:
                    g = g * min(1.0, clip / (np.linalg.norm(g) + 1e-6))
                w = w + inertia - (1 - A) * lrs[t] * (g + wd * w)
            models.append(w)
        models = np.array(models)
        consistency.append(np.mean(np.sum((models - models.mean(0)) ** 2, axis=1)))
        history = [x.copy()] + history[:-1]
        x = x + (models - x).mean(0)
        xs.append(x.copy())
    return xs, consistency


def test_fedmim_matches_the_numpy_rule_with_clipping_decay_and_uneven_steps():
    steps = {0: 3, 1: 1, 2: 4}
    schedule = [[0, 1, 2], [0, 2], [1, 2], [0, 1, 2], [0, 1]]
    lrs = [0.3 * 0.9 ** t for t in range(len(schedule))]
    alpha, beta = (0.5, 0.3), (0.8, 0.2)
    tasks = {c: quadratic_task(c, CENTERS[c], steps=steps[c], num_samples=10 + 7 * c) for c in CENTERS}
    sim = Simulation(build("fedmim", {"alpha": list(alpha), "beta": list(beta)}), tasks, x0=[0.2, 0.1, -0.3])
    got = []
    for t, clients in enumerate(schedule):
        diag = sim.round(clients, t=t, lr=lrs[t], lr_prev=lrs[t] / 0.9, weight_decay=0.05, grad_clip=2.0)
        got.append((sim.state["x"].numpy().copy(), diag["fedmim_local_consistency"]))
    xs, consistency = fedmim_reference(CENTERS, steps, schedule, alpha, beta, lrs, 0.05, 2.0, [0.2, 0.1, -0.3])
    for (x, lc), x_ref, lc_ref in zip(got, xs, consistency):
        np.testing.assert_allclose(x, x_ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lc, lc_ref, rtol=1e-4, atol=1e-7)
    # clipping was active (a gradient of norm > 2 at the start) and the history is in the state
    assert np.linalg.norm(np.subtract(CENTERS[1], [0.2, 0.1, -0.3])) > 2
    assert sim.state["history"].shape == (2, 3)


def test_round_zero_has_no_history_and_is_fedavg_with_a_scaled_step():
    # u = 0 in round 0, so one step is w = x - (1 - A) lr (x - c): with A = 0.9, lr = 0.5 and
    # x = 0, c = 4 that is w = 0.05 * 4 = 0.2 (hand-computed).
    sim = Simulation(build("fedmim", {}), {0: quadratic_task(0, [4.0])}, x0=[0.0])
    sim.round([0], lr=0.5)
    assert sim.state["x"].tolist() == pytest.approx([0.2])


def test_lookahead_moves_the_gradient_point_and_inertia_the_iterate():
    # Hand-computed J = 1, alpha = 0.5, beta = 1, one client, K = 1, lr = 1, c = 0.
    # Round 0: x^0 = 2, u = 0: w = 2 - 0.5 * 1 * (2 - 0) = 1 -> x^1 = 1.
    # Round 1: u = x^1 - x^0 = -1; y2 = 1 + 1 * (-1) = 0 -> g = 0;
    #          w = 1 + 0.5 * (-1) - 0.5 * 0 = 0.5 -> x^2 = 0.5.
    alg = build("fedmim", {"J": 1, "alpha": [0.5], "beta": [1.0]})
    sim = Simulation(alg, {0: quadratic_task(0, [0.0])}, x0=[2.0])
    sim.round([0], t=0, lr=1.0)
    assert sim.state["x"].tolist() == [1.0]
    sim.round([0], t=1, lr=1.0)
    assert sim.state["x"].tolist() == [0.5]


def test_reduces_to_fedcm_with_alpha_fedcm_one_minus_alpha_1():
    """A reduction: FedMIM(alpha = (a, 0), beta = 0) == FedCM(alpha = 1 - a) at lr_decay = 1.

    Exact when clients have equal n_i and K (FedCM divides by the round's mean K and
    weights by n_i) and without clipping (FedMIM clips g, FedCM clips the mixed v); with a
    weight decay too, under either placement (tests/test_weight_decay.py)."""
    a = 0.7
    tasks = lambda: {c: quadratic_task(c, CENTERS[c], steps=3, num_samples=20) for c in CENTERS}  # noqa: E731
    mim = Simulation(build("fedmim", {"alpha": [a, 0.0], "beta": [0.0, 0.0]}), tasks(), x0=[0.0, 0.0, 0.0])
    cm = Simulation(build("fedcm", {"alpha": 1 - a}), tasks(), x0=[0.0, 0.0, 0.0])
    reference = fedcm_reference(1 - a, 3, [[0, 1, 2], [0, 2], [1, 2], [0, 1, 2]], lr=0.2)
    for t, clients in enumerate([[0, 1, 2], [0, 2], [1, 2], [0, 1, 2]]):
        mim.round(clients, t=t, lr=0.2)
        cm.round(clients, t=t, lr=0.2)
        np.testing.assert_allclose(mim.state["x"].numpy(), cm.state["x"].numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(mim.state["x"].numpy(), reference[t], rtol=1e-6, atol=1e-6)


def fedcm_reference(alpha_cm, K, schedule, lr, wd=0.0, decay="matched"):
    """FedCM's rule re-derived, quadratic clients, equal K and n: m = -Dbar / (K lr);
    w <- w - lr (alpha g + (1 - alpha) m + c wd w), c = alpha ("matched") or 1 ("code");
    x <- x + Dbar."""
    c = alpha_cm if decay == "matched" else 1.0
    x, dbar, out = np.zeros(3), np.zeros(3), []
    for clients in schedule:
        m = -dbar / (K * lr)
        deltas = []
        for i in clients:
            w = x.copy()
            for _ in range(K):
                w = w - lr * (alpha_cm * (w - np.asarray(CENTERS[i])) + (1 - alpha_cm) * m + c * wd * w)
            deltas.append(w - x)
        dbar = np.mean(deltas, axis=0)
        x = x + dbar
        out.append(x.copy())
    return out


@pytest.mark.parametrize("params, message", [
    ({"alpha": [0.6]}, "algorithm.alpha: needs J = 2"),
    ({"beta": [0.5, 0.2, 0.1]}, "algorithm.beta: needs J = 2"),
    ({"alpha": [0.7, 0.3]}, "algorithm.alpha: sum must be < 1"),
    ({"J": 0}, "algorithm.J"),
    ({"traffic_count": "free"}, "algorithm.traffic_count"),
    ({"alpha": "0.6"}, "algorithm.alpha"),
])
def test_bad_parameters_are_one_line_usage_errors(params, message):
    with pytest.raises(UsageError, match=message):
        build("fedmim", params)


def test_config_file_lists_become_tuples_and_round_trip_through_toml(tmp_path):
    import tomllib

    c = cfg.from_dict({"algorithm": {"name": "fedmim", "J": 3, "alpha": [0.5, 0.2, 0.1],
                                     "beta": [1, 0, 0]}})
    assert c.algorithm.params["alpha"] == (0.5, 0.2, 0.1)
    assert c.algorithm.params["beta"] == (1.0, 0.0, 0.0)
    again = cfg.from_dict(tomllib.loads(cfg.to_toml(c.to_dict())))
    assert again.algorithm.params == c.algorithm.params


@pytest.mark.parametrize("count, down_units", [("honest", 3), ("paper", 1)])
def test_fl_bytes_are_the_declared_closed_form(tmp_path, count, down_units):
    c, exp, run = run_tiny(tmp_path, count, rounds=2, algorithm={"name": "fedmim", "traffic_count": count})
    with run:
        rounds, d, s = run.rounds(), exp.d, c.clients.per_round
        assert run.config["algorithm"]["traffic_count"] == count
        # round 0, the initial model's evaluation, sends nothing and logs no diagnostics
        assert rounds["fl_bytes_down"].tolist() == [0] + [s * down_units * d * 4] * 2
        assert rounds["fl_bytes_up"].tolist() == [0] + [s * d * 4] * 2
        assert np.isnan(rounds["fedmim_local_consistency"][0])
        assert np.all(rounds["fedmim_local_consistency"][1:] > 0)
        assert np.all(run.clients()["bytes_down"] == down_units * d * 4)
        # both counts are stored whichever the ledger carries: (1+J)d and d per client,
        # float32 on the wire (4 bytes a value); J = 2 by default
        assert np.isnan(rounds["fl_bytes_down_honest"][0]) and np.isnan(rounds["fl_bytes_down_paper"][0])
        assert rounds["fl_bytes_down_honest"][1:].tolist() == [(1 + 2) * d * s * 4] * 2
        assert rounds["fl_bytes_down_paper"][1:].tolist() == [d * s * 4] * 2
        assert np.array_equal(rounds["fl_bytes_down"][1:], rounds[f"fl_bytes_down_{count}"][1:])


def test_both_download_counts_follow_j_and_the_participants():
    # harness: d = 3, J = 3, S = 2 then 3 clients
    tasks = {c: quadratic_task(c, CENTERS[c]) for c in CENTERS}
    sim = Simulation(build("fedmim", {"J": 3, "alpha": [0.3, 0.2, 0.1], "beta": [0.5, 0.3, 0.2]}),
                     tasks, x0=[0.0, 0.0, 0.0])
    for clients in ([0, 2], [0, 1, 2]):
        diag = sim.round(clients)
        assert diag["fl_bytes_down_honest"] == len(clients) * (1 + 3) * 3 * 4
        assert diag["fl_bytes_down_paper"] == len(clients) * 3 * 4


@pytest.mark.slow
@needs_mpi
def test_mpirun_3_is_bitwise_the_single_process_run(tmp_path):
    sections = dict(rounds=2, algorithm={"name": "fedmim"}, system={"deterministic": True})
    _, _, single = run_tiny(tmp_path, "single", **sections)
    config = write_config(tmp_path / "mim.toml", **sections)
    mpirun(3, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o", str(tmp_path / "n3.h5")])
    with single, RunFile(tmp_path / "n3.h5") as b:
        assert b.attrs["world_size"] == 3
        assert np.array_equal(single.model(), b.model())
        assert np.array_equal(single.rounds()["fedmim_local_consistency"],
                              b.rounds()["fedmim_local_consistency"], equal_nan=True)


def test_state_is_cpu_tensors_only():
    state = build("fedmim", {}).init_server_state(torch.zeros(4))
    assert set(state) == {"x", "history"} and all(v.device.type == "cpu" for v in state.values())
