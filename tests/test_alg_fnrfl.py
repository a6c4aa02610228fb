"""FNR-FL: the two phases against a numpy re-derivation on quadratic
clients with a probe model, the faithful regulariser's zero gradient, the base plug-in
(the refined models merged through SCAFFOLD's, FedNova's and FedDyn's own aggregation,
by hand), the public set read without augmentation, exact per-phase FL bytes, and the
real runtime single process vs mpirun -n 3."""

import math
import sys

import numpy as np
import pytest
import torch
from torch import nn

from fedmpi import config as cfg
from fedmpi.algorithms import ClientTask, Upload, build
from fedmpi.algorithms import feature_norms as fn
from fedmpi.algorithms.base import ClientData
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.models import build_model
from fedmpi.results import RunFile

from conftest import mpirun, needs_mpi
from harness import Simulation, StepsData
from test_runtime import run_tiny

# Public set: 2 classes, features phi(x) = x * w (elementwise), logits = phi(x).
PUBLIC_X = np.array([[1.0, 0.2], [0.3, 1.0], [1.0, -0.5], [-0.2, 1.0], [0.6, 0.4]])
PUBLIC_Y = np.array([0, 1, 0, 1, 0])
CENTERS = {0: [1.0, 1.0], 1: [1.0, -1.0], 2: [-1.0, 1.0], 3: [-1.0, -1.0], 4: [2.0, 0.5]}
STEPS = {0: 2, 1: 1, 2: 3, 3: 2, 4: 1}
SIZES = {0: 10, 1: 30, 2: 20, 3: 40, 4: 25}
PUBLIC_STEPS = 2   # batches per public epoch (each the whole set)


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))
        self.classifier = nn.Identity()

    def features(self, x):
        return x * self.w

    def forward(self, x):
        return self.classifier(self.features(x))


class PublicSet(ClientData):
    """The whole public set as each batch, PUBLIC_STEPS batches per epoch."""

    def __init__(self):
        self.x = torch.tensor(PUBLIC_X, dtype=torch.float32)
        self.y = torch.tensor(PUBLIC_Y)
        self.num_samples = len(PUBLIC_Y)

    def batches(self, epochs, batch_size):
        for _ in range(epochs * PUBLIC_STEPS):
            yield self.x, self.y


def probe_task(c):
    center = torch.tensor(CENTERS[c])
    loss = lambda module, x, y: 0.5 * (module.w - center).square().sum()  # noqa: E731
    return ClientTask(c, StepsData(SIZES[c], STEPS[c]), FlatModel(Probe()), torch.device("cpu"),
                      loss, public=PublicSet())


def norms_and_accuracy(w):
    feats = PUBLIC_X * w
    norms = np.linalg.norm(feats, axis=1)
    F = np.array([norms[PUBLIC_Y == label].mean() for label in (0, 1)])
    return F, np.mean(feats.argmax(1) == PUBLIC_Y)


def reference(rounds, x0, lr, p, lam, E_re, over="unselected", mu=0.0):
    """FNR-FL's rules in float64 on the probe clients (all five take part each round)."""
    x = np.asarray(x0, dtype=np.float64)
    clients = sorted(CENTERS)
    log = []
    for _ in range(rounds):
        w = {}
        for i in clients:                       # base: local GD on 0.5||w - c||^2 (+ prox)
            w[i] = x.copy()
            for _ in range(STEPS[i]):
                w[i] = w[i] - lr * ((w[i] - CENTERS[i]) + mu * (w[i] - x))
        F, A = zip(*(norms_and_accuracy(w[i]) for i in clients))
        F, A = np.array(F), np.array(A)
        n = np.array([SIZES[i] for i in clients], dtype=np.float64)
        chosen = np.sort(np.argsort(A, kind="stable")[:math.floor(len(clients) * p)])
        refined, losses, deltas = dict(w), {}, {}
        rho = np.bincount(PUBLIC_Y, minlength=2) / len(PUBLIC_Y)
        for j in chosen:
            others = [m for m in range(len(clients)) if m not in chosen] if over == "unselected" \
                else [m for m in range(len(clients)) if m != j]
            deltas[j] = sum(F[m] - F[j] for m in others) if others else np.zeros(2)
            v, total = w[clients[j]].copy(), 0.0
            for _ in range(E_re * PUBLIC_STEPS):  # constant term: no effect on the step
                total += 0.5 * np.sum((v - CENTERS[clients[j]]) ** 2) + lam * rho @ deltas[j]
                v = v - lr * (v - CENTERS[clients[j]])
            refined[clients[j]] = v
            losses[clients[j]] = total / (E_re * PUBLIC_STEPS)
        x = sum(n[k] * refined[i] for k, i in enumerate(clients)) / n.sum()
        log.append({"x": x.copy(), "A": A, "F": F, "chosen": [clients[j] for j in chosen],
                    "delta": [deltas[j] for j in chosen], "loss": losses})
    return log


