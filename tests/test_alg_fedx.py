"""FedX over SimCLR and BYOL: the relational loss by hand, a local update against the four
terms written out with plain torch (which heads, which view, which anchors, BYOL's target
and its EMA), the reductions with the FedX weights 0 (FedSimCLR; FedBYOL on one task and
in real runs, state included), real runs with d/d FL traffic, and the refusals."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmpi import config as cfgmod
from fedmpi.algorithms import build, message_sizes, REGISTRY
from fedmpi.algorithms.base import ClientData, ClientTask
from fedmpi.algorithms.byol import predictor_size
from fedmpi.algorithms.fedx import BACKBONES, relational_loss, with_anchors
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.models import build_model

from harness import context
from helpers import SSL, merged
from test_runtime import run_tiny

HEADS = {"proj_dim": 16, "proj_hidden": 32, "pred_hidden": 16, "head_norm": "layer"}
ZERO = {"lambda_local_rel": 0.0, "lambda_global_con": 0.0, "lambda_global_rel": 0.0}


# ---- the relational loss ----------------------------------------------------------------

def test_relational_loss_by_hand():
    # Row 0: u1 = e1, u2 = e2, anchors e1, e2, T = T' = 1: q1 = (s, 1 - s), q2 = (1 - s, s),
    # s = e / (1 + e), M = (1/2, 1/2); KL(M || q1) = KL(M || q2) = -log 2 - log(s (1 - s)) / 2
    # = log(1 + e) - log 2 - 1/2. Row 1: u1 = u2, so q1 = q2 = M and both KLs are 0.
    u1 = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    u2 = torch.tensor([[0.0, 2.0], [6.0, 8.0]])   # lengths do not matter: cosines
    anchors = torch.tensor([[5.0, 0.0], [0.0, 0.5]])
    row0 = math.log(1 + math.e) - math.log(2) - 0.5
    assert relational_loss(u1, u2, anchors, 1.0, 1.0).item() == pytest.approx(row0 / 2, rel=1e-6)
    assert relational_loss(u1[:1], u2[:1], anchors, 1.0, 1.0).item() == pytest.approx(row0, rel=1e-6)


def test_relational_loss_with_two_temperatures_is_kl_from_the_sharper_mixture():
    # KL(M || q_v) with M from the target temperature T', q_v from T (the code's js_loss);
    # identical views give a positive loss unless T' = T
    u1 = torch.tensor([[1.0, 1.0], [1.0, -2.0]])
    u2 = torch.tensor([[2.0, 0.5], [0.0, 1.0]])
    anchors = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 1.0]])
    t, t2 = 0.5, 0.1

    def cosines(u):
        return [[sum(x * y for x, y in zip(r, a)) / math.hypot(*r) / math.hypot(*a)
                 for a in anchors.tolist()] for r in u.tolist()]

    def softmax(row, temp):
        e = [math.exp(v / temp) for v in row]
        return [v / sum(e) for v in e]

    s1, s2 = cosines(u1), cosines(u2)
    total = 0.0
    for i in range(2):
        m = [(a + b) / 2 for a, b in zip(softmax(s1[i], t2), softmax(s2[i], t2))]
        for s in (s1[i], s2[i]):
            q = softmax(s, t)
            total += sum(mj * math.log(mj / qj) for mj, qj in zip(m, q)) / 2
    got = relational_loss(u1, u2, anchors, t, t2).item()
    assert got == pytest.approx(total / 2, rel=1e-5)
    assert relational_loss(u1, u1, anchors, t, t).item() == pytest.approx(0.0, abs=1e-7)
    assert relational_loss(u1, u1, anchors, t, t2).item() > 1e-3


def test_anchors_are_view_one_of_the_next_batch_and_the_last_wraps():
    batches = [((torch.full((2, 1), float(k)), -torch.full((2, 1), float(k))), torch.tensor([k, k]))
               for k in range(3)]
    out = list(with_anchors(iter(batches)))
    assert [int(v1[0]) for (v1, _, _), _ in out] == [0, 1, 2]        # the stream, in order
    assert [int(a[0]) for (_, _, a), _ in out] == [1, 2, 0]
    assert all(torch.equal(v2, -v1) for (v1, v2, _), _ in out)
    assert list(with_anchors(iter([]))) == []


# ---- one local step by hand ---------------------------------------------------------------

class Views(ClientData):
    """Fixed view batches (no augmentation): what ``view_batches`` yields, in order."""

    def __init__(self, batches):
        self._batches = batches
        self.num_samples = sum(len(y) for _, y in batches)

    def view_batches(self, epochs, batch_size):
        for _ in range(epochs):
            yield from self._batches


def tiny(name, seed=0, **params):
    """(algorithm, flat model) on a tiny SSLNet, the same weights for the same heads."""
    alg = build(name, {**HEADS, **params})
    torch.manual_seed(seed)
    module = alg.build_model(build_model, "cnn", 1, 10, 16, {"hidden": 8, "channels": [2, 3]})
    return alg, FlatModel(module)


def view_batches(sizes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(n, 1, 16, 16, generator=g), torch.randn(n, 1, 16, 16, generator=g)),
             torch.zeros(n, dtype=torch.long)) for n in sizes]


def first_state(alg, d):
    """What the store hands out for a client without state."""
    return {k: torch.zeros(n) for k, n in alg.client_state_sizes(d).items()}


@pytest.mark.parametrize("backbone", BACKBONES)
def test_one_local_update_is_the_four_terms_written_out(backbone):
    byol = backbone == "byol"
    alg, flat = tiny("fedx", backbone=backbone, tau_ema=0.9, temperature=0.5,
                     tau_target_local=0.2, tau_target_global=0.3, lambda_local_rel=0.7,
                     lambda_global_con=1.3, lambda_global_rel=0.4)
    module, x = flat.module, flat.params.clone()
    # sizes 4 and 3: each batch's anchors (view 1 of the other) differ from it in size
    batches = view_batches((4, 3))
    task = ClientTask(client=0, data=Views(batches), model=flat, device=torch.device("cpu"))
    up = alg.local_update(task, {"x": x}, first_state(alg, flat.size), context(lr=0.1))
    assert up.steps == 2 and up.num_samples == 7

    # by hand: the frozen global model is the start (and so is BYOL's target at the first
    # participation); step 1 on batch 0 with the anchors of batch 1 (view 1), step 2 on
    # batch 1 with those of batch 0; BYOL's target EMA after each step
    glob = copy.deepcopy(module)
    FlatModel(glob).load(x)
    local = copy.deepcopy(glob)
    target = glob.target_copy()
    opt = torch.optim.SGD(local.parameters(), lr=0.1)

    def nce(a, b, t):
        n = len(a)
        z = F.normalize(torch.cat([a, b]), dim=1)
        e = torch.exp(z @ z.T / t)
        pos = torch.exp((z[:n] * z[n:]).sum(1) / t).repeat(2)
        return (-torch.log(pos / (e.sum(1) - e.diagonal()))).mean()

    def rel(a, b, r, t, t2):
        sa = F.normalize(a, dim=1) @ F.normalize(r, dim=1).T
        sb = F.normalize(b, dim=1) @ F.normalize(r, dim=1).T
        m = (torch.softmax(sa / t2, 1) + torch.softmax(sb / t2, 1)) / 2
        kl = lambda s: (m * (m.log() - torch.log_softmax(s / t, 1))).sum(1).mean()  # noqa: E731
        return (kl(sa) + kl(sb)) / 2

    def byol_terms(p1, p2, t1, t2):   # 2 - 2 cos, both ways, batch means
        cos = lambda p, q: (p * q).sum(1) / p.norm(dim=1) / q.norm(dim=1)  # noqa: E731
        return (2 - 2 * cos(p1, t2)).mean() + (2 - 2 * cos(p2, t1)).mean()

    for k in range(2):
        (v1, v2), _ = batches[k]
        anchors = batches[1 - k][0][0]
        z1, z2, r = local.project(v1), local.project(v2), local.project(anchors)
        p1, p2 = local.predict(z1), local.predict(z2)
        with torch.no_grad():
            g2, rg = glob.project(v2), glob.project(anchors)
            t1, t2 = target.project(v1), target.project(v2)
        own = byol_terms(p1, p2, t1, t2) if byol else nce(z1, z2, 0.5)
        loss = (own + 0.7 * rel(z1, z2, r, 0.5, 0.2)
                + 1.3 * nce(p1, g2, 0.5) + 0.4 * rel(p1, p2, rg, 0.5, 0.3))
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():   # the target: encoder + projector, the online net's prefix
            for xi, w in zip(target.parameters(), local.parameters()):
                xi.mul_(0.9).add_(w, alpha=0.1)
    w = torch.cat([p.detach().reshape(-1) for p in local.parameters()])
    torch.testing.assert_close(up.delta, w - x, rtol=1e-4, atol=1e-6)
    assert torch.linalg.vector_norm(up.delta) > 0
    if byol:
        xi = torch.cat([p.reshape(-1) for p in target.parameters()])
        assert len(xi) == flat.size - predictor_size(alg.params)
        torch.testing.assert_close(up.state["target"], xi, rtol=1e-4, atol=1e-6)
        assert up.state["seen"].tolist() == [1.0]
    else:
        assert up.state is None


def test_byol_with_the_weights_zero_is_fedbyol_bitwise_on_one_task():
    base, flat_b = tiny("fedbyol")
    zero, flat_z = tiny("fedx", backbone="byol", **ZERO)
    full, flat_f = tiny("fedx", backbone="byol")
    x = flat_b.params.clone()
    d, n = len(x), len(x) - predictor_size(base.params)   # n: the target's size
    assert torch.equal(flat_z.params, x) and torch.equal(flat_f.params, x)
    assert zero.client_state_sizes(d) == base.client_state_sizes(d) == {"target": n, "seen": 1}
    g = torch.Generator().manual_seed(5)   # a returning client: its own target != x
    seen = {"target": x[:n] + 0.05 * torch.randn(n, generator=g), "seen": torch.ones(1)}
    ctx = context(lr=0.1, weight_decay=1e-3, grad_clip=10.0, local_epochs=2)
    for state in (first_state(base, d), seen):
        ups = []
        for alg, flat in ((base, flat_b), (zero, flat_z), (full, flat_f)):
            data = Views(view_batches((4, 4, 2)))
            task = ClientTask(client=0, data=data, model=flat, device=torch.device("cpu"))
            ups.append(alg.local_update(task, {"x": x}, dict(state), ctx))
        a, b, c = ups
        assert torch.equal(a.delta, b.delta) and a.loss == b.loss and a.steps == b.steps == 6
        assert a.state.keys() == b.state.keys() == {"target", "seen"}
        assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
        assert not torch.equal(a.delta, c.delta)
        assert not torch.equal(a.state["target"], c.state["target"])


# ---- real runs ------------------------------------------------------------------------------

def run(tmp_path, tag, name, **algorithm):
    values = merged(SSL, rounds=2)
    values["algorithm"] = {"name": name, **algorithm}   # SSL's is fedbyol's
    return run_tiny(tmp_path, tag, base=values)


def test_weights_zero_is_fedsimclr_bitwise_and_the_default_runs_with_d_d_traffic(tmp_path):
    simclr_heads = {k: v for k, v in HEADS.items() if k != "pred_hidden"}
    _, simclr_exp, simclr = run(tmp_path, "simclr", "fedsimclr", temperature=0.1, **simclr_heads)
    _, zero_exp, zero = run(tmp_path, "zero", "fedx", lambda_local_rel=0.0, lambda_global_con=0.0,
                            lambda_global_rel=0.0, **HEADS)
    c, exp, full = run(tmp_path, "full", "fedx", **HEADS)
    with simclr, zero, full:
        assert zero_exp.d == simclr_exp.d < exp.d   # no predictor without a global term
        assert np.array_equal(simclr.model(), zero.model())
        assert np.array_equal(simclr.rounds()["train_loss"], zero.rounds()["train_loss"],
                              equal_nan=True)
        assert full.status == "completed"
        assert full.config["algorithm"]["lambda_global_rel"] == 1.0
        rounds = full.rounds()
        assert np.all(np.isfinite(rounds["train_loss"][1:]))
        assert np.all(np.isfinite(rounds["test_acc"]))       # the kNN monitor
        per_client = exp.d * 4                               # d down, d up, float32
        per_round = [0] + [c.clients.per_round * per_client] * 2   # 0: round 0
        assert rounds["fl_bytes_down"].tolist() == per_round
        assert rounds["fl_bytes_up"].tolist() == per_round
        assert np.all(full.clients()["bytes_up"] == per_client)
        assert len(exp.store) == 0                           # no client state
        assert not np.array_equal(full.model()[:zero_exp.d], zero.model())


def test_byol_weights_zero_is_fedbyol_bitwise_and_the_default_runs_with_d_d_and_state(tmp_path):
    _, base_exp, base = run(tmp_path, "fedbyol", "fedbyol", **HEADS)
    _, zero_exp, zero = run(tmp_path, "zero", "fedx", backbone="byol", **ZERO, **HEADS)
    c, exp, full = run(tmp_path, "full", "fedx", backbone="byol", **HEADS)
    with base, zero, full:
        assert zero_exp.d == base_exp.d == exp.d              # one predictor: BYOL's
        assert np.array_equal(base.model(), zero.model())
        assert np.array_equal(base.rounds()["train_loss"], zero.rounds()["train_loss"],
                              equal_nan=True)
        assert base_exp.store.clients() == zero_exp.store.clients()
        for (_, a), (_, b) in zip(base_exp.store.items(), zero_exp.store.items()):
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        assert full.status == "completed"
        assert full.config["algorithm"]["backbone"] == "byol"
        rounds = full.rounds()
        assert np.all(np.isfinite(rounds["train_loss"][1:]))
        assert np.all(np.isfinite(rounds["test_acc"]))       # the kNN monitor
        per_client = exp.d * 4                               # d down, d up: the target stays
        per_round = [0] + [c.clients.per_round * per_client] * 2   # 0: round 0
        assert rounds["fl_bytes_down"].tolist() == per_round
        assert rounds["fl_bytes_up"].tolist() == per_round
        assert np.all(full.clients()["bytes_up"] == per_client)
        trained = sorted(set(full.clients()["client"].tolist()))
        assert exp.store.clients() == trained                # whoever trained keeps its target
        assert exp.store.sizes == {"target": exp.d - predictor_size(exp.alg.params), "seen": 1}
        assert all(state["seen"].tolist() == [1.0] for _, state in exp.store.items())
        assert not np.array_equal(full.model(), zero.model())


def test_declared_messages_are_d_d():
    assert message_sizes(REGISTRY["fedx"]) == "down d, up d"
    assert build("fedx", {}).client_state_sizes(100) == {}
    byol, fedbyol = build("fedx", {"backbone": "byol", **HEADS}), build("fedbyol", HEADS)
    assert byol.traffic(10 ** 6, "train") == (10 ** 6, 10 ** 6)
    assert byol.client_state_sizes(10 ** 6) == fedbyol.client_state_sizes(10 ** 6)


def test_defaults_are_the_authors_code():
    p = build("fedx", {}).params
    assert (p.backbone, p.tau_ema) == ("simclr", 0.99)   # tau_ema: byol's target (FedBYOL's)
    assert (p.proj_dim, p.proj_hidden, p.pred_hidden, p.head_norm) == (256, 256, 256, "none")
    assert (p.temperature, p.tau_target_local, p.tau_target_global) == (0.1, 0.1, 0.1)
    assert (p.lambda_local_rel, p.lambda_global_con, p.lambda_global_rel) == (1.0, 1.0, 1.0)


# ---- refusals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("temperature", 0.0, "must be > 0, got 0.0"),
    ("tau_target_local", -0.1, "must be > 0, got -0.1"),
    ("tau_target_global", 0.0, "must be > 0, got 0.0"),
    ("lambda_local_rel", -1.0, "must be >= 0, got -1.0"),
    ("lambda_global_con", -0.5, "must be >= 0, got -0.5"),
    ("lambda_global_rel", -2.0, "must be >= 0, got -2.0"),
    ("proj_dim", 0, "must be >= 1, got 0"),
    ("pred_hidden", 0, "must be >= 1, got 0"),
    ("head_norm", "batch", "'batch' is not allowed"),
    ("backbone", "simsiam", "'simsiam' is not allowed; choose one of simclr, byol"),
    ("backbone", 1, "expected str, got 1"),
    ("tau_ema", 1.5, "got 1.5"),
    ("temperature", "hot", "expected float, got 'hot'"),
])
def test_bad_parameters_are_refused_on_one_line(field, value, message):
    with pytest.raises(UsageError) as err:
        build("fedx", {field: value})
    text = str(err.value)
    assert text.startswith(f"config field algorithm.{field}: ") and message in text
    assert "\n" not in text


@pytest.mark.parametrize("field", ["temperature", "lambda_global_con"])
def test_infinite_and_nan_parameters_are_refused(field):
    for value in (math.inf, math.nan):
        with pytest.raises(UsageError, match=f"algorithm.{field}"):
            build("fedx", {field: value})


@pytest.mark.parametrize("backbone", BACKBONES)
def test_client_groups_are_refused_at_config_time(backbone):
    algorithm = {"name": "fedx", "backbone": backbone, **HEADS}
    values = merged(SSL, algorithm=algorithm, system={"client_group": 2})
    with pytest.raises(UsageError) as err:
        cfgmod.from_dict(values)
    assert "system.client_group" in str(err.value) and "fedx" in str(err.value)
    cfgmod.from_dict(merged(SSL, algorithm=algorithm))   # one by one: fine
