"""FedU^2: the runtime's Gram path (fedmpi.runtime.gram) against closed forms and across
rank counts, EUA's two-client step, FUR switched on and off, reductions to FedBYOL /
FedSimCLR / FedSimSiam, and real runs: single process vs `mpirun -n 3` bitwise."""

import json
import math
import sys

import numpy as np
import pytest
import torch

from fedmpi import config as cfgmod
from fedmpi.algorithms import build
from fedmpi.algorithms.base import RoundContext
from fedmpi.algorithms.fedu2 import with_uniformity
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment
from fedmpi.runtime.gram import block_ranges, weighted_sum

from conftest import ROOT, fedmpi, mpirun, needs_mpi
from helpers import SSL, merged, write_config


def ctx(global_lr=1.0):
    return RoundContext(round=0, phase="train", lr=0.1, lr_prev=0.1, global_lr=global_lr,
                        weight_decay=0.0, grad_clip=0.0, local_epochs=1, batch_size=4,
                        num_clients=2, participants=(0, 1), seed=0)


def eua_step(deltas, **params):
    """x_1 - x_0 of one FedU^2 server step from x_0 = 0 with these client updates."""
    alg = build("fedu2", params)
    vectors = [torch.tensor(d, dtype=torch.float32) for d in deltas]
    combined, _ = weighted_sum(LocalComm(), vectors, [np.arange(len(deltas))], len(deltas[0]),
                               lambda inner: alg.gram_coefficients(inner, ctx()))
    state = {"x": torch.zeros(len(deltas[0]))}
    alg.server_update(state, {"delta": combined, "weight": torch.ones(1)}, {}, ctx())
    return state["x"].numpy(), alg


# ---- the Gram path ---------------------------------------------------------------------

def test_blocks_cover_every_coordinate_once():
    assert block_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert block_ranges(8, 4) == [(0, 4), (4, 8)]