CLIENT_STATES = {}   # the last run_probe's client states


def run_probe(params, rounds=2, lr=0.3):
    tasks = {c: probe_task(c) for c in CENTERS}
    sim = Simulation(build("fnrfl", {"num_classes": 2, **params}), tasks, x0=[0.2, 0.1])
    out = []
    for t in range(rounds):
        diag = sim.round(sorted(CENTERS), t=t, lr=lr)
        out.append((sim.state["x"].numpy().copy(), {k: dict(v) for k, v in sim.last.items()}, diag,
                    {k: v.clone() for k, v in sim.state.items()}))
    CLIENT_STATES.clear()
    CLIENT_STATES.update(sim.client_states)
    return out


@pytest.mark.parametrize("over", ["unselected", "all_others"])
def test_two_phases_match_the_numpy_rule(over):
    got = run_probe({"p": 0.5, "lam": 0.7, "refine_epochs": 2, "delta_over": over})
    ref = reference(2, [0.2, 0.1], lr=0.3, p=0.5, lam=0.7, E_re=2, over=over)
    for (x, last, diag, state), r in zip(got, ref):
        train = last["train"]["gathered"]
        np.testing.assert_allclose(train["fnr_public_acc"], r["A"], atol=1e-7)
        np.testing.assert_allclose(train["fnr_feature_norm"], r["F"], rtol=1e-6)
        assert state["fnr_selected"].tolist() == r["chosen"] and len(r["chosen"]) == 2  # floor(5 * 0.5)
        np.testing.assert_allclose(state["fnr_signal"].numpy(), np.array(r["delta"]), rtol=1e-5, atol=1e-6)
        refine = last["refine"]
        assert sorted(refine["uploads"]) == r["chosen"]
        for k, (j, upload) in enumerate(refine["uploads"].items()):
            assert upload.loss == pytest.approx(r["loss"][j], rel=1e-5)   # includes lambda * J
            assert upload.steps == 2 * PUBLIC_STEPS
            rho = np.array([3, 2]) / 5     # every public batch is the whole set
            assert refine["gathered"]["fnr_penalty"][k] == pytest.approx(rho @ r["delta"][k], rel=1e-5)
        np.testing.assert_allclose(x, r["x"], rtol=1e-5, atol=1e-6)
        assert diag["fnr_refined"] == 2


def test_fedprox_base_with_its_parameters():
    got = run_probe({"base": "fedprox", "base_params": {"mu": 0.5}, "p": 0.4, "refine_epochs": 1})
    ref = reference(2, [0.2, 0.1], lr=0.3, p=0.4, lam=1.0, E_re=1, mu=0.5)
    for (x, _, _, state), r in zip(got, ref):
        assert state["fnr_selected"].tolist() == r["chosen"] and len(r["chosen"]) == 2  # floor(5 * 0.4)
        np.testing.assert_allclose(x, r["x"], rtol=1e-5, atol=1e-6)


def test_p_zero_is_the_base_algorithm_exactly():
    fnr = run_probe({"p": 0.0}, rounds=3)
    tasks = {c: probe_task(c) for c in CENTERS}
    avg = Simulation(build("fedavg", {}), tasks, x0=[0.2, 0.1])
    for t, (x, last, diag, _) in enumerate(fnr):
        avg.round(sorted(CENTERS), t=t, lr=0.3)
        assert np.array_equal(x, avg.state["x"].numpy())
        assert last["refine"]["uploads"] == {} and diag["fnr_refined"] == 0


