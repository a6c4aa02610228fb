"""L-DAWA: the server rule on hand-made two-layer vectors, its reductions to FedAvg (equal
cosines with the normalised rule, unit cosines with the code's rule, warm-up rounds bitwise
through the runtime), the layout it reads, bad parameters, and a real SSL run (d / d)."""

import math

import numpy as np
import pytest
import torch

from fedmpi import config as cfgmod
from fedmpi.algorithms import Upload, build
from fedmpi.algorithms.base import RoundContext
from fedmpi.algorithms.ldawa import layer_table
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

from helpers import SSL, merged

TWO_LAYERS = [("a.weight", (2,)), ("b.weight", (1, 2))]   # layer A: 2 values, layer B: 2


def ctx(round=0, global_lr=1.0):
    return RoundContext(round=round, phase="train", lr=0.1, lr_prev=0.1, global_lr=global_lr,
                        weight_decay=0.0, grad_clip=0.0, local_epochs=1, batch_size=4,
                        num_clients=3, participants=(0, 1, 2), seed=0)


def aggregate(alg, x, thetas, ns, round=0, global_lr=1.0):
    """x^{t+1} of one server step: each client's contribution summed, then server_update."""
    x = torch.as_tensor(x, dtype=torch.float32)
    parts = []
    for theta, n in zip(thetas, ns):
        up = Upload(delta=torch.as_tensor(theta, dtype=torch.float32) - x, num_samples=n,
                    loss=0.0, steps=1)
        if round >= alg.params.warmup_rounds:
            up.extras["ldawa_x"] = x
        parts.append(alg.contribution(up))
    sizes = alg.contribution_sizes(len(x))
    assert {k: v.numel() for k, v in parts[0].items()} == sizes
    sums = {k: sum(p[k] for p in parts) for k in sizes}
    state = alg.init_server_state(x)
    alg.server_update(state, sums, {}, ctx(round, global_lr))
    return state["x"], sums, state


def fedavg(x, thetas, ns, global_lr=1.0):
    x = torch.as_tensor(x, dtype=torch.float32)
    sums = {"delta": sum((torch.as_tensor(t, dtype=torch.float32) - x) * float(n)
                         for t, n in zip(thetas, ns)),
            "weight": torch.tensor([float(sum(ns))])}
    state = {"x": x.clone()}
    build("fedavg", {}).server_update(state, sums, {}, ctx(global_lr=global_lr))
    return state["x"]


def ldawa(rows=TWO_LAYERS, **params):
    alg = build("ldawa", params)
    alg.use_layout(rows)
    return alg


# ---- the server rule by hand ------------------------------------------------------------

