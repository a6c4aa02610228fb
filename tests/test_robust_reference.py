"""The robust rules that need one more vector beside the updates (fedmpi.runtime.robust):
centred clipping (the centre: the last aggregate, kept in the server's state) and FLTrust
(the server's own update on a keyed root set, trained on every worker). Each equals a
direct numpy reference, reduces where it must, and is the same bits after a resume and
under mpirun."""

import re

import numpy as np
import pytest
import torch

from fedmpi import config as cfg
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import robust
from fedmpi.runtime.gram import weighted_sum

from conftest import needs_mpi
from helpers import TINY, assert_same_on_3_ranks, merged, run_and_resume, run_file

DETERMINISTIC = {**TINY["system"], "deterministic": True}


def _x(n=6, d=40, seed=0):
    return np.random.default_rng(seed).normal(size=(n, d))


def _combine(x, rule, extra, **robust_values):
    config = cfg.from_dict(merged(TINY, robust={"aggregator": rule, **robust_values}))
    total, weights = weighted_sum(LocalComm(), [torch.from_numpy(v).float() for v in x],
                                  [np.arange(len(x))], x.shape[1],
                                  robust.coefficients(rule, config), block=16,
                                  extra=torch.from_numpy(extra).float())
    return total.numpy().astype(np.float64), weights


def _f32(a):
    return a.astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("iterations", [1, 3])
def test_centred_clipping_is_the_reference_iteration(iterations):
    x, v0 = _f32(_x() * 2), _f32(_x(1, 40, seed=1)[0])
    tau = 5.0
    v = v0.copy()
    for _ in range(iterations):   # Karimireddy, He and Jaggi's update, directly
        diff = x - v
        norms = np.linalg.norm(diff, axis=1, keepdims=True)
        v = v + (diff * np.minimum(1, tau / norms)).mean(axis=0)
    got, weights = _combine(x, "centered_clip", v0, bound=tau, cc_iterations=iterations)
    assert np.allclose(got, v, atol=1e-5)
    assert len(weights) == len(x) and (weights > 0).all()


def test_centred_clipping_with_a_radius_beyond_every_update_is_the_mean():
    x = _f32(_x())
    got, weights = _combine(x, "centered_clip", _f32(_x(1, 40, seed=2)[0]), bound=1e6)
    assert np.allclose(got, x.mean(axis=0), atol=1e-5) and np.allclose(weights, 1 / len(x))


def test_fltrust_is_the_reference_trust_weighted_rescaled_mean():
    x = _f32(_x(7, 40, seed=3))
    g0 = _f32(x[:4].mean(axis=0) + 0.1)
    x[5] = -3 * g0                                    # opposite: trust 0
    trust = np.maximum(x @ g0 / (np.linalg.norm(x, axis=1) * np.linalg.norm(g0)), 0)
    rescaled = x * (np.linalg.norm(g0) / np.linalg.norm(x, axis=1))[:, None]
    ref = (trust[:, None] * rescaled).sum(axis=0) / trust.sum()
    got, weights = _combine(x, "fltrust", g0)
    assert np.allclose(got, ref, atol=1e-5) and weights[5] == 0


def test_fltrust_over_updates_equal_to_its_own_is_that_update():
    g0 = _f32(_x(1, 40, seed=4)[0])
    x = np.stack([g0] * 5)
    got, _ = _combine(x, "fltrust", g0)
    assert np.allclose(got, g0, atol=1e-5)
    got, _ = _combine(-x, "fltrust", g0)             # nobody trusted: no step
    assert np.allclose(got, 0)


def test_the_root_set_is_keyed_and_per_class():
    config = cfg.from_dict(merged(TINY, robust={"aggregator": "fltrust", "root_per_class": 3}))
    labels = np.repeat(np.arange(4), [10, 10, 2, 10])
    root = robust.root_set(config, labels)
    assert np.array_equal(np.bincount(labels[root]), [3, 3, 2, 3])
    assert np.array_equal(root, robust.root_set(config, labels))


def test_fltrust_records_its_root_set_and_stops_a_sign_flip(tmp_path):
    attack = {"kind": "sign_flip", "fraction": 0.25, "scale": 10.0}
    base = merged(TINY, rounds=2, robust={"aggregator": "fltrust", "root_per_class": 5})
    with run_file(tmp_path, "fl", merged(base, attack=attack)) as r:
        c, root = r.clients(), r.partition()["robust_root"]
    assert len(root) == 50
    bad = c["malicious"] == 1
    assert bad.any() and (c["robust_weight"][bad] == 0).all()


@pytest.mark.parametrize("rule", ["centered_clip", "fltrust"])
def test_a_crash_and_resume_is_bitwise_the_uninterrupted_run(tmp_path, rule):
    """The centre comes back from the checkpoint with the server's state; FLTrust's root
    set from the seed."""
    values = merged(TINY, rounds=4, system={**DETERMINISTIC, "checkpoint_every": 2},
                    robust={"aggregator": rule, "bound": 0.05})
    crashed, exp = run_and_resume(values, tmp_path)
    assert exp.start == 2
    with RunFile(tmp_path / "ref.h5") as a, RunFile(crashed) as b:
        assert np.array_equal(a.model(), b.model())
        assert np.array_equal(a.clients()["robust_weight"], b.clients()["robust_weight"])


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("rule", ["centered_clip", "fltrust"])
def test_the_same_bits_under_mpirun(tmp_path, rule):
    values = merged(TINY, system=DETERMINISTIC, robust={"aggregator": rule, "bound": 0.05},
                    attack={"kind": "sign_flip", "fraction": 0.25})
    assert_same_on_3_ranks(tmp_path, values, columns=("test_loss",))


@pytest.mark.parametrize("over, message", [
    ({"root_per_class": 0}, "robust.root_per_class: must be an integer >= 1, got 0"),
    ({"cc_iterations": 0}, "robust.cc_iterations: must be an integer >= 1, got 0"),
])
def test_bad_parameters_are_refused(over, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        cfg.from_dict(merged(TINY, robust={"aggregator": "fltrust", **over}))