def test_ties_in_accuracy_go_to_the_lower_client_id():
    alg = build("fnrfl", {"num_classes": 2, "p": 0.5})
    state = alg.init_server_state(torch.zeros(3))
    gathered = {"client": np.array([2.0, 5.0, 7.0, 9.0]), "n_samples": np.ones(4),
                "fnr_public_acc": np.array([0.5, 0.25, 0.5, 0.25]),
                "fnr_feature_norm": np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])}
    alg._select(state, gathered)
    assert state["fnr_selected"].tolist() == [5, 9]
    # Delta_5 = (F_2 - F_5) + (F_7 - F_5) = (-2, -2) + (2, 2) = 0; Delta_9 = (-6,-6) + (-2,-2)
    assert state["fnr_signal"].tolist() == [[0.0, 0.0], [-8.0, -8.0]]
    assert alg.phase_participants(state, "refine", np.array([2, 5, 7, 9])).tolist() == [5, 9]
    # the extension's target: Fbar_j = mean of F over S minus S_re = (F_2 + F_7) / 2 = (3, 4)
    ext = build("fnrfl", {"num_classes": 2, "p": 0.5, "regularizer": "differentiable"})
    ext._select(state, gathered)
    assert state["fnr_signal"].tolist() == [[3.0, 4.0], [3.0, 4.0]]


def cnn_batch():
    torch.manual_seed(0)
    flat = FlatModel(build_model("cnn", 1, 10, 16, hidden=16, channels=(4, 8)))
    x = torch.randn(12, 1, 16, 16)
    y = torch.tensor([0, 1, 1, 2, 3, 3, 3, 4, 5, 7, 9, 9])
    return flat, x, y


def refine_grads(flat, x, y, mode, lam, signal):
    flat.zero_grad()
    fn.RefineLoss(mode, lam, signal)(flat.module, x, y).backward()
    return flat.grads.clone()


def test_faithful_regulariser_has_zero_gradient_bit_for_bit():
    flat, x, y = cnn_batch()
    delta = torch.linspace(-3, 5, 10)
    zero = refine_grads(flat, x, y, "faithful", 0.0, delta)
    assert torch.equal(refine_grads(flat, x, y, "faithful", 1.0, delta), zero)
    assert torch.equal(refine_grads(flat, x, y, "faithful", 250.0, delta), zero)
    assert not torch.equal(refine_grads(flat, x, y, "differentiable", 1.0, delta.abs()), zero)


def test_differentiable_penalty_by_hand():
    # classes: 0 -> norms 3, 5 (mean 4); 2 -> norm 1; class 1 absent. rho = (2/3, 0, 1/3).
    feats = torch.tensor([[3.0, 0.0], [0.0, 5.0], [0.6, 0.8]], requires_grad=True)
    y = torch.tensor([0, 0, 2])
    target = torch.tensor([6.0, 100.0, 0.0])
    value = fn.differentiable_penalty(feats, y, target)
    assert float(value.detach()) == pytest.approx(2 / 3 * (6 - 4) ** 2 + 1 / 3 * (0 - 1) ** 2)
    value.backward()
    # d/d||f_0|| = 2/3 * 2 (4 - 6) * 1/2 = -4/3, along f_0 / ||f_0|| = (1, 0)
    assert feats.grad[0].tolist() == pytest.approx([-4 / 3, 0.0])


def test_constant_penalty_by_hand():
    y = torch.tensor([0, 0, 1, 3])
    assert float(fn.constant_penalty(y, torch.tensor([2.0, -4.0, 9.0, 8.0]))) == pytest.approx(0.5 * 2 - 0.25 * 4 + 0.25 * 8)


# ---- the merge through the base's own aggregation ---------------------------------------

