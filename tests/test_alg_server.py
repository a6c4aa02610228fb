"""Server-optimizer methods (FedAvgM, FedAdam, FedExP, FedACG) and their piece
``server_opt``: closed forms on quadratic clients, the reductions
between methods, exact FL bytes, mpirun == single process, and the presets."""

import math

import numpy as np
import pytest
import torch

from fedmpi import config as cfg
from fedmpi.algorithms import Upload, build, server_opt
from fedmpi.comm import LocalComm
from fedmpi.data.sources import FASHION_MNIST_DIR
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

from conftest import fedmpi, mpirun_configs, needs_mpi
from harness import Simulation, context, quadratic_task
from helpers import TINY, merged

ALGORITHMS = ["fedavgm", "fedadam", "fedexp", "fedacg"]


def tasks_for(centers, sizes=None, steps=1):
    sizes = sizes or {c: 10 for c in centers}
    return {c: quadratic_task(c, centers[c], steps=steps, num_samples=sizes[c]) for c in centers}


def local_gd(x, center, lr, steps, beta=0.0, anchor=None):
    """K GD steps on 0.5||w - c||^2 + (beta/2)||w - anchor||^2 from x (numpy)."""
    w = np.array(x, dtype=np.float64)
    anchor = w.copy() if anchor is None else anchor
    for _ in range(steps):
        w = w - lr * ((w - center) + beta * (w - anchor))
    return w


# ---- the piece, on its own ------------------------------------------------------------

def test_server_opt_pieces_by_hand():
    sums = {"delta": torch.tensor([3.0, -6.0]), "weight": torch.tensor([3.0])}
    dbar = server_opt.mean_update(sums)
    assert dbar.tolist() == [1.0, -2.0]
    v = torch.tensor([2.0, 2.0])
    assert server_opt.momentum(v, dbar, 0.5).tolist() == [2.0, -1.0] and v.tolist() == [2.0, -1.0]
    # m = 0.1 * (1, -2); v = 0.01 * (1, 4) -> sqrt(v) = (0.1, 0.2); step = m / (sqrt(v) + 0.1)
    m, v = torch.zeros(2), torch.zeros(2)
    step = server_opt.adam(m, v, dbar, 0.9, 0.99, 0.1)
    np.testing.assert_allclose(step.numpy(), [0.1 / 0.2, -0.2 / 0.3], rtol=1e-6)
    # ||dbar||^2 = 5: mean_sq 30 -> 30 / (2 * 5.5) > 1; mean_sq 5 (one client) -> 1
    assert server_opt.extrapolation(30.0, dbar, 0.5) == pytest.approx(30 / 11)
    assert server_opt.extrapolation(5.0, dbar, 0.5) == 1.0


# ---- closed forms on quadratic clients --------------------------------------------------

def test_fedavgm_matches_numpy_momentum():
    centers = {0: [1.0, 0.0], 1: [0.0, 3.0], 2: [-2.0, 1.0]}
    sizes = {0: 10, 1: 30, 2: 60}
    sim = Simulation(build("fedavgm", {"beta": 0.5}), tasks_for(centers, sizes, steps=2), x0=[0.5, 0.5])
    x, v = np.array([0.5, 0.5]), np.zeros(2)
    for t in range(3):
        sim.round([0, 1, 2], t=t, lr=0.1, global_lr=0.8)
        dbar = sum(sizes[c] * (local_gd(x, centers[c], 0.1, 2) - x) for c in centers) / 100
        v = 0.5 * v + dbar
        x = x + 0.8 * v
    np.testing.assert_allclose(sim.state["x"].numpy(), x, rtol=1e-6)
    np.testing.assert_allclose(sim.state["v"].numpy(), v, rtol=1e-6)


