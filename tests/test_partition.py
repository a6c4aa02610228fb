"""Partition properties: a true partition, seeded, skew grows as alpha falls, min_size repair, speed."""

import time

import numpy as np
import pytest

from fedmpi.data.partition import Partition, class_counts, dirichlet, iid, make_partition
from fedmpi.errors import UsageError

LABELS = np.random.default_rng(0).integers(0, 10, 5000)


def assert_partition(p: Partition, num_samples, num_clients):
    assert p.offsets.dtype == p.indices.dtype == np.int64
    assert p.num_clients == num_clients and p.offsets[0] == 0 and p.sizes.sum() == num_samples
    assert np.array_equal(np.sort(p.indices), np.arange(num_samples))  # each index exactly once
    for c in range(min(num_clients, 50)):
        assert np.all(np.diff(p.client(c)) > 0)  # ascending within a client


def mean_label_entropy(p, labels):
    counts = class_counts(p, labels, 10).astype(float)
    probs = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    return float(-(probs * np.log(np.where(probs > 0, probs, 1))).sum(1).mean())


def test_iid_is_balanced_partition():
    p = iid(1003, 10, seed=1)
    assert_partition(p, 1003, 10)
    assert sorted(p.sizes.tolist()) == [100] * 7 + [101] * 3


@pytest.mark.parametrize("make", [lambda s: iid(5000, 20, s), lambda s: dirichlet(LABELS, 20, 0.3, s)])
def test_deterministic_per_seed(make):
    a, b, c = make(7), make(7), make(8)
    assert np.array_equal(a.offsets, b.offsets) and np.array_equal(a.indices, b.indices)
    assert not np.array_equal(a.indices, c.indices)


def test_global_numpy_state_is_untouched():
    np.random.seed(0)
    before = np.random.get_state()[1].copy()
    dirichlet(LABELS, 20, 0.3, seed=1)
    iid(100, 3, seed=1)
    assert np.array_equal(np.random.get_state()[1], before)


def test_dirichlet_partition_and_class_counts():
    p = dirichlet(LABELS, 30, 0.5, seed=2)
    assert_partition(p, 5000, 30)
    counts = class_counts(p, LABELS, 10)
    assert counts.shape == (30, 10) and counts.dtype == np.int64
    assert np.array_equal(counts.sum(1), p.sizes)
    assert np.array_equal(counts.sum(0), np.bincount(LABELS, minlength=10))
    assert np.array_equal(counts[4], np.bincount(LABELS[p.client(4)], minlength=10))


def test_skew_increases_as_alpha_falls():
    entropy = {a: mean_label_entropy(dirichlet(LABELS, 50, a, seed=0, min_size=0), LABELS)
               for a in (0.05, 0.5, 100.0)}
    iid_entropy = mean_label_entropy(iid(5000, 50, seed=0), LABELS)
    print(f"\nmean client label entropy (nats): {entropy}, iid {iid_entropy:.3f}, max {np.log(10):.3f}")
    assert entropy[0.05] < entropy[0.5] < entropy[100.0]
    assert entropy[100.0] == pytest.approx(iid_entropy, abs=0.05)


@pytest.mark.parametrize("min_size", [1, 20, 100])
def test_min_size_repair(min_size):
    p = dirichlet(LABELS, 50, 0.05, seed=3, min_size=min_size)
    assert_partition(p, 5000, 50)
    assert p.sizes.min() >= min_size


def test_repair_moves_from_the_largest_clients_only():
    raw = dirichlet(LABELS, 50, 0.05, seed=3, min_size=0)
    fixed = dirichlet(LABELS, 50, 0.05, seed=3, min_size=20)
    changed = np.flatnonzero(raw.sizes != fixed.sizes)
    donors = changed[fixed.sizes[changed] < raw.sizes[changed]]
    receivers = changed[fixed.sizes[changed] > raw.sizes[changed]]
    assert np.all(raw.sizes[receivers] < 20) and np.all(fixed.sizes[receivers] == 20)
    assert raw.sizes[donors].min() >= np.sort(raw.sizes)[-len(donors)]  # the largest ones
    assert np.all(fixed.sizes[donors] >= fixed.sizes[donors].max() - 1)  # cut to one level