def base_reference(base, rounds, x0, lr, p, E_re, alpha=0.1, N=10, substitute=True):
    """SCAFFOLD, FedNova or FedDyn on the probe clients (all five each round), the refined
    models put in place of the trained ones in the base's own server rule, float64.
    ``substitute`` False: the base's round without the refined models (a control)."""
    x, c, h = (np.asarray(x0, dtype=np.float64), np.zeros(2), np.zeros(2))
    clients = sorted(CENTERS)
    c_i = {i: np.zeros(2) for i in clients}
    grad_l = {i: np.zeros(2) for i in clients}
    n = np.array([SIZES[i] for i in clients], dtype=np.float64)
    log = []
    for _ in range(rounds):
        w, dc = {}, {}
        for i in clients:
            v, center = x.copy(), np.array(CENTERS[i])
            for _ in range(STEPS[i]):
                g = v - center
                if base == "scaffold":
                    g = g + c - c_i[i]
                if base == "feddyn":
                    g = g + alpha * (v - x) - grad_l[i]
                v = v - lr * g
            w[i] = v
            if base == "scaffold":
                new = c_i[i] - c + (x - v) / (STEPS[i] * lr)
                dc[i], c_i[i] = new - c_i[i], new
            if base == "feddyn":
                grad_l[i] = grad_l[i] - alpha * (v - x)
        A = np.array([norms_and_accuracy(w[i])[1] for i in clients])
        chosen = [clients[j] for j in np.sort(np.argsort(A, kind="stable")[:math.floor(5 * p)])]
        final, a = dict(w), {i: float(STEPS[i]) for i in clients}
        for j in chosen if substitute else []:
            v = w[j].copy()
            for _ in range(E_re * PUBLIC_STEPS):           # the refinement: plain GD steps
                v = v - lr * (v - np.array(CENTERS[j]))
            final[j] = v
            a[j] += E_re * PUBLIC_STEPS                     # FedNova: a_re of plain SGD = K_re
            if base == "feddyn":
                grad_l[j] = grad_l[j] - alpha * (v - w[j])  # = old grad_l - alpha (w_j' - x)
        W = np.array([final[i] for i in clients])
        if base == "scaffold":       # x += mean_S (y_i - x), c += sum Delta c / N
            x, c = x + (W - x).mean(axis=0), c + sum(dc.values()) / N
        elif base == "fednova":      # x -= tau_eff sum p_i d_i, d_i = (x - w_i) / a_i
            q, av = n / n.sum(), np.array([a[i] for i in clients])
            x = x - (q @ av) * (q[:, None] * (x - W) / av[:, None]).sum(axis=0)
        else:                        # FedDyn: h -= alpha/N sum (w_i - x), x = mean w - h/alpha
            h = h - alpha / N * (W - x).sum(axis=0)
            x = W.mean(axis=0) - h / alpha
        log.append({"x": x.copy(), "c": c.copy(), "h": h.copy(), "chosen": chosen,
                    "c_i": {i: v.copy() for i, v in c_i.items()},
                    "grad_l": {i: v.copy() for i, v in grad_l.items()},
                    "a": [a[i] for i in chosen]})
    return log