def test_fedadam_two_rounds_by_hand():
    # Two equal clients, c0 = (2, 0), c1 = (0, -2), one GD step of lr 0.5: Delta_i = (c_i - x)/2.
    # b1 0.9, b2 0.99, tau 0.05, v0 0, eta_g 1.
    # Round 0 (x = 0): Deltas (1, 0), (0, -1) -> Dbar = (0.5, -0.5); m = 0.1 Dbar = (0.05, -0.05);
    #   v = 0.01 * 0.25 = 0.0025, sqrt(v) = 0.05 -> step = 0.05 / 0.1 = 0.5: x1 = (0.5, -0.5).
    # Round 1: Deltas (0.75, 0.25), (-0.25, -0.75) -> Dbar = (0.25, -0.25);
    #   m = 0.9 * 0.05 + 0.1 * 0.25 = 0.07; v = 0.99 * 0.0025 + 0.01 * 0.0625 = 0.0031;
    #   x2 = 0.5 + 0.07 / (sqrt(0.0031) + 0.05) = 0.5 + 0.07 / 0.1055678 = 1.1623918 (and its negative)
    alg = build("fedadam", {"b1": 0.9, "b2": 0.99, "tau": 0.05, "v0": 0.0, "eta_g": 1.0})
    sim = Simulation(alg, tasks_for({0: [2.0, 0.0], 1: [0.0, -2.0]}), x0=[0.0, 0.0])
    sim.round([0, 1], t=0, lr=0.5)
    np.testing.assert_allclose(sim.state["x"].numpy(), [0.5, -0.5], rtol=1e-6)
    sim.round([0, 1], t=1, lr=0.5)
    x2 = 0.5 + 0.07 / (math.sqrt(0.0031) + 0.05)
    assert x2 == pytest.approx(1.1623918, abs=1e-7)
    np.testing.assert_allclose(sim.state["x"].numpy(), [x2, -x2], rtol=1e-6)
    np.testing.assert_allclose(sim.state["m"].numpy(), [0.07, -0.07], rtol=1e-6)
    np.testing.assert_allclose(sim.state["v"].numpy(), [0.0031, 0.0031], rtol=1e-5)


def test_fedadam_defaults_match_numpy_with_v0_and_weights():
    centers = {0: [1.0, -1.0], 1: [3.0, 0.5]}
    sizes = {0: 20, 1: 60}
    alg = build("fedadam", {})
    p = alg.params
    assert (p.b1, p.b2, p.tau, p.v0, p.eta_g) == (0.9, 0.99, 1e-3, 1e-6, 0.01)
    sim = Simulation(alg, tasks_for(centers, sizes, steps=3), x0=[0.0, 0.0])
    x, m, v = np.zeros(2), np.zeros(2), np.full(2, 1e-6)
    for t in range(3):
        sim.round([0, 1], t=t, lr=0.2)
        dbar = sum(sizes[c] * (local_gd(x, centers[c], 0.2, 3) - x) for c in centers) / 80
        m = 0.9 * m + 0.1 * dbar
        v = 0.99 * v + 0.01 * dbar ** 2
        x = x + 0.01 * m / (np.sqrt(v) + 1e-3)
    np.testing.assert_allclose(sim.state["x"].numpy(), x, rtol=1e-5)


@pytest.mark.parametrize("params, v0", [
    ({}, 1e-6), ({"tau": 0.01}, 1e-4), ({"tau": 0.05}, 0.05 ** 2),
    ({"tau": 0.01, "v0": 0.0}, 0.0), ({"tau": 0.01, "v0": 0.3}, 0.3)])
def test_fedadam_v0_follows_tau_unless_given(params, v0):
    # Reddi et al.'s v^0 = tau^2 convention (FedACG's ServerAdam): the initial second moment
    # is that of the tau in use, not the default tau's 1e-6; an explicit v0 is kept
    alg = build("fedadam", params)
    assert alg.params.v0 == v0
    assert torch.equal(alg.init_server_state(torch.zeros(3))["v"], torch.full((3,), v0))
    # the resolved config stores the value, so a resume or a re-run starts from the same v^0
    c = cfg.from_dict({"algorithm": {"name": "fedadam", **params}})
    assert c.algorithm.params["v0"] == v0
    assert cfg.from_dict(c.to_dict()).algorithm.params["v0"] == v0


