"""Round statistics from sums equal the same statistics from the explicit client vectors."""

import itertools

import numpy as np
import torch

from fedmpi.runtime.stats import stat_contribution, update_statistics


def test_sums_give_the_explicit_cosine_and_consistency():
    rng = np.random.default_rng(0)
    deltas = [torch.tensor(rng.normal(size=7)) for _ in range(5)]
    delta_sum = sum(stat_contribution(d)["_delta_sum"] for d in deltas)
    unit_sum = sum(stat_contribution(d)["_unit_sum"] for d in deltas)
    norms = np.array([float(d.norm()) for d in deltas])
    got = update_statistics(norms, delta_sum, unit_sum)
    cos = [float(a @ b / a.norm() / b.norm()) for a, b in itertools.permutations(deltas, 2)]
    mean = sum(deltas) / 5
    consistency = np.mean([float((d - mean).square().sum()) for d in deltas])
    assert np.isclose(got["client_update_cosine_mean"], np.mean(cos))
    assert np.isclose(got["local_consistency"], consistency)
    assert np.isclose(got["client_update_norm_mean"], norms.mean())


def test_equal_updates_are_consistent_and_aligned():
    d = torch.tensor([1.0, 2.0])
    got = update_statistics(np.array([float(d.norm())] * 3), 3 * d, 3 * d / d.norm())
    assert np.isclose(got["client_update_cosine_mean"], 1.0)
    assert abs(got["local_consistency"]) < 1e-5


def test_one_client_has_no_pairs():
    got = update_statistics(np.array([2.0]), torch.ones(4), torch.ones(4) / 2)
    assert np.isnan(got["client_update_cosine_mean"])