def test_exact_fit_min_size():
    p = dirichlet(LABELS, 100, 0.1, seed=0, min_size=50)
    assert p.sizes.tolist() == [50] * 100


def test_bad_parameters_are_usage_errors():
    with pytest.raises(UsageError, match=r"partition\.min_size=51 x clients=100"):
        dirichlet(LABELS, 100, 0.1, seed=0, min_size=51)
    with pytest.raises(UsageError, match=r"partition\.alpha"):
        dirichlet(LABELS, 10, 0.0, seed=0)
    with pytest.raises(UsageError, match=r"partition\.alpha"):
        dirichlet(LABELS, 10, -1, seed=0)
    with pytest.raises(UsageError, match="clients=0"):
        iid(10, 0, seed=0)
    with pytest.raises(UsageError, match="seed"):
        iid(10, 2, seed=-1)


def test_make_partition():
    p = make_partition("dirichlet", LABELS, 10, seed=1, alpha=0.3, min_size=5)
    q = dirichlet(LABELS, 10, 0.3, seed=1, min_size=5)
    assert np.array_equal(p.indices, q.indices)
    assert np.array_equal(make_partition("iid", LABELS, 10, seed=1).indices, iid(5000, 10, 1).indices)
    with pytest.raises(UsageError, match="allowed: iid, dirichlet"):
        make_partition("shards", LABELS, 10, seed=1)
    with pytest.raises(UsageError, match=r"partition\.alpha is required"):
        make_partition("dirichlet", LABELS, 10, seed=1)
    with pytest.raises(UsageError, match=r"partition\.alpha is not used by partition\.kind='iid'"):
        make_partition("iid", LABELS, 10, seed=1, alpha=0.3)


def test_non_contiguous_labels():
    labels = np.array([3, 7, 7, 3, 100, 100, 7, 3] * 50)
    p = dirichlet(labels, 8, 0.5, seed=0)
    assert_partition(p, 400, 8)


def test_100k_clients_is_fast():
    labels = np.random.default_rng(0).integers(0, 10, 50000)
    timings = {}
    for name, make in [("iid", lambda: iid(50000, 100_000, seed=0)),
                       ("dirichlet(0.3)", lambda: dirichlet(labels, 100_000, 0.3, seed=0, min_size=0)),
                       ("dirichlet(0.3) 25k clients min_size=2",
                        lambda: dirichlet(labels, 25_000, 0.3, seed=0, min_size=2))]:
        start = time.perf_counter()
        p = make()
        timings[name] = time.perf_counter() - start
        assert p.sizes.sum() == 50000
    print("\n50,000 samples: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in timings.items()))
    assert max(timings.values()) < 10


def test_water_fill_matches_one_at_a_time_from_the_largest():
    """Reference: repeatedly take one sample from the largest client (ties: highest id)."""
    from fedmpi.data.partition import _water_fill
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = rng.integers(0, 30, rng.integers(1, 12))
        total = int(rng.integers(0, sizes.sum() + 1))
        reference = sizes.copy()
        for _ in range(total):
            reference[len(sizes) - 1 - np.argmax(reference[::-1])] -= 1
        assert np.array_equal(sizes - _water_fill(sizes, total), reference)


def test_default_dirichlet_is_unchanged_by_the_fixed_size_options():
    """Golden values from before `balanced`/`quantity_alpha` existed: results files depend on them."""
    p = dirichlet(LABELS, 8, 0.3, seed=11, min_size=300)
    assert p.sizes.tolist() == [482, 415, 722, 300, 555, 333, 966, 1227]
    assert p.client(3)[:6].tolist() == [7, 21, 23, 36, 125, 136]
    assert int(p.indices[::97].sum()) == 121176
    q = make_partition("dirichlet", LABELS, 8, seed=11, alpha=0.3, min_size=300,
                       balanced=False, quantity_alpha=None)
    assert np.array_equal(p.indices, q.indices) and np.array_equal(p.offsets, q.offsets)


def test_make_partition_lists_every_kind():
    with pytest.raises(UsageError, match="allowed: iid, dirichlet, pathological, quantity, natural$"):
        make_partition("shards", LABELS, 10, seed=1)