def test_fedadam_first_step_uses_v0_of_the_given_tau():
    # one client, c = (1,), one GD step of lr 0.5 from 0: Dbar = 0.5; tau 0.1, v0 = 0.01:
    # m = 0.05, v = 0.99 * 0.01 + 0.01 * 0.25 = 0.0124, x1 = 0.05 / (sqrt(0.0124) + 0.1)
    sim = Simulation(build("fedadam", {"tau": 0.1, "eta_g": 1.0}), tasks_for({0: [1.0]}), x0=[0.0])
    sim.round([0], t=0, lr=0.5)
    np.testing.assert_allclose(sim.state["v"].numpy(), [0.0124], rtol=1e-6)
    np.testing.assert_allclose(sim.state["x"].numpy(), [0.05 / (math.sqrt(0.0124) + 0.1)], rtol=1e-6)


FEDEXP_CENTERS = {0: [2.0, 0.0], 1: [-2.0, 2.0]}


def test_fedexp_step_by_hand():
    # One GD step of lr 0.5 from 0: Delta_0 = (1, 0), Delta_1 = (-1, 1), equal weights.
    # Dbar = (0, 0.5), ||Dbar||^2 = 0.25, mean ||Delta_i||^2 = (1 + 2)/2 = 1.5.
    # eps 0.25: eta_g = 1.5 / (2 (0.25 + 0.25)) = 1.5 -> x1 = (0, 0.75).
    sim = Simulation(build("fedexp", {"eps": 0.25}), tasks_for(FEDEXP_CENTERS), x0=[0.0, 0.0])
    diag = sim.round([0, 1], t=0, lr=0.5)
    assert diag == {"fedexp_step": pytest.approx(1.5)}
    np.testing.assert_allclose(sim.state["x"].numpy(), [0.0, 0.75], rtol=1e-6)
    assert torch.equal(sim.alg.eval_params(sim.state), sim.state["x"])
    # The code's S*eps: 1.5 / (2 (0.25 + 2 * 0.25)) = 1 -> plain FedAvg step, x1 = (0, 0.5).
    code = Simulation(build("fedexp", {"eps": 0.25, "eps_per_client": True}),
                      tasks_for(FEDEXP_CENTERS), x0=[0.0, 0.0])
    assert code.round([0, 1], t=0, lr=0.5)["fedexp_step"] == 1.0
    np.testing.assert_allclose(code.state["x"].numpy(), [0.0, 0.5], rtol=1e-6)


def test_fedexp_eps_decays_like_the_squared_local_lr():
    alg = build("fedexp", {"eps": 0.1, "eps_decay": True, "eps_per_client": True})
    ctx = context(t=3, participants=[0, 1, 2], lr=0.1 * 0.9 ** 3, lr_prev=0.1 * 0.9 ** 2)
    assert alg.epsilon(ctx) == pytest.approx(3 * 0.1 * 0.9 ** 6, rel=1e-12)
    assert build("fedexp", {"eps": 0.1}).epsilon(ctx) == 0.1


def test_fedexp_average_of_last_two_iterates():
    sim = Simulation(build("fedexp", {"eps": 0.25, "average_iterates": True}),
                     tasks_for(FEDEXP_CENTERS), x0=[0.0, 0.0])
    sim.round([0, 1], t=0, lr=0.5)
    x1 = sim.state["x"].clone()
    assert torch.equal(sim.alg.eval_params(sim.state), x1)   # round 0: x^1 itself, as the code
    sim.round([0, 1], t=1, lr=0.5)
    x2 = sim.state["x"]
    assert not torch.equal(x1, x2)
    np.testing.assert_allclose(sim.alg.eval_params(sim.state).numpy(), ((x1 + x2) / 2).numpy(), rtol=1e-7)
    # training continues from x^2, not the average: same x as without the option
    plain = Simulation(build("fedexp", {"eps": 0.25}), tasks_for(FEDEXP_CENTERS), x0=[0.0, 0.0])
    plain.round([0, 1], t=0, lr=0.5)
    plain.round([0, 1], t=1, lr=0.5)
    assert torch.equal(plain.state["x"], x2)