@pytest.mark.parametrize("base", ["scaffold", "fednova", "feddyn"])
def test_refined_models_go_through_the_base_aggregation(base):
    """Two rounds (the second starts from the merged x, c_i, grad L_i): x and the base's
    server state are the base's rule with w_j' in place of w_j, by hand."""
    got = run_probe({"base": base, "p": 0.5, "refine_epochs": 2})
    ref = base_reference(base, 2, [0.2, 0.1], lr=0.3, p=0.5, E_re=2)
    plain = base_reference(base, 2, [0.2, 0.1], lr=0.3, p=0.5, E_re=2, substitute=False)
    for t, ((x, last, diag, state), r) in enumerate(zip(got, ref)):
        assert state["fnr_selected"].tolist() == r["chosen"] and len(r["chosen"]) == 2
        np.testing.assert_allclose(x, r["x"], rtol=1e-5, atol=1e-6)
        assert not np.allclose(x, plain[t]["x"], rtol=1e-3)   # the refinement moved it
        if base == "scaffold":      # c and c_i: the train phase's (Delta c_j unchanged)
            np.testing.assert_allclose(state["c"].numpy(), r["c"], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(state["c"].numpy(), plain[t]["c"] if t == 0 else r["c"],
                                       rtol=1e-5, atol=1e-6)
        if base == "feddyn":        # h, each grad L_i, and h = (1/N) sum_i grad L_i
            np.testing.assert_allclose(state["h"].numpy(), r["h"], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(state["h"].numpy(), sum(r["grad_l"].values()) / 10,
                                       rtol=1e-5, atol=1e-6)
        if base == "fednova":       # a_j' = a_j + K_re in the refine rows, and tau_eff
            np.testing.assert_allclose(last["refine"]["gathered"]["a"], r["a"])
            q = np.array([SIZES[i] for i in sorted(CENTERS)], dtype=float)
            a = {i: STEPS[i] + (2 * PUBLIC_STEPS if i in r["chosen"] else 0) for i in CENTERS}
            tau = q @ np.array([a[i] for i in sorted(CENTERS)]) / q.sum()
            assert diag["tau_eff"] == pytest.approx(tau)
    if base in ("scaffold", "feddyn"):   # the carried client states after round 2
        key = {"scaffold": "c_i", "feddyn": "grad_l"}[base]
        for i in CENTERS:
            np.testing.assert_allclose(CLIENT_STATES[i][key].numpy(), ref[-1][key][i],
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("base", ["fedavg", "fedprox", "fedsam", "fedavgm", "fedadam", "scaffold",
                                  "fedacg", "fednova", "feddyn"])
def test_merge_is_the_base_server_update_on_the_substituted_uploads(base):
    """Round 2 (server momenta, c, h already non-zero): the global model and the server
    state are the base's own contribution and server_update, from the state before the
    round, on the train uploads with Delta_j + (w_j' - w_j) for the refined j (FedNova:
    with the refine rows' a_j')."""
    from harness import context

    alg = build("fnrfl", {"num_classes": 2, "base": base, "p": 0.5, "refine_epochs": 2})
    sim = Simulation(alg, {c: probe_task(c) for c in CENTERS}, x0=[0.2, 0.1])
    sim.round(sorted(CENTERS), t=0, lr=0.3)
    state = {k: v.clone() for k, v in sim.state.items() if not k.startswith("fnr_")}
    sim.round(sorted(CENTERS), t=1, lr=0.3)
    train, refine = sim.last["train"]["uploads"], sim.last["refine"]["uploads"]
    assert len(refine) == 2
    own, sums, a = build(base, alg.params.base_params), {}, []
    for c, up in sorted(train.items()):
        extras = dict(up.extras)
        if c in refine:
            extras.update({k: refine[c].extras[k] for k in ("a",) if k in refine[c].extras})
            up = Upload(delta=up.delta + refine[c].delta, num_samples=up.num_samples, loss=0.0,
                        steps=up.steps, extras=extras)
        a.append(float(extras.get("a", torch.zeros(1))))
        for k, v in own.contribution(up).items():
            sums[k] = sums.get(k, 0) + v
    clients = sorted(train)
    gathered = {"client": np.array(clients, dtype=float), "a": np.array(a),
                "n_samples": np.array([train[c].num_samples for c in clients], dtype=float),
                "steps": np.array([train[c].steps for c in clients], dtype=float)}
    own.server_update(state, sums, gathered, context(1, clients, lr=0.3))
    for k, v in state.items():
        np.testing.assert_allclose(sim.state[k].numpy(), v.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("base", ["scaffold", "fednova", "feddyn", "moon"])
def test_p_zero_is_each_base_bit_for_bit(base):
    """Nobody refined: the round is the base's own, not a re-run of it."""
    if base == "moon":   # MOON needs a projection head, the probe has none: declarations only
        alg = build("fnrfl", {"base": "moon", "p": 0.0})
        assert alg.client_state_sizes(7) == {"prev_model": 7, "has_prev": 1, "fnr_model": 7}
        return
    fnr = run_probe({"base": base, "p": 0.0}, rounds=2)
    tasks = {c: probe_task(c) for c in CENTERS}
    own = Simulation(build(base, {}), tasks, x0=[0.2, 0.1])
    for t, (x, _, _, state) in enumerate(fnr):
        own.round(sorted(CENTERS), t=t, lr=0.3)
        assert np.array_equal(x, own.state["x"].numpy())
        for k in own.state:
            assert torch.equal(state[k], own.state[k]), k


def test_refine_declarations_per_base():
    alg = build("fnrfl", {"num_classes": 10, "base": "fednova"})
    assert alg.traffic(1000, "refine") == (10, 1001)      # w_j' - w_j and a_j'
    assert alg.gather_sizes(1000, "refine") == {"fnr_penalty": 1, "a": 1}
    assert alg.client_state_sizes(1000) == {"fnr_model": 1000, "fnr_a": 1}
    for base in ("scaffold", "feddyn", "fedavg", "fedprox"):
        assert build("fnrfl", {"num_classes": 10, "base": base}).traffic(1000, "refine") == (10, 1000)


@pytest.mark.parametrize("params, message", [
    ({"base": "fnrfl"}, "algorithm.base"), ({"base": "nope"}, "algorithm.base"),
    ({"base": "fedcm"}, r"^config field algorithm.base: 'fedcm' is not supported; choose one of "
                        r"fedavg, fedprox, fedsam, fedavgm, fedadam, moon, scaffold, fedacg, "
                        r"fednova, feddyn \(the bases whose aggregation the refined models can go "
                        r"through\)$"),
    ({"base_params": {"mu": -1.0}}, "algorithm.base_params"),
    ({"base": "fedprox", "base_params": {"nu": 1.0}}, "algorithm.base_params"),
    ({"p": 1.5}, "algorithm.p"), ({"lam": -1.0}, "algorithm.lam"),
    ({"delta_over": "some"}, "algorithm.delta_over"), ({"regularizer": "soft"}, "algorithm.regularizer"),
    ({"regularizer": "differentiable", "p": 1.0}, "algorithm.p"), ({"refine_epochs": 0}, "algorithm.refine_epochs"),
])
def test_bad_parameters_are_one_line_usage_errors(params, message):
    with pytest.raises(UsageError, match=message):
        build("fnrfl", params)


def test_base_params_resolve_and_round_trip_through_toml():
    import tomllib

    c = cfg.from_dict(tomllib.loads('[data]\npublic_size = 100\n[algorithm]\nname = "fnrfl"\n'
                                    'base = "fedprox"\n[algorithm.base_params]\nmu = 0.1\n'))
    assert c.algorithm.params["base_params"] == {"mu": 0.1}
    fedprox = {"algorithm": {"name": "fnrfl", "base": "fedprox"}, "data": {"public_size": 100}}
    assert cfg.from_dict(fedprox).algorithm.params["base_params"] == {"mu": 0.01}   # written out
    again = cfg.from_dict(tomllib.loads(cfg.to_toml(c.to_dict())))
    assert again.algorithm.params == c.algorithm.params


def test_the_base_checks_the_local_optimizer_at_config_time():
    """FNR-FL over SCAFFOLD refuses what SCAFFOLD refuses (a local schedule)."""
    fnr = {"algorithm": {"name": "fnrfl", "base": "scaffold"}, "data": {"public_size": 100}}
    with pytest.raises(UsageError, match=r"^config field train.local_schedule: 'cosine' is not "
                                         r"allowed with scaffold"):
        cfg.from_dict({**fnr, "train": {"local_schedule": "cosine"}})
    cfg.from_dict({**fnr, "algorithm": {"name": "fnrfl"}, "train": {"local_schedule": "cosine"}})


def test_no_public_set_is_refused_at_config_time(tmp_path):
    """Before any MPI work or file, not when the first client trains."""
    with pytest.raises(UsageError, match=r"^config field data.public_size: algorithm 'fnrfl' "
                                         r"needs a server-side public set; set it > 0"):
        cfg.from_dict({"algorithm": {"name": "fnrfl"}})


def test_traffic_is_declared_per_phase():
    alg = build("fnrfl", {"num_classes": 10})
    assert alg.traffic(1000, "train") == (1000, 1011) and alg.traffic(1000, "refine") == (10, 1000)


def test_sums_and_rows_are_declared_per_phase():
    """Each phase declares what it really sends, and sends just that (the runtime sums and
    gathers per phase); without a phase, the union: the file's /clients columns."""
    alg = build("fnrfl", {"base": "scaffold", "num_classes": 3})
    d = 7
    assert alg.contribution_sizes(d, "train") == {"delta": d, "weight": 1, "delta_c": d}
    assert alg.contribution_sizes(d, "refine") == {"fnr_refined": d}
    assert alg.contribution_sizes(d) == {"delta": d, "weight": 1, "delta_c": d, "fnr_refined": d}
    assert alg.gather_sizes(d, "train") == {"fnr_feature_norm": 3, "fnr_public_acc": 1}
    assert alg.gather_sizes(d, "refine") == {"fnr_penalty": 1}
    assert alg.gather_sizes(d) == {"fnr_feature_norm": 3, "fnr_public_acc": 1, "fnr_penalty": 1}
    trained = Upload(delta=torch.ones(d), num_samples=2, loss=0.0, steps=1,
                     extras={"delta_c": torch.ones(d), "fnr_feature_norm": torch.ones(3),
                             "fnr_public_acc": torch.ones(1)})
    refined = Upload(delta=torch.ones(d), num_samples=2, loss=0.0, steps=1,
                     extras={"fnr_refined": 2 * torch.ones(d), "fnr_penalty": torch.zeros(1)})
    for upload, phase in ((trained, "train"), (refined, "refine")):
        out = alg.contribution(upload)
        assert {k: v.numel() for k, v in out.items()} == alg.contribution_sizes(d, phase)
        assert set(alg.gather(upload)) == set(alg.gather_sizes(d, phase))


TINY_FNR = dict(data={"public_size": 100}, algorithm={"name": "fnrfl"}, rounds=2)


def test_runtime_fl_bytes_and_refined_clients(tmp_path):
    c, exp, run = run_tiny(tmp_path, "fnr", **TINY_FNR)
    with run:
        d, s, C = exp.d, c.clients.per_round, 10
        r = math.floor(s * 0.5)
        rounds, clients = run.rounds(), run.clients()
        # train: d down, d + C + 1 up per client; refine: C down, d up per refined client
        # round 0, the initial model's evaluation, sends nothing and refines no one
        assert rounds["fl_bytes_down"].tolist() == [0] + [(s * d + r * C) * 4] * 2
        assert rounds["fl_bytes_up"].tolist() == [0] + [(s * (d + C + 1) + r * d) * 4] * 2
        assert np.isnan(rounds["fnr_refined"][0]) and rounds["fnr_refined"][1:].tolist() == [r] * 2
        for t in (1, 2):
            train = (clients["round"] == t) & (clients["phase"] == 0)
            refine = (clients["round"] == t) & (clients["phase"] == 1)
            assert train.sum() == s and refine.sum() == r
            lowest = clients["client"][train][np.argsort(clients["fnr_public_acc"][train], kind="stable")[:r]]
            assert sorted(clients["client"][refine].tolist()) == sorted(lowest.tolist())
            assert np.all(clients["bytes_down"][refine] == C * 4) and np.all(clients["bytes_up"][refine] == d * 4)
            assert np.all(np.isnan(clients["fnr_public_acc"][refine]))
            assert np.all(np.isnan(clients["fnr_penalty"][train]))
            assert np.all(np.isfinite(clients["fnr_penalty"][refine]))


@pytest.mark.parametrize("base", ["fednova", "feddyn"])
def test_runtime_with_a_stateful_or_normalised_base(tmp_path, base):
    """The real runtime: FedNova's refine sends d + 1 (w_j' - w_j, a_j' in the "a" column of
    the refine rows, a_j + K_re); FedDyn's grad L_j goes through the client store."""
    fnr = {**TINY_FNR, "rounds": 1, "algorithm": {"name": "fnrfl", "base": base, "refine_epochs": 1}}
    c, exp, run = run_tiny(tmp_path, base, **fnr)
    with run:
        d, s, C = exp.d, c.clients.per_round, 10
        r, extra = math.floor(s * 0.5), int(base == "fednova")
        up = (s * (d + C + 1 + extra) + r * (d + extra)) * 4
        assert run.rounds()["fl_bytes_up"].tolist() == [0, up]
        assert np.all(np.isfinite(run.model()))
        clients = run.clients()
        refine = clients["phase"] == 1
        assert refine.sum() == r and np.all(clients["bytes_up"][refine] == (d + extra) * 4)
        if base == "fednova":
            train = clients["phase"] == 0
            a = dict(zip(clients["client"][train], clients["a"][train]))
            for j, a_new, k in zip(*(clients[f][refine] for f in ("client", "a", "steps"))):
                assert a_new == a[j] + k     # plain SGD: a = steps


def test_runtime_faithful_lambda_changes_nothing_but_the_logged_loss(tmp_path):
    det = {"deterministic": True}
    _, _, a = run_tiny(tmp_path, "lam0", **{**TINY_FNR, "algorithm": {"name": "fnrfl", "lam": 0.0}}, system=det)
    _, _, b = run_tiny(tmp_path, "lam5", **{**TINY_FNR, "algorithm": {"name": "fnrfl", "lam": 5.0}}, system=det)
    _, _, avg = run_tiny(tmp_path, "avg", **{**TINY_FNR, "algorithm": {"name": "fnrfl", "p": 0.0}}, system=det)
    _, _, fedavg = run_tiny(tmp_path, "fedavg", data={"public_size": 100}, rounds=2, system=det)
    with a, b, avg, fedavg:
        assert np.array_equal(a.model(), b.model())
        refine = a.clients()["phase"] == 1
        assert not np.array_equal(a.clients()["train_loss"][refine], b.clients()["train_loss"][refine])
        assert np.array_equal(a.clients()["fnr_penalty"], b.clients()["fnr_penalty"], equal_nan=True)
        assert not np.array_equal(a.model(), avg.model())
        assert np.array_equal(avg.model(), fedavg.model())   # p = 0: an empty refine phase


def test_public_set_is_read_without_augmentation_whatever_data_augment_says(tmp_path):
    """F_i, A_i and the refinement read D_pub as the authors' code does (test transform, no
    crop/flip): with data.augment on they are bit for bit what they are with it off, on the
    same model, while the clients' own batches are augmented."""
    from fedmpi.comm import LocalComm
    from fedmpi.runtime.experiment import Experiment
    from fedmpi.runtime.phase import round_context

    from helpers import merged

    out, w = {}, None
    for augment in (False, True):
        c = cfg.from_dict(merged(**{**TINY_FNR, "output": str(tmp_path / f"{augment}.h5"),
                                    "algorithm": {"name": "fnrfl", "refine_epochs": 1},
                                    "data": {"public_size": 100, "augment": augment,
                                             "crop_padding": 2}}))
        exp = Experiment(c, LocalComm(), quiet=True)
        exp.setup()   # the world and the tasks, no round
        exp.release()
        w = exp.flat.params.detach().clone() if w is None else w   # one model for both
        exp.flat.load(w)
        client, t, phase = 3, 1, 1
        ctx = round_context(c, t, "refine", [client])
        task = exp.task(client, ctx, phase)
        norms, acc = fn.class_feature_norms(exp.flat.module, task.public, 10)
        payload = {"fnr_clients": torch.tensor([float(client)]), "fnr_signal": torch.linspace(-1, 1, 10)}
        refined = exp.alg.local_update(task, payload, {"fnr_model": w.clone()}, ctx)
        out[augment] = {"public": [x for x, _ in task.public.batches(1, 64)], "norms": norms,
                        "acc": acc, "refined": refined.delta, "loss": refined.loss,
                        "own": [x for x, _ in task.data.batches(1, 64)]}
    plain, augmented = out[False], out[True]
    assert all(torch.equal(a, b) for a, b in zip(plain["public"], augmented["public"]))
    assert torch.equal(plain["norms"], augmented["norms"]) and plain["acc"] == augmented["acc"]
    assert torch.equal(plain["refined"], augmented["refined"]) and plain["loss"] == augmented["loss"]
    assert not all(torch.equal(a, b) for a, b in zip(plain["own"], augmented["own"]))


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("base", ["fedavg", "fednova"])
def test_mpirun_3_is_bitwise_the_single_process_run(tmp_path, base):
    det = {"deterministic": True}
    fnr = {**TINY_FNR, "algorithm": {"name": "fnrfl", "base": base}}
    _, _, single = run_tiny(tmp_path, "single", **fnr, system=det)
    from helpers import write_config
    config = write_config(tmp_path / "fnr.toml", **fnr, system=det)
    mpirun(3, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o", str(tmp_path / "n3.h5")])
    with single, RunFile(tmp_path / "n3.h5") as b:
        assert b.attrs["world_size"] == 3
        assert np.array_equal(single.model(), b.model())
        ca, cb = single.clients(), b.clients()
        assert np.array_equal(ca["client"], cb["client"]) and np.array_equal(ca["phase"], cb["phase"])
        assert np.array_equal(ca["fnr_public_acc"], cb["fnr_public_acc"], equal_nan=True)
        assert np.array_equal(single.rounds()["fnr_refined"], b.rounds()["fnr_refined"], equal_nan=True)
