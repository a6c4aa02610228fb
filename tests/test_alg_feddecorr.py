"""FedDecorr (supervised, over FedAvg) and FedDecorr-SSL (over a BYOL, SimSiam or SimCLR
client): the regulariser against hand-worked values and an independent correlation
matrix, one local step against plain autograd, the beta = 0 reductions to FedAvg /
FedSimSiam / FedBYOL / FedSimCLR bitwise, real runs with the FL bytes of the closed form,
and bad parameters."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmpi import config as cfgmod
from fedmpi.algorithms import REGISTRY, build, message_sizes
from fedmpi.algorithms.base import ClientData, ClientTask, RoundContext
from fedmpi.algorithms.feddecorr import decorrelation, off_diagonal
from fedmpi.algorithms.ssl_losses import simsiam_loss
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.models import build_model
from fedmpi.results import RunFile

from harness import context
from helpers import SSL, TINY, merged
from test_runtime import run_tiny


# ---- the regulariser --------------------------------------------------------------------

def test_perfectly_correlated_and_uncorrelated_columns_by_hand():
    # three columns, each a multiple of (1, 2, 3) (the last negated): every correlation is
    # +-1. code: h^_j . h^_k = (B - 1) K_jk = +-2, squared 4 on all 6 off-diagonal entries,
    # mean 4, / B = 3 -> 4/3; paper: ||K||_F^2 / F^2 = 9 / 9 = 1.
    z = torch.tensor([[1.0, 2.0, -1.0], [2.0, 4.0, -2.0], [3.0, 6.0, -3.0]])
    assert decorrelation(z, "code").item() == pytest.approx(4 / 3, rel=1e-6)
    assert decorrelation(z, "paper").item() == pytest.approx(1.0, rel=1e-6)
    # two orthogonal centred columns: K = I -> code 0, paper 2 / 2^2 = 0.5
    z = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])
    assert decorrelation(z, "code").item() == pytest.approx(0.0, abs=1e-12)
    assert decorrelation(z, "paper").item() == pytest.approx(0.5, rel=1e-6)


def test_small_z_worked_by_hand():
    # B = 3, F = 2: columns a = (0, 1, 5), b = (1, 0, 2). Centred: a - 2 = (-2, -1, 3),
    # b - 1 = (0, -1, 1); unbiased variances 14/2 = 7 and 2/2 = 1; covariance
    # (0 + 1 + 3)/2 = 2, so rho = 2 / sqrt(7). code: h^_a . h^_b = (B - 1) rho = 4/sqrt(7),
    # squared 16/7 on both off-diagonal entries, mean 16/7, / B -> 16/21.
    # paper: (1 + 1 + 2 rho^2) / 4 = (2 + 8/7) / 4 = 11/14.
    z = torch.tensor([[0.0, 1.0], [1.0, 0.0], [5.0, 2.0]])
    assert decorrelation(z, "code").item() == pytest.approx(16 / 21, rel=1e-6)
    assert decorrelation(z, "paper").item() == pytest.approx(11 / 14, rel=1e-6)


def test_random_z_matches_torch_corrcoef_and_the_authors_layout():
    z = torch.randn(16, 5, generator=torch.Generator().manual_seed(0)) @ \
        torch.randn(5, 5, generator=torch.Generator().manual_seed(1))
    b, f = z.shape
    k = torch.corrcoef(z.double().T)
    off = ~torch.eye(f, dtype=torch.bool)
    code = (b - 1) ** 2 / b * k[off].square().mean()
    paper = k.square().sum() / f ** 2
    assert decorrelation(z, "code").item() == pytest.approx(code.item(), rel=1e-5)
    assert decorrelation(z, "paper").item() == pytest.approx(paper.item(), rel=1e-5)
    # the off-diagonal view picks exactly the entries j != k
    for n in (2, 3, 5):
        m = torch.arange(n * n).reshape(n, n)
        picked = off_diagonal(m).flatten()
        assert sorted(picked.tolist()) == m[~torch.eye(n, dtype=torch.bool)].tolist()


def test_degenerate_batches_give_zero_and_a_dead_unit_no_nan():
    assert decorrelation(torch.randn(1, 4), "code").item() == 0.0
    assert decorrelation(torch.randn(1, 4), "paper").item() == 0.0
    assert decorrelation(torch.randn(5, 1), "code").item() == 0.0       # no pair
    z = torch.randn(6, 3, generator=torch.Generator().manual_seed(2))
    z[:, 1] = 0.0                                                        # a dead ReLU unit
    z.requires_grad_(True)
    for normalisation in ("code", "paper"):
        loss = decorrelation(z, normalisation)
        (grad,) = torch.autograd.grad(loss, z)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_the_two_normalisations_differ_by_the_stated_factor_in_their_gradients():
    # code = (B-1)^2/B mean_off K^2, paper = (F + sum_off K^2)/F^2: gradients in ratio
    # (B-1)^2 F / (B (F-1)) (up to eps on the diagonal)
    z = torch.randn(8, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    z = z.float().requires_grad_(True)
    (g_code,) = torch.autograd.grad(decorrelation(z, "code"), z)
    (g_paper,) = torch.autograd.grad(decorrelation(z, "paper"), z)
    b, f = z.shape
    torch.testing.assert_close(g_code, g_paper * (b - 1) ** 2 * f / (b * (f - 1)),
                               rtol=1e-4, atol=1e-6)


# ---- supervised: one local step, beta = 0 ------------------------------------------------

def reference(h, normalisation):
    """L_decorr written out from its definition (torch.corrcoef would give NaN for a
    dead unit, where the eps of the authors' code gives that unit zero correlations)."""
    b, f = h.shape
    centred = h - h.sum(dim=0) / b
    std = (centred.square().sum(dim=0) / (b - 1) + 1e-8).sqrt()
    k = (centred / std).T @ (centred / std) / (b - 1)
    if normalisation == "paper":
        return k.square().sum() / f ** 2
    off = ~torch.eye(f, dtype=torch.bool)
    return ((b - 1) * k[off]).square().sum() / (f * (f - 1)) / b


class Batches(ClientData):
    def __init__(self, batches):
        self.items, self.num_samples = batches, sum(len(y) for _, y in batches)

    def batches(self, epochs, batch_size):
        yield from self.items * epochs


def cnn_task(channels_last=True):
    torch.manual_seed(1)
    module = build_model("cnn", 3, 5, 16, hidden=12, channels=[2, 3])
    flat = FlatModel(module, channels_last=channels_last)
    gen = torch.Generator().manual_seed(2)
    data = Batches([(torch.randn(6, 3, 16, 16, generator=gen), torch.tensor([0, 1, 2, 4, 3, 1])),
                    (torch.randn(5, 3, 16, 16, generator=gen), torch.tensor([2, 2, 0, 4, 1]))])
    return ClientTask(0, data, flat, torch.device("cpu"))


@pytest.mark.parametrize("normalisation", ["code", "paper"])
def test_beta_zero_is_fedavg_bitwise(normalisation):
    task = cnn_task()
    x = task.model.params.detach().clone()
    ctx = context(lr=0.05, weight_decay=1e-3, grad_clip=10.0)
    avg = build("fedavg", {}).local_update(task, {"x": x}, None, ctx)
    zero = build("feddecorr", {"beta": 0.0, "normalisation": normalisation}).local_update(
        task, {"x": x}, None, ctx)
    on = build("feddecorr", {"normalisation": normalisation}).local_update(task, {"x": x}, None, ctx)
    assert torch.equal(zero.delta, avg.delta) and zero.loss == avg.loss
    assert zero.steps == avg.steps == 2 and zero.num_samples == avg.num_samples == 11
    assert zero.state is None and zero.extras == {}
    assert not torch.equal(on.delta, avg.delta)


@pytest.mark.parametrize("normalisation", ["code", "paper"])
def test_local_step_matches_a_hand_written_reference(normalisation):
    beta, lr = 0.7, 0.05
    task = cnn_task()
    task.data.items = task.data.items[:1]
    task.data.num_samples = 6
    flat = task.model
    x = flat.params.detach().clone()
    upload = build("feddecorr", {"beta": beta, "normalisation": normalisation}).local_update(
        task, {"x": x}, None, context(lr=lr))

    torch.manual_seed(1)   # a plain module with standard-layout weights
    m = build_model("cnn", 3, 5, 16, hidden=12, channels=[2, 3])
    m.load_state_dict(flat.state_dict_of(x))
    xb, yb = task.data.items[0]
    h = m.features(xb)
    assert (h.detach().std(dim=0) == 0).any()   # a dead ReLU unit: the eps case is exercised
    loss = F.cross_entropy(m(xb), yb) + beta * reference(h, normalisation)
    loss.backward()
    after = flat.state_dict_of(flat.params)
    for name, p in m.named_parameters():
        torch.testing.assert_close(after[name], p.detach() - lr * p.grad, rtol=1e-4, atol=1e-6)
    assert math.isclose(upload.loss, loss.item(), rel_tol=1e-5)
    assert torch.equal(upload.delta, flat.params - x)


# ---- self-supervised: reductions and one step -------------------------------------------

HEADS = {"proj_dim": 6, "proj_hidden": 8, "pred_hidden": 5}
B = 4


class FixedViews(ClientData):
    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.v1 = torch.rand(2 * B, 1, 16, 16, generator=g)
        self.v2 = torch.rand(2 * B, 1, 16, 16, generator=g)
        self.y = torch.zeros(2 * B, dtype=torch.long)
        self.num_samples = 2 * B

    def view_batches(self, epochs, batch_size):
        for _ in range(epochs):
            for i in range(0, self.num_samples, batch_size):
                yield (self.v1[i:i + batch_size], self.v2[i:i + batch_size]), self.y[i:i + batch_size]


def ssl_task(name, **params):
    """(algorithm, task) on one tiny SSLNet, built the same for every method with the same
    heads (the model depends only on the heads and the seed)."""
    heads = dict(HEADS)
    if name == "fedsimclr" or params.get("backbone") == "simclr":
        heads.pop("pred_hidden")
    alg = build(name, {**heads, **params})
    torch.manual_seed(0)
    flat = FlatModel(alg.build_model(build_model, "cnn", 1, 10, 16, {"hidden": 8, "channels": [2, 3]}))
    return alg, ClientTask(client=0, data=FixedViews(), model=flat, device=torch.device("cpu"))


def ssl_ctx(lr=0.1):
    return RoundContext(round=0, phase="train", lr=lr, lr_prev=lr, global_lr=1.0,
                        weight_decay=1e-3, grad_clip=10.0, local_epochs=2, batch_size=B,
                        num_clients=1, participants=(0,), seed=0)


def states(alg, x):
    """The empty state (first participation) and a seen one with a target != x."""
    sizes = alg.client_state_sizes(len(x))
    empty = {k: torch.zeros(n) for k, n in sizes.items()}
    if not sizes:
        return [empty]
    g = torch.Generator().manual_seed(5)
    seen = {"target": x[:sizes["target"]] + 0.05 * torch.randn(sizes["target"], generator=g),
            "seen": torch.ones(1)}
    return [empty, seen]


@pytest.mark.parametrize("backbone, baseline", [("simsiam", "fedsimsiam"), ("byol", "fedbyol"),
                                                ("simclr", "fedsimclr")])
def test_ssl_beta_zero_is_the_backbone_bitwise(backbone, baseline):
    base, task = ssl_task(baseline)
    x = task.model.params.detach().clone()
    zero, task0 = ssl_task("feddecorr_ssl", backbone=backbone, beta=0.0)
    on, task1 = ssl_task("feddecorr_ssl", backbone=backbone)
    assert torch.equal(task0.model.params, x) and torch.equal(task1.model.params, x)
    assert zero.client_state_sizes(len(x)) == base.client_state_sizes(len(x))
    for state in states(base, x):
        a = base.local_update(task, {"x": x}, state, ssl_ctx())
        b = zero.local_update(task0, {"x": x}, state, ssl_ctx())
        c = on.local_update(task1, {"x": x}, state, ssl_ctx())
        assert torch.equal(a.delta, b.delta) and a.loss == b.loss and a.steps == b.steps == 4
        assert (a.state is None) == (b.state is None)
        if a.state is not None:
            assert a.state.keys() == b.state.keys()
            assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
        assert not torch.equal(a.delta, c.delta)


def test_ssl_simsiam_step_matches_a_hand_written_reference():
    # one step (one batch of B) on the SimSiam loss + beta (L(z1) + L(z2)), L written out
    # (``reference``), on a plain copy of the network
    beta, lr = 0.5, 0.1
    alg, task = ssl_task("feddecorr_ssl", backbone="simsiam", beta=beta)
    task.data.num_samples = B
    x = task.model.params.detach().clone()
    ctx = RoundContext(round=0, phase="train", lr=lr, lr_prev=lr, global_lr=1.0,
                       weight_decay=0.0, grad_clip=0.0, local_epochs=1, batch_size=B,
                       num_clients=1, participants=(0,), seed=0)
    upload = alg.local_update(task, {"x": x}, {}, ctx)

    m = copy.deepcopy(task.model.module)
    FlatModel(m).load(x)
    (v1, v2), _ = next(task.data.view_batches(1, B))
    z1, z2 = m.project(v1), m.project(v2)

    reg = reference(z1, "code") + reference(z2, "code")
    loss = simsiam_loss(m.predict(z1), m.predict(z2), z1, z2) + beta * reg
    grads = torch.autograd.grad(loss, list(m.parameters()))
    expected = torch.cat([(p - lr * g).detach().reshape(-1) for p, g in zip(m.parameters(), grads)])
    torch.testing.assert_close(task.model.params, expected, rtol=1e-4, atol=1e-6)
    assert upload.steps == 1 and math.isclose(upload.loss, loss.item(), rel_tol=1e-5)
    assert upload.state is None and alg.client_state_sizes(len(x)) == {}


def test_ssl_byol_keeps_fedbyols_state_and_messages():
    alg, task = ssl_task("feddecorr_ssl")
    assert alg.params.backbone == "byol" and alg.params.beta == 0.1
    d = task.model.size
    ref, _ = ssl_task("fedbyol")
    assert alg.client_state_sizes(d) == ref.client_state_sizes(d)
    assert alg.traffic(d, "train") == (d, d)
    simclr, t = ssl_task("feddecorr_ssl", backbone="simclr")
    assert simclr.client_state_sizes(t.model.size) == {} and t.model.module.predictor is None


# ---- real runs ---------------------------------------------------------------------------

SMALL = merged(TINY, rounds=2, clients={"num": 6, "per_round": 4}, system={"deterministic": True})
SSL_SMALL = merged(SSL, rounds=2)


def check_bytes(run, exp, per_round):
    rounds = run.rounds()
    assert run.status == "completed"
    per_client = exp.d * 4                                  # d values down, d up, float32
    assert rounds["fl_bytes_down"].tolist() == [0] + [per_round * per_client] * 2   # 0: round 0
    assert rounds["fl_bytes_up"].tolist() == [0] + [per_round * per_client] * 2
    assert np.all(run.clients()["bytes_up"] == per_client)
    assert np.all(np.isfinite(rounds["train_loss"][1:]))


def test_supervised_run_completes_with_d_down_d_up_and_no_state(tmp_path):
    c, exp, run = run_tiny(tmp_path, "decorr", base=SMALL, algorithm={"name": "feddecorr"})
    with run:
        check_bytes(run, exp, 4)
        assert run.config["algorithm"] == {"name": "feddecorr", "beta": 0.1, "normalisation": "code"}
        assert len(exp.store) == 0
    # beta = 0 through the runtime: FedAvg's model bit for bit
    _, _, avg = run_tiny(tmp_path, "avg", base=SMALL)
    _, _, zero = run_tiny(tmp_path, "zero", base=SMALL, algorithm={"name": "feddecorr", "beta": 0})
    with avg, zero, RunFile(c.output_path()) as decorr:
        assert np.array_equal(avg.model(), zero.model())
        assert not np.array_equal(avg.model(), decorr.model())


@pytest.mark.parametrize("backbone, stateful", [("byol", True), ("simsiam", False)])
def test_ssl_run_completes_with_d_down_d_up(tmp_path, backbone, stateful):
    c, exp, run = run_tiny(tmp_path, backbone, base=SSL_SMALL,
                           algorithm={"name": "feddecorr_ssl", "backbone": backbone})
    with run:
        check_bytes(run, exp, SSL["clients"]["per_round"])
        assert run.config["algorithm"]["backbone"] == backbone
        assert run.config["algorithm"]["beta"] == 0.1
        assert np.all(np.isfinite(run.rounds()["test_acc"]))   # kNN on the encoder
        assert (len(exp.store) > 0) == stateful


# ---- declarations and bad input ------------------------------------------------------------

def test_declared_messages():
    assert message_sizes(REGISTRY["feddecorr"]) == "down d, up d"
    assert message_sizes(REGISTRY["feddecorr_ssl"]) == "down d, up d"
    assert build("feddecorr", {}).client_state_sizes(7) == {}
    assert REGISTRY["feddecorr"].supervised and not REGISTRY["feddecorr_ssl"].supervised


@pytest.mark.parametrize("name, params, message", [
    ("feddecorr", {"beta": -1.0}, "config field algorithm.beta: must be >= 0, got -1.0"),
    ("feddecorr", {"beta": "big"}, "config field algorithm.beta: expected float, got 'big'"),
    ("feddecorr", {"beta": math.inf}, "config field algorithm.beta: must be a finite number, got inf"),
    ("feddecorr", {"beta": math.nan}, "config field algorithm.beta: must be a finite number, got nan"),
    ("feddecorr", {"normalisation": "both"},
     "config field algorithm.normalisation: 'both' is not allowed; choose one of code, paper"),
    ("feddecorr", {"mu": 0.1}, "config field algorithm.mu: feddecorr has no such parameter"),
    ("feddecorr_ssl", {"beta": -0.5}, "config field algorithm.beta: must be >= 0, got -0.5"),
    ("feddecorr_ssl", {"backbone": "moco"},
     "config field algorithm.backbone: 'moco' is not allowed; choose one of byol, simclr, simsiam"),
    ("feddecorr_ssl", {"normalisation": "none"},
     "config field algorithm.normalisation: 'none' is not allowed; choose one of code, paper"),
    ("feddecorr_ssl", {"temperature": 0.0}, "config field algorithm.temperature: must be > 0, got 0.0"),
    ("feddecorr_ssl", {"tau_ema": 1.5}, "config field algorithm.tau_ema: must be in [0, 1], got 1.5")])
def test_bad_parameters_are_one_line_usage_errors(name, params, message):
    with pytest.raises(UsageError) as err:
        build(name, params)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("base, algorithm", [(SMALL, {"name": "feddecorr"}),
                                             (SSL_SMALL, {"name": "feddecorr_ssl"})])
def test_client_groups_are_refused_at_config_time(base, algorithm):
    values = merged(base, algorithm=algorithm, system={"client_group": 2})
    with pytest.raises(UsageError, match=r"^config field system.client_group: algorithm "
                                         f"'{algorithm['name']}' has no group form"):
        cfgmod.from_dict(values)