def test_two_layer_rule_by_hand_is_the_authors_unnormalised_mean():
    # x = (1, 0 | 0, 2); client 1 = (1, 1 | 0, 3), client 2 = (2, 0 | 1, 0)
    # layer A: cos1 = 1/sqrt2, cos2 = 1;  layer B: cos1 = 1, cos2 = 0
    # A^{t+1} = (cos1 * (1, 1) + 1 * (2, 0)) / 2 = ((1/sqrt2 + 2)/2, 1/(2 sqrt2))
    # B^{t+1} = (1 * (0, 3) + 0 * (1, 0)) / 2 = (0, 1.5)
    x = [1.0, 0.0, 0.0, 2.0]
    thetas = [[1.0, 1.0, 0.0, 3.0], [2.0, 0.0, 1.0, 0.0]]
    r = 1 / math.sqrt(2)
    new, sums, _ = aggregate(ldawa(), x, thetas, [10, 30])
    np.testing.assert_allclose(new.numpy(), [(r + 2) / 2, r / 2, 0.0, 1.5], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(sums["layer_weight"].numpy(), [r + 1, 1.0], rtol=1e-6)
    assert sums["weight"].item() == 2.0                      # uniform: 1/K, not n_k


def test_two_layer_rule_by_hand_normalised_and_sample_weighted():
    x = [1.0, 0.0, 0.0, 2.0]
    thetas = [[1.0, 1.0, 0.0, 3.0], [2.0, 0.0, 1.0, 0.0]]
    r = 1 / math.sqrt(2)
    # w = n = (10, 30). normalise = cosines: A = (10 r (1, 1) + 30 (2, 0)) / (10 r + 30),
    # B = (10 (0, 3) + 0) / 10 = (0, 3)
    alg = ldawa(weighting="samples", normalise="cosines")
    new, _, _ = aggregate(alg, x, thetas, [10, 30])
    a = (10 * r * np.array([1.0, 1.0]) + 30 * np.array([2.0, 0.0])) / (10 * r + 30)
    np.testing.assert_allclose(new.numpy(), [*a, 0.0, 3.0], rtol=1e-6)
    # the same, unnormalised: / (10 + 30)
    new, _, _ = aggregate(ldawa(weighting="samples"), x, thetas, [10, 30])
    a = (10 * r * np.array([1.0, 1.0]) + 30 * np.array([2.0, 0.0])) / 40
    np.testing.assert_allclose(new.numpy(), [*a, 0.0, 0.75], rtol=1e-6, atol=1e-7)


def test_global_lr_scales_the_step_to_the_aggregate():
    x = [1.0, 0.0, 0.0, 2.0]
    thetas = [[1.0, 1.0, 0.0, 3.0], [2.0, 0.0, 1.0, 0.0]]
    full, _, _ = aggregate(ldawa(), x, thetas, [1, 1])
    half, _, _ = aggregate(ldawa(), x, thetas, [1, 1], global_lr=0.5)
    np.testing.assert_allclose(half.numpy(), (np.array(x) + full.numpy()) / 2, rtol=1e-6)


def test_undefined_angles_average_the_layer_and_cosines_clip_at_one():
    # the global layer B is 0 (a bias at init): delta = 1, B is the plain mean
    new, sums, _ = aggregate(ldawa(), [1.0, 1.0, 0.0, 0.0], [[2.0, 2.0, 1.0, 1.0],
                                                             [1.0, 1.0, 3.0, -1.0]], [1, 1])
    np.testing.assert_allclose(new.numpy()[2:], [2.0, 0.0], rtol=1e-6)
    assert (sums["layer_weight"] <= 2.0).all()                  # min(cos, 1) per client
    np.testing.assert_allclose(new.numpy()[:2], [1.5, 1.5], rtol=1e-6)   # parallel: cos 1


def test_module_granularity_takes_one_cosine_per_module():
    rows = [("encoder.w", (2,)), ("encoder.b", (1,)), ("projector.w", (1,))]
    alg = ldawa(rows, granularity="module")
    assert alg.num_layers == 2
    x = torch.tensor([1.0, 0.0, 1.0, 1.0])
    theta = torch.tensor([1.0, 1.0, 1.0, 2.0])
    cos = alg.layer_cosines(theta, x)
    np.testing.assert_allclose(cos.numpy(), [2 / (math.sqrt(3) * math.sqrt(2)), 1.0], rtol=1e-6)
    assert ldawa(rows).num_layers == 3


def test_layer_table_follows_the_flat_order_and_zero_d_tensors_have_no_angle():
    sizes, group, angular = layer_table([("a.w", (2, 3)), ("a.s", ()), ("b.w", (4,))], "module")
    assert sizes == [6, 1, 4] and group == [0, 0, 1] and angular == [True, True]
    _, group, angular = layer_table([("a.w", (2, 3)), ("a.s", ()), ("b.w", (4,))], "layer")
    assert group == [0, 1, 2] and angular == [True, False, True]


# ---- reductions to FedAvg ----------------------------------------------------------------

def equal_angle_clients(x, angles_per_layer, scales, gen):
    """Clients theta_k^l = a_k (x^l + tan(phi_l) ||x^l|| u^l) with u^l a unit vector
    orthogonal to x^l: every client has the angle phi_l with x on layer l."""
    thetas = []
    for a in scales:
        parts, offset = [], 0
        for size, phi in zip((3, 5), angles_per_layer):
            xl = x[offset:offset + size]
            u = torch.randn(size, generator=gen, dtype=torch.float64)
            u -= (u @ xl) / (xl @ xl) * xl
            u /= torch.linalg.vector_norm(u)
            parts.append(a * (xl + math.tan(phi) * torch.linalg.vector_norm(xl) * u))
            offset += size
        thetas.append(torch.cat(parts))
    return thetas


def test_equal_cosines_normalised_is_fedavg():
    gen = torch.Generator().manual_seed(0)
    rows = [("l1", (3,)), ("l2", (5,))]
    x = torch.randn(8, generator=gen, dtype=torch.float64)
    thetas = equal_angle_clients(x, (0.3, 1.1), (0.8, 1.0, 1.3), gen)
    ns = [5, 11, 2]
    alg = ldawa(rows, weighting="samples", normalise="cosines")
    new, sums, _ = aggregate(alg, x.float(), [t.float() for t in thetas], ns)
    # every client has cosines (cos 0.3, cos 1.1)
    np.testing.assert_allclose(sums["layer_weight"].numpy(),
                               [18 * math.cos(0.3), 18 * math.cos(1.1)], rtol=1e-5)
    np.testing.assert_allclose(new.numpy(), fedavg(x.float(), [t.float() for t in thetas], ns),
                               rtol=1e-5, atol=1e-6)
    # uniform weights: the plain mean of the client models
    new, _, _ = aggregate(ldawa(rows, normalise="cosines"), x.float(),
                          [t.float() for t in thetas], ns)
    np.testing.assert_allclose(new.numpy(), torch.stack(thetas).mean(0).float().numpy(),
                               rtol=1e-5, atol=1e-6)


def test_unit_cosines_make_the_codes_rule_fedavg():
    # clients that scale x layer by layer (angle 0): cos = 1 (clipped), the rule is FedAvg
    gen = torch.Generator().manual_seed(1)
    rows = [("l1", (3,)), ("l2", (5,))]
    x = torch.randn(8, generator=gen, dtype=torch.float64)
    thetas = equal_angle_clients(x, (0.0, 0.0), (0.9, 1.2), gen)
    ns = [4, 7]
    new, _, _ = aggregate(ldawa(rows, weighting="samples"), x.float(),
                          [t.float() for t in thetas], ns)
    np.testing.assert_allclose(new.numpy(), fedavg(x.float(), [t.float() for t in thetas], ns),
                               rtol=1e-5, atol=1e-6)


def test_warmup_round_is_fedavg_bitwise_on_the_same_uploads():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, generator=gen)
    thetas = [x + 0.1 * torch.randn(4, generator=gen) for _ in range(3)]
    ns = [3, 8, 5]
    new, _, _ = aggregate(ldawa(warmup_rounds=2), x, thetas, ns, round=1, global_lr=0.7)
    assert torch.equal(new, fedavg(x, thetas, ns, global_lr=0.7))
    after, _, _ = aggregate(ldawa(warmup_rounds=2), x, thetas, ns, round=2, global_lr=0.7)
    assert not torch.equal(after, new)