def test_fedacg_matches_numpy_lookahead_momentum_and_prox():
    centers = {0: [1.0, 0.0], 1: [0.0, 3.0], 2: [-2.0, 1.0]}
    sizes = {0: 10, 1: 30, 2: 60}   # ignored: FedACG takes the plain mean
    lam, beta, lr, K = 0.6, 0.5, 0.2, 3
    sim = Simulation(build("fedacg", {"lam": lam, "beta": beta}), tasks_for(centers, sizes, steps=K),
                     x0=[0.5, 0.5])
    x, m = np.array([0.5, 0.5]), np.zeros(2)
    for t in range(3):
        sim.round([0, 1, 2], t=t, lr=lr)
        x_hat = x + lam * m
        clients = [local_gd(x_hat, centers[c], lr, K, beta, anchor=x_hat) for c in centers]
        m = lam * m + sum(w - x_hat for w in clients) / 3
        x = x + m
        np.testing.assert_allclose(sim.state["x"].numpy(), x, rtol=1e-6)
        # x^t is the mean of the client models
        np.testing.assert_allclose(x, sum(clients) / 3, rtol=1e-12)
    np.testing.assert_allclose(sim.state["m"].numpy(), m, rtol=1e-6)
    # evaluation uses x^t; the broadcast is the lookahead
    assert torch.equal(sim.alg.eval_params(sim.state), sim.state["x"])
    payload = sim.alg.payload(sim.state, context())
    np.testing.assert_allclose(payload["x_hat"].numpy(), x + lam * m, rtol=1e-6)


def test_fedacg_repo_prox_form_is_twice_the_paper_beta():
    centers = {0: [1.0, 2.0], 1: [-1.0, 0.0]}
    runs = []
    for params in ({"beta": 0.2, "prox_form": "paper"}, {"beta": 0.1, "prox_form": "repo"}):
        sim = Simulation(build("fedacg", {"lam": 0.5, **params}), tasks_for(centers, steps=3), x0=[0.0, 0.0])
        for t in range(2):
            sim.round([0, 1], t=t, lr=0.3)
        runs.append(sim.state["x"])
    assert torch.equal(runs[0], runs[1])


# ---- reductions -----------------------------------------------

def run_rounds(name, params, centers, sizes, rounds=3, steps=2, lr=0.1):
    sim = Simulation(build(name, params), tasks_for(centers, sizes, steps=steps), x0=[0.5, -0.5])
    for t in range(rounds):
        sim.round(sorted(centers), t=t, lr=lr)
    return sim.state["x"].numpy()


CENTERS = {0: [1.0, 0.0], 1: [0.0, 3.0], 2: [-2.0, 1.0]}


def test_fedavgm_with_beta_zero_is_fedavg():
    sizes = {0: 10, 1: 30, 2: 60}
    np.testing.assert_allclose(run_rounds("fedavgm", {"beta": 0.0}, CENTERS, sizes),
                               run_rounds("fedavg", {}, CENTERS, sizes), rtol=1e-6)


def test_fedacg_with_lambda_and_beta_zero_is_fedavg_on_equal_clients():
    # FedACG takes the plain mean, FedAvg the n_i-weighted one: equal n_i make them agree.
    sizes = {0: 20, 1: 20, 2: 20}
    np.testing.assert_allclose(run_rounds("fedacg", {"lam": 0.0, "beta": 0.0}, CENTERS, sizes),
                               run_rounds("fedavg", {}, CENTERS, sizes), rtol=1e-6)


def test_fedacg_beta_zero_has_the_server_recursion_of_fedavgm():
    """Same client deltas -> same x and momentum; only the broadcast start point differs."""
    lam = 0.85
    acg, avgm = build("fedacg", {"lam": lam, "beta": 0.0}), build("fedavgm", {"beta": lam})
    x0 = torch.tensor([0.5, -1.0, 2.0])
    s_acg, s_avgm = acg.init_server_state(x0), avgm.init_server_state(x0)
    gen = torch.Generator().manual_seed(0)
    for t in range(5):
        uploads = [Upload(delta=torch.randn(3, generator=gen), num_samples=25, loss=0.0, steps=1)
                   for _ in range(4)]
        ctx = context(t, participants=range(4))
        for alg, state in ((acg, s_acg), (avgm, s_avgm)):
            parts = [alg.contribution(u) for u in uploads]
            sums = {k: sum(p[k] for p in parts) for k in parts[0]}
            alg.server_update(state, sums, {}, ctx)
        np.testing.assert_allclose(s_acg["x"].numpy(), s_avgm["x"].numpy(), rtol=1e-6)
        np.testing.assert_allclose(s_acg["m"].numpy(), s_avgm["v"].numpy(), rtol=1e-6)
    ctx = context(5)
    assert torch.equal(avgm.payload(s_avgm, ctx)["x"], s_avgm["x"])
    assert torch.allclose(acg.payload(s_acg, ctx)["x_hat"], s_acg["x"] + lam * s_acg["m"])
    assert not torch.allclose(acg.payload(s_acg, ctx)["x_hat"], s_acg["x"])


