"""Byzantine robustness, first part (fedmpi.runtime.robust, fedmpi.runtime.attacks): each
rule equals a direct numpy reference on tiny vectors, reduces to the mean where it must
(identical updates; f = 0), runs where the updates are (the same bits for 1, 3 and 5
ranks), and the model-poisoning attacks change exactly the malicious clients' uploads."""

import re

import numpy as np
import pytest
import torch

from fedmpi import config as cfg
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.runtime import robust
from fedmpi.runtime.gram import weighted_sum

from conftest import needs_mpi
from helpers import TINY, assert_same_on_ranks, merged, run_file

DETERMINISTIC = {**TINY["system"], "deterministic": True}


def _updates(n=7, d=5, seed=0):
    return np.random.default_rng(seed).normal(size=(n, d))


def _krum_reference(x, f):
    n = len(x)
    scores = []
    for k in range(n):
        dist = sorted(float(np.sum((x[k] - x[j]) ** 2)) for j in range(n) if j != k)
        scores.append(sum(dist[:max(1, n - f - 2)]))
    return np.asarray(scores)


def test_krum_and_multikrum_choose_as_the_reference_does():
    x = _updates()
    x[2] += 50.0                                 # one far outlier
    gram = x @ x.T
    ref = _krum_reference(x, 2)
    assert np.allclose(robust.krum_scores(gram, 2), ref)
    assert np.argmax(robust.krum(gram, 2)) == np.argmin(ref)
    kept = np.argsort(ref, kind="stable")[:7 - 2]
    c = robust.multikrum(gram, 2)
    assert set(np.flatnonzero(c)) == set(kept) and np.isclose(c.sum(), 1) and c[2] == 0


def test_geomed_is_weiszfeld_s_fixed_point():
    x = _updates(9, 4, seed=1)
    x[0] += 100.0
    w = robust.geomed(x @ x.T, iterations=200, nu=1e-12)
    z = w @ x
    # the geometric median's optimality: sum_k (x_k - z) / ||x_k - z|| = 0
    unit = (x - z) / np.linalg.norm(x - z, axis=1, keepdims=True)
    assert np.linalg.norm(unit.sum(axis=0)) < 1e-6
    ref = x.mean(axis=0)                          # numpy Weiszfeld from the mean
    for _ in range(200):
        inv = 1 / np.maximum(np.linalg.norm(x - ref, axis=1), 1e-12)
        ref = (inv / inv.sum()) @ x
    assert np.allclose(z, ref, atol=1e-9)


def test_normbound_scales_each_update_to_the_bound_and_averages():
    x = _updates(5, 3, seed=2) * np.array([[0.1], [1], [3], [10], [0.5]])
    c = robust.normbound(x @ x.T, 1.0)
    ref = np.mean([v * min(1.0, 1.0 / np.linalg.norm(v)) for v in x], axis=0)
    assert np.allclose(c @ x, ref)