# ---- parameters ---------------------------------------------------------------------------

def test_defaults_are_the_authors_rule_over_simsiam():
    p = build("ldawa", {}).params
    assert (p.backbone, p.weighting, p.normalise, p.granularity, p.warmup_rounds) == \
        ("simsiam", "uniform", "none", "layer", 0)
    alg = build("ldawa", {})
    assert alg.traffic(1000, "train") == (1000, 1000)
    assert alg.client_state_sizes(1000) == {}
    assert "target" in build("ldawa", {"backbone": "byol"}).client_state_sizes(1000)


@pytest.mark.parametrize("field, value, message", [
    ("backbone", "moco", "'moco' is not allowed"), ("weighting", "loss", "'loss' is not allowed"),
    ("normalise", "softmax", "'softmax' is not allowed"),
    ("granularity", "block", "'block' is not allowed"),
    ("warmup_rounds", -1, "must be >= 0, got -1"),
    ("warmup_rounds", 1.5, "expected int"), ("temperature", 0.0, r"must be in \(0, inf\), got 0")])
def test_bad_parameters_name_the_field(field, value, message):
    with pytest.raises(UsageError, match=f"config field algorithm.{field}: {message}"):
        build("ldawa", {field: value})


def test_contribution_declares_one_normaliser_per_layer_of_the_built_model():
    alg = build("ldawa", {"proj_dim": 4, "proj_hidden": 8, "pred_hidden": 4})
    assert alg.contribution_sizes(10) == {"delta": 10, "layer_weight": 0, "weight": 1}
    from fedmpi.models import build_model
    module = alg.build_model(build_model, "cnn", 1, 10, 16, {"hidden": 8, "channels": [2, 4]})
    n = len(list(module.parameters()))
    assert alg.num_layers == n
    assert alg.contribution_sizes(123)["layer_weight"] == n