def test_fedexp_step_is_at_least_one_and_one_for_a_single_client():
    gen = np.random.default_rng(0)
    centers = {c: gen.normal(size=4).tolist() for c in range(6)}
    sizes = {c: int(gen.integers(5, 50)) for c in range(6)}
    sim = Simulation(build("fedexp", {"eps": 1e-3}), tasks_for(centers, sizes, steps=2), x0=[0.0] * 4)
    steps = [sim.round(sorted(centers), t=t, lr=0.3)["fedexp_step"] for t in range(6)]
    assert min(steps) >= 1.0 and max(steps) > 1.0
    single = Simulation(build("fedexp", {"eps": 1e-3}), {0: tasks_for(centers)[0]}, x0=[0.0] * 4)
    alone = Simulation(build("fedavg", {}), {0: tasks_for(centers)[0]}, x0=[0.0] * 4)
    for t in range(3):
        assert single.round([0], t=t, lr=0.3)["fedexp_step"] == 1.0
        alone.round([0], t=t, lr=0.3)
    np.testing.assert_allclose(single.state["x"].numpy(), alone.state["x"].numpy(), rtol=1e-6)


# ---- parameters ------------------------------------------------------------------------------

@pytest.mark.parametrize("name, params, field", [
    ("fedavgm", {"beta": 1.0}, "algorithm.beta"),
    ("fedadam", {"b2": -0.1}, "algorithm.b2"),
    ("fedadam", {"tau": 0.0}, "algorithm.tau"),
    ("fedadam", {"v0": -1.0}, "algorithm.v0"),
    ("fedadam", {"eta_g": 0.0}, "algorithm.eta_g"),
    ("fedexp", {"eps": 0.0}, "algorithm.eps"),
    ("fedacg", {"lam": 1.0}, "algorithm.lam"),
    ("fedacg", {"beta": -0.1}, "algorithm.beta"),
    ("fedacg", {"prox_form": "halved"}, "algorithm.prox_form"),
])
def test_bad_parameters_are_usage_errors(name, params, field):
    with pytest.raises(UsageError, match=field):
        build(name, params)


def test_algorithms_command_lists_them_with_parameters():
    from click.testing import CliRunner

    from fedmpi.cli import main

    blocks, name = {}, None
    for line in CliRunner().invoke(main, ["algorithms"]).output.splitlines():
        if not line.startswith(" "):
            name = line.split()[0]
        blocks.setdefault(name, []).append(line.strip())
    for name, param in (("fedavgm", "beta = 0.9"), ("fedadam", "tau = 0.001"),
                        ("fedexp", "average_iterates = False"), ("fedacg", "lam = 0.85")):
        assert "messages per client: down d, up d" in blocks[name]
        assert any(line.startswith(f"algorithm.{param} ") for line in blocks[name])
    assert "compressible up: delta; down: x; asynchronous (fedbuff, fedasync): yes" in blocks["fedavg"]
    assert "messages per client: down d_shared, up d_shared (the layers not kept on the " \
        "clients)" in blocks["fedper"]
    assert "compressible up: delta; down: x; asynchronous (fedbuff, fedasync): yes" in blocks["fedper"]
    assert "compressible up: delta, delta_c; down: x, c; asynchronous (fedbuff, fedasync): no" \
        in blocks["scaffold"]
    assert "compressible up: none; down: none; asynchronous (fedbuff, fedasync): no" in blocks["fnrfl"]


# ---- the real runtime: FL bytes, mpirun == single process ---------------------------------

RUN_PARAMS = {"fedavgm": {}, "fedadam": {}, "fedexp": {"average_iterates": True}, "fedacg": {}}