@pytest.mark.parametrize("n", [5, 6])
def test_the_coordinate_rules_are_numpy_s_median_and_trimmed_mean(n):
    x = _updates(n, 6, seed=3)
    rows = torch.from_numpy(x)
    median, share = robust.coordinate_rule("median", 0)(rows)
    assert np.allclose(median.numpy(), np.median(x, axis=0))
    # each row's share: 1 where it is the median, 1/2 where one of the two middle values
    order = np.argsort(x, axis=0, kind="stable")
    middle = order[(n - 1) // 2:n // 2 + 1]
    expect = np.zeros(n)
    np.add.at(expect, middle.reshape(-1), 1.0 / len(middle))
    assert np.allclose(share.numpy(), expect) and np.isclose(share.sum(), x.shape[1])
    s = np.sort(x, axis=0)
    trimmed, share = robust.coordinate_rule("trimmed_mean", 1)(rows)
    assert np.allclose(trimmed.numpy(), s[1:n - 1].mean(axis=0))
    assert np.isclose(share.sum(), x.shape[1]) and share.min() >= 0
    # f too large for the round: at most (n - 1) // 2 cut a side, never an empty mean
    cut = (n - 1) // 2
    assert np.allclose(robust.coordinate_rule("trimmed_mean", 9)(rows)[0].numpy(),
                       s[cut:n - cut].mean(axis=0))


@pytest.mark.parametrize("rule,f", [("median", 0), ("trimmed_mean", 2), ("bulyan", 1)])
def test_coordinate_shares_with_ties_are_each_coordinate_s_kept_rows_counted_one_by_one(rule, f):
    """Columns where values tie at the kept run's ends (more rows share the coordinate)
    beside columns without ties: each row's share is, coordinate by coordinate, 1 / (the
    rows whose value lies in the kept run's range) where it lies there, as a loop over the
    coordinates counts it; the values are the kept run's mean."""
    x = _updates(7, 12, seed=8)
    x[:4, 3] = 0.25                         # four equal values around the middle
    x[:, 5] = 1.0                           # a column of one value
    x[[0, 6], 9] = x[3, 9]                  # ties at a run's end
    rows = torch.from_numpy(x)
    coef = np.ones(7) if rule == "bulyan" else None
    values, share = robust.coordinate_rule(rule, f)(rows, coef)
    n = 7
    expect, means = np.zeros(n), []
    for j in range(x.shape[1]):
        s = np.sort(x[:, j])
        lo, hi = {"median": (3, 4), "trimmed_mean": (2, 5)}.get(rule, (None, None))
        if rule == "bulyan":   # the run of n - 2f whose farther end is nearest the median
            beta = n - 2 * f
            reach = [max(s[3] - s[a], s[a + beta - 1] - s[3]) for a in range(n - beta + 1)]
            lo = int(np.argmin(reach))
            hi = lo + beta
        inside = (x[:, j] >= s[lo]) & (x[:, j] <= s[hi - 1])
        expect += inside / inside.sum()
        means.append(s[lo:hi].mean())
    assert np.allclose(share.numpy(), expect) and np.isclose(share.sum(), x.shape[1])
    assert np.allclose(values.numpy(), means)


@pytest.mark.parametrize("rule,f", [("median", 0), ("trimmed_mean", 2), ("bulyan", 1)])
def test_the_torch_form_of_a_coordinate_rule_is_the_numpy_form(rule, f):
    """What a GPU runs (torch's sort of the transposed block, its gather and counts)
    against numpy's, on the CPU: the same kept values and shares, with ties."""
    x = _updates(8, 40, seed=9)
    x[:5, 3] = 0.25
    x[:, 5] = 1.0
    x[[0, 6], 9] = x[3, 9]
    rows = torch.from_numpy(x)
    coef = np.ones(8) if rule == "bulyan" else None
    values, share = robust.coordinate_rule(rule, f, backend="numpy")(rows, coef)
    values_t, share_t = robust.coordinate_rule(rule, f, backend="torch")(rows, coef)
    assert share_t.dtype == values_t.dtype == torch.float64
    assert torch.equal(share, share_t) and torch.allclose(values, values_t, rtol=0, atol=1e-15)


def _rule(rule, f=1, **robust_values):
    """(coefficients, per_block) of ``rule`` as the Robust aggregator builds them."""
    config = cfg.from_dict(merged(TINY, clients={**TINY["clients"], "per_round": 11},
                                  robust={"aggregator": rule, "f": f, **robust_values}))
    coef = None if rule in robust.COORDINATE else robust.coefficients(rule, config)
    per_block = robust.coordinate_rule(rule, f) \
        if rule in robust.COORDINATE or rule == "bulyan" else None
    return coef, per_block


@pytest.mark.parametrize("rule", ["mean", "median", "trimmed_mean", "krum", "multikrum",
                                  "geomed", "normbound", "bulyan"])
def test_every_rule_over_identical_updates_is_that_update(rule):
    """The reduction every rule must meet: identical updates (norm below the bound) give
    the update itself, the mean's answer, through the sharded path; the weights sum to 1."""
    v = torch.from_numpy(_updates(1, 300, seed=4)[0] * 0.01).float()
    coef, per_block = _rule(rule, bound=10.0)
    total, weights = weighted_sum(LocalComm(), [v.clone() for _ in range(7)],
                                  [np.arange(7)], 300, coef, block=64, per_block=per_block)
    assert torch.allclose(total, v, rtol=1e-6, atol=1e-8)
    assert np.isclose(weights.sum(), 1.0) and weights.min() >= 0


def _bulyan_reference(x, f):
    n = len(x)
    left, chosen = list(range(n)), []
    for _ in range(n - 2 * f):
        pick = left[int(np.argmin(_krum_reference(x[left], f)))]
        chosen.append(pick)
        left.remove(pick)
    sub = x[sorted(chosen)]
    beta = len(sub) - 2 * f
    med = np.median(sub, axis=0)
    nearest = np.argsort(np.abs(sub - med), axis=0, kind="stable")[:beta]
    return np.take_along_axis(sub, nearest, axis=0).mean(axis=0), sorted(chosen)


def test_bulyan_is_the_reference_s_krum_selection_then_trimmed_around_the_median():
    x = _updates(11, 40, seed=6)
    x[[1, 7]] += 30.0                              # two outliers, f = 2: n >= 4f + 3
    ref, chosen = _bulyan_reference(x, 2)
    coef, per_block = _rule("bulyan", f=2)
    total, weights = weighted_sum(LocalComm(), [torch.from_numpy(v).float() for v in x],
                                  [np.arange(11)], 40, coef, block=16, per_block=per_block)
    assert np.allclose(total.numpy(), ref.astype(np.float32), atol=1e-5)
    assert set(np.flatnonzero(weights)) <= set(chosen) and weights[1] == weights[7] == 0
    assert np.isclose(weights.sum(), 1.0)


def test_f_0_trimmed_mean_is_the_plain_mean_of_the_updates():
    x = torch.from_numpy(_updates(4, 10, seed=5))
    assert torch.allclose(robust.coordinate_rule("trimmed_mean", 0)(x)[0], x.mean(dim=0))


def _first_round(r):
    c = r.clients()
    return {int(k): float(v) for k, v, t in zip(c["client"], c["update_norm"], c["round"]) if t == 1}


def test_sign_flip_and_scale_change_exactly_the_malicious_uploads(tmp_path):
    """Round 1: every sampled client trains from x^0 in both runs, so an honest client's
    update norm is the same bits and a malicious one's is |scale| times it."""
    honest = merged(TINY, rounds=1)
    with run_file(tmp_path, "honest", honest) as r:
        plain = _first_round(r)
    for kind, scale in (("sign_flip", 1.0), ("scale", 4.0)):
        values = merged(honest, attack={"kind": kind, "fraction": 0.5, "scale": scale})
        with run_file(tmp_path, kind, values) as r:
            bad = set(r.partition()["malicious"].tolist())
            norms = _first_round(r)
        assert len(bad) == 6
        assert any(c in bad for c in norms) and any(c not in bad for c in norms)
        for c, norm in norms.items():
            if c in bad:
                assert np.isclose(norm, abs(scale) * plain[c], rtol=1e-6)
            else:
                assert norm == plain[c]


def test_median_stops_a_scaled_update_that_moves_fedavg(tmp_path):
    """One client in 12 sends 1000 x its update: FedAvg's model moves far; the median's
    stays within the honest clients' reach (its final model stays near FedAvg's without
    the attack)."""
    attack = {"kind": "scale", "fraction": 0.1, "scale": 1000.0}
    base = merged(TINY, clients={**TINY["clients"], "per_round": 12})
    with run_file(tmp_path, "clean", base) as r:
        clean = r.model()
    with run_file(tmp_path, "mean", merged(base, attack=attack)) as r:
        attacked = r.model()
    with run_file(tmp_path, "median", merged(base, attack=attack,
                                             robust={"aggregator": "median"})) as r:
        defended = r.model()
    assert np.linalg.norm(attacked - clean) > 10 * np.linalg.norm(defended - clean)


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("rule, ranks", [("median", 3), ("median", 5), ("geomed", 3),
                                         ("krum", 5)])
def test_a_robust_rule_is_the_same_bits_for_1_and_n_ranks(tmp_path, rule, ranks):
    values = merged(TINY, system=DETERMINISTIC, robust={"aggregator": rule, "f": 1},
                    attack={"kind": "sign_flip", "fraction": 0.2, "scale": 2.0})
    assert_same_on_ranks(tmp_path, values, ranks, columns=("test_loss",))


@pytest.mark.parametrize("over, message", [
    ({"robust": {"aggregator": "flame"}}, "robust.aggregator: 'flame' is not allowed"),
    ({"robust": {"aggregator": "bulyan", "f": 1}},
     "robust.f: bulyan with f = 1 needs at least 7 clients a round (clients.per_round = 5)"),
    ({"attack": {"kind": "alie", "fraction": 0.2}},
     "attack.kind: 'alie' rewrites the updates where the robust rules read them; set "
     "robust.aggregator (\"mean\" for no defence)"),
    ({"attack": {"kind": "min_max", "fraction": 0.2, "direction": "up"},
      "robust": {"aggregator": "mean"}},
     "attack.direction: 'up' is not allowed; choose one of std, sign, unit"),
    ({"attack": {"kind": "backdoor", "fraction": 0.2}},
     "attack.target: backdoor needs the trigger's label: a class >= 0"),
    ({"attack": {"kind": "label_flip", "fraction": 0.2, "target": -2}},
     "attack.target: must be -1 or a class >= 0, got -2"),
    ({"attack": {"kind": "backdoor", "fraction": 0.2, "target": 0, "poison_fraction": 0.0}},
     "attack.poison_fraction: must be a fraction in (0, 1], got 0.0"),
    ({"attack": {"kind": "backdoor", "fraction": 0.2, "target": 0, "trigger": 0}},
     "attack.trigger: must be an integer >= 1, got 0"),
    ({"robust": {"aggregator": "krum", "f": -1}}, "robust.f: must be an integer >= 0, got -1"),
    ({"robust": {"aggregator": "krum", "f": 2}},
     "robust.f: krum with f = 2 needs at least 7 clients a round (clients.per_round = 5)"),
    ({"robust": {"aggregator": "trimmed_mean", "f": 3}},
     "robust.f: trimmed_mean with f = 3 needs at least 7 clients a round"),
    ({"robust": {"aggregator": "median"}, "algorithm": {"name": "scaffold"}},
     "robust.aggregator: replaces the mean of the client deltas, FedAvg's server side; "
     "'scaffold' has its own"),
    ({"robust": {"aggregator": "normbound", "bound": 0.0}},
     "robust.bound: must be a finite number > 0, got 0.0"),
    ({"attack": {"kind": "sign_flip", "fraction": 1.0}},
     "attack.fraction: must be a fraction in [0, 1)"),
    ({"attack": {"kind": "sign_flip", "fraction": -0.1}},
     "attack.fraction: must be a fraction in [0, 1)"),
    ({"attack": {"kind": "sign_flip"}}, "attack.fraction: attack.kind 'sign_flip' needs"),
    ({"attack": {"kind": "poison", "fraction": 0.2}}, "attack.kind: 'poison' is not allowed"),
    ({"attack": {"kind": "gaussian", "fraction": 0.2, "std": 0.0}},
     "attack.std: must be a finite number > 0, got 0.0"),
])
def test_what_robustness_cannot_take_is_refused(over, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        cfg.from_dict(merged(TINY, **over))