# ---- real runs ----------------------------------------------------------------------------

def run(path, name, **algorithm):
    values = merged(SSL, algorithm={"name": name, **algorithm})
    values["output"] = str(path)
    exp = run_experiment(cfgmod.from_dict(values), LocalComm(), quiet=True)
    return exp, RunFile(values["output"])


def test_real_run_completes_with_d_d_traffic_and_differs_from_fedavg(tmp_path):
    exp, ld = run(tmp_path / "ldawa.h5", "ldawa")
    _, base = run(tmp_path / "base.h5", "fedsimsiam")
    with ld, base:
        assert ld.status == "completed"
        rounds = ld.rounds()
        per_round = [0] + [SSL["clients"]["per_round"] * exp.d * 4] * SSL["rounds"]
        assert rounds["fl_bytes_down"].tolist() == per_round
        assert rounds["fl_bytes_up"].tolist() == per_round
        assert np.all(ld.clients()["bytes_up"] == exp.d * 4)
        cos = rounds["ldawa_cos_mean"][1:]
        assert np.all((cos > 0) & (cos <= 1)) and np.all(rounds["ldawa_cos_min"][1:] <= cos)
        assert np.isfinite(ld.model()).all()
        assert not np.array_equal(ld.model(), base.model())


def test_warmup_over_every_round_is_fedsimsiam_bitwise(tmp_path):
    _, ld = run(tmp_path / "ldawa.h5", "ldawa", warmup_rounds=SSL["rounds"])
    _, base = run(tmp_path / "base.h5", "fedsimsiam")
    with ld, base:
        assert ld.status == "completed"
        assert np.array_equal(ld.model(), base.model())
        assert np.array_equal(ld.rounds()["train_loss"], base.rounds()["train_loss"],
                              equal_nan=True)


@pytest.mark.parametrize("algorithm", [
    {"backbone": "byol", "granularity": "module", "normalise": "cosines"},
    {"backbone": "simclr", "weighting": "samples", "warmup_rounds": 1}])
def test_other_backbones_and_variants_run(tmp_path, algorithm):
    if algorithm["backbone"] == "simclr":
        algorithm = {**algorithm, "temperature": 0.2}
    exp, ld = run(tmp_path / "ldawa.h5", "ldawa", **algorithm)
    with ld:
        assert ld.status == "completed"
        assert np.isfinite(ld.model()).all()
        assert ld.rounds()["fl_bytes_up"].tolist()[1:] == \
            [SSL["clients"]["per_round"] * exp.d * 4] * SSL["rounds"]
        assert ld.config["algorithm"]["backbone"] == algorithm["backbone"]
    if algorithm["backbone"] == "byol":
        assert exp.alg.num_layers == 3          # encoder, projector, predictor
        assert len(exp.store) > 0               # the BYOL targets stay on the clients