def test_weighted_sum_single_process_is_the_closed_form():
    g = torch.Generator().manual_seed(0)
    vectors = [torch.randn(23, generator=g) for _ in range(4)]
    clients = np.array([7, 1, 5, 3])           # training order; sums go in client order
    seen = {}

    def coefficients(gram):
        seen["gram"] = gram
        return np.array([0.5, -1.0, 2.0, 0.25])

    total, coef = weighted_sum(LocalComm(), vectors, [clients], 23, coefficients, block=5)
    a = np.stack([vectors[i].double().numpy() for i in np.argsort(clients)])
    np.testing.assert_allclose(seen["gram"], a @ a.T, rtol=1e-12)
    np.testing.assert_allclose(total.numpy(), coef @ a, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("n, cases", [(2, ["53:5"]), (3, ["20:2", "53:5"]), (4, ["53:5"]),
                                      (5, ["20:5",     # a worker owns no block
                                           "20:2"])])  # and two have no clients
def test_gram_over_mpi_is_bitwise_single_process_and_never_gathers_all_vectors(n, cases):
    """d:k cases (d coordinates in blocks of 7, k clients) under one mpirun each, each
    rank's buffers kept from case to case (growing at 3 ranks, shrinking at 5)."""
    proc = mpirun(n, [sys.executable, str(ROOT / "tests/mpi_scripts/gram_check.py"), *cases],
                  timeout=120)
    reports = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(reports) == sorted(cases)
    for case, report in reports.items():
        for key in ("gram_bitwise", "sum_bitwise", "gram_close", "sum_close", "coef_close"):
            assert report[key], (case, key)
        assert report["max_worker_received"] < report["all_vectors_bytes"], case


# ---- EUA's step ------------------------------------------------------------------------

def test_two_orthogonal_clients_code_scaling_takes_the_unit_directions():
    # v = -2 Delta/||Delta||: G = 4 I, p = (1/2, 1/2); fixed step eta_s: x = eta_s (e1 + e2)
    step, alg = eua_step([[1.0, 0.0], [0.0, 2.0]], eua="code", eua_step="fixed", eua_lr=3.0)
    np.testing.assert_allclose(step, [3.0, 3.0], rtol=1e-6)
    np.testing.assert_allclose(alg._weights, [0.5, 0.5])


def test_two_orthogonal_clients_paper_scaling_matches_the_closed_form():
    # v = -2 Delta/||Delta||^2: v1 = (-2, 0), v2 = (0, -1); G = diag(4, 1);
    # p1 = (G22 - G12) / (G11 + G22 - 2 G12) = 1/5; c_k = 2 p_k / s_k = (0.4, 0.4)
    step, alg = eua_step([[1.0, 0.0], [0.0, 2.0]], eua="paper", eua_step="fixed", eua_lr=1.0)
    np.testing.assert_allclose(alg._weights, [0.2, 0.8], rtol=1e-12)
    np.testing.assert_allclose(step, [0.4, 0.8], rtol=1e-6)
    diag = alg.diagnostics({}, {}, {}, ctx())
    assert diag["eua_weight_max"] == pytest.approx(0.8)
    assert diag["eua_clients_effective"] == pytest.approx(math.exp(-(0.2 * math.log(0.2) + 0.8 * math.log(0.8))))


def test_default_eua_is_the_released_codes_rule_with_server_lr_8():
    # XeniaLLL/FedU2 mtl.py 'EUA': x <- x - lr sum_k p_k 2 (x - theta_k) / ||x - theta_k||,
    # lr = gmodel_lr = 8, p = the min-norm point of the unit directions times 2.
    params = build("fedu2", {}).params
    assert (params.eua, params.eua_step, params.eua_lr) == ("code", "fixed", 8.0)
    # orthogonal updates of norms 3, 0.5, 10: p = 1/3 each whatever the norms, and
    # x_1 = 8 * (2/3) (e1 + e2 + e3)
    step, alg = eua_step([[3.0, 0.0, 0.0], [0.0, 0.5, 0.0], [0.0, 0.0, 10.0]])
    np.testing.assert_allclose(alg._weights, [1 / 3] * 3, rtol=1e-12)
    np.testing.assert_allclose(step, [16 / 3] * 3, rtol=1e-6)
    # two updates at 45 degrees (norms 2 and 5 sqrt 2): 2u_1, 2u_2 have equal norms, so the
    # min-norm point is their midpoint and x_1 = 8 (u_1 + u_2), u_2 = (1, 1) / sqrt 2
    step, alg = eua_step([[2.0, 0.0], [5.0, 5.0]])
    np.testing.assert_allclose(alg._weights, [0.5, 0.5], rtol=1e-12)
    r = 2 ** -0.5
    np.testing.assert_allclose(step, [8 * (1 + r), 8 * r], rtol=1e-6)


def test_default_eua_step_is_lr_8_times_a_certified_min_norm_point():
    # four random updates in R^3: x_1 / 8 = w = sum_k p_k 2 u_k, and w is the min-norm
    # point of the hull of {2 u_k} iff <w, 2 u_k> >= ||w||^2 for every k, with equality
    # where p_k > 0 (the optimality condition of min_{p in simplex} ||sum_k p_k 2 u_k||^2)
    deltas = np.random.default_rng(3).normal(size=(4, 3)) * [[0.1], [1.0], [5.0], [0.02]]
    deltas = deltas.astype(np.float32).astype(np.float64)   # the updates travel as float32
    step, alg = eua_step(deltas.tolist())
    units = 2 * deltas / np.linalg.norm(deltas, axis=1, keepdims=True)
    p = alg._weights
    assert p.sum() == pytest.approx(1.0) and (p >= 0).all()
    w = p @ units
    np.testing.assert_allclose(step, 8 * w, rtol=1e-5, atol=1e-6)
    slack = units @ w - w @ w
    assert (slack >= -1e-9).all()
    np.testing.assert_allclose(slack[p > 1e-9], 0.0, atol=1e-9)


def test_matched_step_still_works_when_asked_for():
    # orthogonal updates (1, 0), (0, 2), code scaling: p = (1/2, 1/2), c = 2p/s = (1, 1/2),
    # eta_s = eta_g mean(s) / 2 = 0.75 at eta_g = 1: x_1 = 0.75 ((1, 0) + (0, 1))
    step, alg = eua_step([[1.0, 0.0], [0.0, 2.0]], eua_step="matched")
    assert alg.params.eua_step == "matched"
    np.testing.assert_allclose(step, [0.75, 0.75], rtol=1e-6)


@pytest.mark.parametrize("variant", ["code", "paper"])
def test_matched_step_moves_identical_clients_exactly_like_fedavg(variant):
    delta = [0.3, -0.4, 1.2]
    step, alg = eua_step([delta, delta, delta], eua=variant, eua_step="matched")
    np.testing.assert_allclose(step, delta, rtol=1e-6)
    assert alg._weights.sum() == pytest.approx(1.0) and (alg._weights >= 0).all()


def test_a_client_that_did_not_move_gets_no_weight():
    step, alg = eua_step([[0.0, 0.0], [1.0, 1.0], [1.0, -1.0]], eua="code", eua_step="fixed",
                         eua_lr=1.0)
    assert alg._weights[0] == 0.0
    np.testing.assert_allclose(alg._weights[1:], [0.5, 0.5])
    np.testing.assert_allclose(step, [2 ** 0.5, 0.0], rtol=1e-6)


# ---- FUR in the client loss -------------------------------------------------------------

@pytest.mark.parametrize("fur", ["paper", "code"])
def test_fur_adds_a_nonzero_gradient_to_the_projections(fur):
    params = build("fedu2", {"fur": fur, "backbone": "simsiam"}).params
    z = torch.nn.functional.normalize(torch.randn(32, 16, generator=torch.Generator().manual_seed(1)), dim=1)
    z.requires_grad_(True)
    head = lambda module, zz, both: zz.sum() * 0.0   # the backbone loss contributes nothing
    torch.manual_seed(0)
    with_uniformity(head, params)(None, z, None).backward()
    assert torch.linalg.vector_norm(z.grad) > 1e-4


def test_lambda_u_defaults_follow_the_variant_and_are_stored():
    assert build("fedu2", {}).params.lambda_u == 0.1
    assert build("fedu2", {"fur": "code"}).params.lambda_u == 0.01
    assert build("fedu2", {"fur": "none"}).params.lambda_u == 0.0
    assert build("fedu2", {"fur": "code", "lambda_u": 1}).params.lambda_u == 1.0


@pytest.mark.parametrize("field, value", [
    ("backbone", "moco"), ("fur", "sinkhorn"), ("aggregator", "mean"), ("eua", "mgda"),
    ("eua_step", "auto"), ("lambda_u", -1.0), ("eua_lr", 0.0), ("uot_iters", 0),
    ("tau_a", 0.0)])
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(UsageError, match=f"algorithm.{field}"):
        build("fedu2", {field: value})


# ---- real runs ---------------------------------------------------------------------------

def run_single(path, name, **algorithm):
    values = merged(SSL, algorithm={"name": name, **algorithm})
    if name == "fedsimclr":   # no predictor
        del values["algorithm"]["pred_hidden"]
    values["output"] = str(path)
    exp = run_experiment(cfgmod.from_dict(values), LocalComm(), quiet=True)
    return exp, RunFile(values["output"])


@pytest.mark.parametrize("backbone, baseline, extra", [
    ("byol", "fedbyol", {}), ("simclr", "fedsimclr", {"temperature": 0.2}),
    ("simsiam", "fedsimsiam", {})])
@pytest.mark.slow
def test_without_fur_and_eua_it_is_the_backbone_bitwise(tmp_path, backbone, baseline, extra):
    _, base = run_single(tmp_path / "base.h5", baseline, **extra)
    _, plain = run_single(tmp_path / "plain.h5", "fedu2", backbone=backbone, fur="none",
                          aggregator="fedavg", **extra)
    _, fur = run_single(tmp_path / "fur.h5", "fedu2", backbone=backbone, aggregator="fedavg", **extra)
    with base, plain, fur:
        assert np.array_equal(base.model(), plain.model())
        assert not np.array_equal(base.model(), fur.model())
        assert fur.config["algorithm"]["fur"] == "paper"


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("algorithm", [{}, {"backbone": "simclr", "fur": "code", "eua": "paper"}])
def test_mpirun_is_bitwise_single_process_and_traffic_is_d_d(tmp_path, algorithm):
    exp, single = run_single(tmp_path / "one.h5", "fedu2", **algorithm)
    config = write_config(tmp_path / "c.toml", SSL, algorithm={"name": "fedu2", **algorithm})
    out = tmp_path / "n3.h5"
    mpirun(3, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o", str(out)])
    with single as a, RunFile(out) as b:
        assert np.array_equal(a.model(), b.model())
        for field in ("train_loss", "test_acc", "eua_weight_max", "eua_clients_effective"):
            assert np.array_equal(a.rounds()[field], b.rounds()[field], equal_nan=True), field
        per_round = [0] + [SSL["clients"]["per_round"] * exp.d * 4] * SSL["rounds"]   # 0: round 0
        for run in (a, b):
            assert run.rounds()["fl_bytes_down"].tolist() == per_round
            assert run.rounds()["fl_bytes_up"].tolist() == per_round
        # the simulator's own transfers are counted apart from the deployment's
        assert np.all(b.rounds()["mpi_bytes"] > 0) and np.all(a.rounds()["mpi_bytes"] == 0)
        assert np.all((a.rounds()["eua_weight_max"][1:] <= 1) & (a.rounds()["eua_weight_min"][1:] >= 0))
        assert a.config["algorithm"]["eua"] == algorithm.get("eua", "code")


def test_cli_lists_fedu2_with_its_variants():
    out = fedmpi(["algorithms"], check=True).stdout
    assert "fedu2" in out
    for param in ("fur", "eua", "eua_step", "lambda_u", "aggregator", "backbone"):
        assert param in out