def tiny_values(name, path):
    return merged(TINY, rounds=2, output=str(path), algorithm={"name": name, **RUN_PARAMS[name]},
                  system={"deterministic": True})


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    """Each algorithm on the deterministic TINY config for 2 rounds, in this process."""
    tmp = tmp_path_factory.mktemp("single")
    out = {}
    for name in ALGORITHMS:
        c = cfg.from_dict(tiny_values(name, tmp / f"{name}.h5"))
        exp = run_experiment(c, LocalComm(), quiet=True)
        out[name] = (c, exp.d, c.output_path())
    return out


@pytest.mark.parametrize("name", ALGORITHMS)
def test_fl_bytes_are_d_down_d_up(single_runs, name):
    c, d, path = single_runs[name]
    with RunFile(path) as run:
        assert run.status == "completed"
        rounds = run.rounds()
        per_round = c.clients.per_round * d * 4
        assert rounds["fl_bytes_down"].tolist() == [0] + [per_round] * 2   # 0: round 0
        assert rounds["fl_bytes_up"].tolist() == [0] + [per_round] * 2
        assert np.all(np.isfinite(rounds["test_acc"]))
        if name == "fedexp":
            assert np.isnan(rounds["fedexp_step"][0]) and np.all(rounds["fedexp_step"][1:] >= 1.0)


@pytest.fixture(scope="module")
def three_rank_runs(tmp_path_factory):
    """The same configs under one real ``mpirun -n 3`` (one launch for all: each launch
    costs three torch imports on a 2-core machine)."""
    tmp = tmp_path_factory.mktemp("n3")
    return mpirun_configs(3, {name: tiny_values(name, tmp / f"{name}.h5") for name in ALGORITHMS},
                          tmp)


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("name", ALGORITHMS)
def test_mpirun_three_ranks_is_bitwise_single_process(single_runs, three_rank_runs, name):
    with RunFile(single_runs[name][2]) as a, RunFile(three_rank_runs[name]) as b:
        assert b.status == "completed" and b.attrs["world_size"] == 3
        assert set(b.clients()["rank"].tolist()) == {1, 2}
        assert np.array_equal(a.model(), b.model())
        assert np.array_equal(a.rounds()["test_acc"], b.rounds()["test_acc"])
        assert np.array_equal(a.rounds()["fl_bytes_up"], b.rounds()["fl_bytes_up"])
        if name == "fedexp":
            assert np.array_equal(a.rounds()["fedexp_step"], b.rounds()["fedexp_step"], equal_nan=True)


# ---- presets -------------------------------------------------------------------------------

def test_fedacg_presets_resolve():
    headline = cfg.resolve(preset="fedacg_cifar10")
    assert headline.algorithm.name == "fedacg"
    assert headline.algorithm.params == {"lam": 0.85, "beta": 0.01, "prox_form": "paper"}
    assert (headline.clients.num, headline.clients.per_round, headline.rounds) == (100, 5, 1000)
    assert headline.partition.params["alpha"] == 0.3
    assert headline.model.name == "resnet18" and headline.model.options["stem"] == "cifar"
    t = headline.train
    assert (t.batch_size, t.local_epochs, t.lr, t.lr_decay, t.weight_decay) == (50, 5, 0.1, 0.998, 1e-3)
    small = cfg.resolve(preset="fedacg_fmnist")
    assert small.data.dataset == "fashion_mnist" and small.clients.per_round == 10


@pytest.mark.slow
@pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(), reason="Fashion-MNIST not installed")
def test_fmnist_preset_runs_two_rounds_through_the_cli(tmp_path):
    out = tmp_path / "fmnist.h5"
    # One torch thread: two threads on a busy 2-core machine run ~7x slower (spin waits).
    fedmpi(["run", "-q", "--preset", "fedacg_fmnist", "--set", "rounds=2",
            "--set", "system.threads=1", "-o", str(out)], check=True)
    with RunFile(out) as run:
        assert run.status == "completed"
        assert run.config["algorithm"]["name"] == "fedacg"
        assert run.rounds()["round"].tolist() == [0, 1, 2] and run.rounds()["test_acc"][-1] > 0.1
