"""Property tests for every partition kind: a true partition, seeded, skew that follows its
parameter, exact sizes where promised, termination on extreme inputs, one-line errors."""

import gzip
import time
from pathlib import Path

import numpy as np
import pytest

import fedmpi.data.partition as partition_module
import fedmpi.data.partition_fill as fill_module
from fedmpi.data.heterogeneity import label_skew
from fedmpi.data.partition import (class_counts, dirichlet, iid, make_partition, natural,
                                   partition_params, pathological, quantity)
from fedmpi.errors import UsageError

LABELS = np.random.default_rng(0).integers(0, 10, 5000)
# 60 groups of sizes 1..60 in shuffled sample order, like Shakespeare's (play, role) ids.
GROUPS = np.random.default_rng(1).permutation(np.repeat(np.arange(100, 160), np.arange(1, 61)))
FASHION_LABELS = Path("/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz")

KINDS = {  # name -> (num_clients, seed, **params) -> Partition of LABELS
    "iid": lambda k, seed, **kw: iid(len(LABELS), k, seed),
    "dirichlet": lambda k, seed, **kw: dirichlet(LABELS, k, 0.3, seed, **kw),
    "balanced": lambda k, seed, **kw: dirichlet(LABELS, k, 0.3, seed, balanced=True, **kw),
    "label+quantity": lambda k, seed, **kw: dirichlet(LABELS, k, 0.3, seed, quantity_alpha=0.5, **kw),
    "pathological": lambda k, seed, **kw: pathological(LABELS, k, 2, seed, **kw),
    "quantity": lambda k, seed, **kw: quantity(LABELS, k, 0.5, seed, **kw),
}


def assert_partition(p, num_samples, num_clients, complete=True):
    assert p.offsets.dtype == p.indices.dtype == np.int64
    assert p.num_clients == num_clients and p.offsets[0] == 0 and np.all(p.sizes >= 0)
    assert len(np.unique(p.indices)) == len(p.indices)  # each index at most once
    assert p.indices.min(initial=0) >= 0 and p.indices.max(initial=0) < num_samples
    if complete:
        assert p.sizes.sum() == num_samples
    for c in range(min(num_clients, 50)):
        assert np.all(np.diff(p.client(c)) > 0)  # ascending within a client


def emd(p, labels=LABELS):
    return label_skew(class_counts(p, labels, int(labels.max()) + 1))["emd_weighted"]


@pytest.mark.parametrize("kind", KINDS)
def test_true_partition_seeded_and_no_empty_client(kind):
    a, b, c = (KINDS[kind](40, seed) for seed in (7, 7, 8))
    assert_partition(a, 5000, 40)
    assert np.array_equal(a.offsets, b.offsets) and np.array_equal(a.indices, b.indices)
    assert not np.array_equal(a.indices, c.indices)
    assert a.sizes.min() >= 1


def test_natural_is_seeded_and_a_subset():
    a, b, c = (natural(GROUPS, 20, seed) for seed in (7, 7, 8))
    assert_partition(a, len(GROUPS), 20, complete=False)
    assert np.array_equal(a.indices, b.indices) and not np.array_equal(a.indices, c.indices)
    assert a.sizes.sum() < len(GROUPS) and a.sizes.min() >= 1


@pytest.mark.parametrize("kind", ["balanced", "label+quantity", "pathological", "quantity"])
def test_global_numpy_state_is_untouched(kind):
    np.random.seed(0)
    before = np.random.get_state()[1].copy()
    KINDS[kind](30, 1)
    natural(GROUPS, 10, 1)
    assert np.array_equal(np.random.get_state()[1], before)


@pytest.mark.parametrize("num_clients", [1, 7, 100, 4999, 5000])
def test_balanced_sizes_and_class_totals_are_exact(num_clients):
    p = dirichlet(LABELS, num_clients, 0.1, seed=3, min_size=0, balanced=True)
    assert_partition(p, 5000, num_clients)
    n, r = divmod(5000, num_clients)
    assert p.sizes.tolist() == [n + 1] * r + [n] * (num_clients - r)
    counts = class_counts(p, LABELS, 10)
    assert np.array_equal(counts.sum(0), np.bincount(LABELS, minlength=10))


def test_label_plus_quantity_has_quantitys_sizes():
    """Both draw the client sizes first, from the same rule and the same stream."""
    for seed, alpha, min_size in [(0, 0.5, 10), (4, 0.05, 0), (9, 5.0, 40)]:
        p = dirichlet(LABELS, 60, 0.2, seed, min_size=min_size, quantity_alpha=alpha)
        q = quantity(LABELS, 60, alpha, seed, min_size=min_size)
        assert_partition(p, 5000, 60)
        assert np.array_equal(p.sizes, q.sizes) and p.sizes.min() >= min_size


def test_quantity_sizes_are_min_size_plus_rounded_dirichlet_shares():
    p = quantity(5000, 50, 0.5, seed=2, min_size=10)
    rng = np.random.default_rng(np.random.SeedSequence([2, partition_module._PURPOSE_PARTITION]))
    shares = rng.dirichlet(np.full(50, 0.5)) * (5000 - 50 * 10)
    extra = p.sizes - 10
    assert np.all((extra == np.floor(shares)) | (extra == np.ceil(shares)))
    assert p.sizes.sum() == 5000
    assert np.array_equal(quantity(LABELS, 50, 0.5, 2, 10).indices, p.indices)  # labels or N


def test_quantity_keeps_labels_iid_and_skews_sizes_as_alpha_falls():
    cv = {a: quantity(LABELS, 50, a, seed=0, min_size=5).sizes.std() / 100 for a in (0.1, 1.0, 100.0)}
    assert cv[0.1] > cv[1.0] > cv[100.0]
    assert emd(quantity(LABELS, 20, 0.5, seed=0)) < emd(iid(5000, 20, seed=0)) + 0.03 < 0.3
    assert emd(dirichlet(LABELS, 20, 0.5, seed=0)) > 0.3


@pytest.mark.parametrize("option", [{}, {"balanced": True}, {"quantity_alpha": 1.0}])
def test_label_skew_grows_as_alpha_falls(option):
    score = {a: emd(dirichlet(LABELS, 50, a, seed=0, min_size=0, **option)) for a in (0.05, 0.5, 100.0)}
    print(f"\n{option}: size-weighted EMD {score}")
    assert score[0.05] > score[0.5] > score[100.0]
    assert score[100.0] < emd(iid(5000, 50, seed=0)) + 0.03 and score[0.05] > 0.6


def test_pathological_gives_every_client_exactly_n_classes_evenly():
    for n in (1, 2, 3, 7, 10):
        p = pathological(LABELS, 37, n, seed=n)
        assert_partition(p, 5000, 37)
        counts = class_counts(p, LABELS, 10)
        assert np.all((counts > 0).sum(1) == n)
        holders = (counts > 0).sum(0)
        assert holders.max() - holders.min() <= 1
        for k in range(10):  # a class's samples split into parts differing by at most one
            parts = counts[counts[:, k] > 0, k]
            assert parts.max() - parts.min() <= 1


def test_pathological_skew_grows_as_n_shrinks():
    score = {n: emd(pathological(LABELS, 50, n, seed=0)) for n in (1, 2, 5, 10)}
    assert score[1] > score[2] > score[5] > score[10]
    assert score[10] < 0.05  # n = C: every client holds every class in its global share


def test_pathological_combinations_vary_across_blocks():
    counts = class_counts(pathological(LABELS, 200, 2, seed=0), LABELS, 10)
    assert len({tuple(np.flatnonzero(row)) for row in counts}) > 10  # not just C windows


def test_pathological_client_limit_is_exact():
    labels = np.repeat(np.arange(4), [50, 60, 60, 60])  # the smallest class has 50
    # min_size 3 over n = 2 classes: >= 2 from each; 50 // 2 = 25 holders of 4 * 25 / 2 clients
    with pytest.raises(UsageError, match=r"at most 50 clients get partition\.min_size=3") as err:
        pathological(labels, 51, 2, seed=0, min_size=3)
    assert "\n" not in str(err.value)
    for seed in range(5):
        assert pathological(labels, 50, 2, seed=seed, min_size=3).sizes.min() >= 3
    assert_partition(pathological(labels, 51, 2, seed=0, min_size=0), 230, 51)


def test_pathological_impossible_requests():
    with pytest.raises(UsageError, match=r"^partition\.n=11: must be at most the 10 classes"):
        pathological(LABELS, 20, 11, seed=0)
    with pytest.raises(UsageError, match=r"^partition\.n=0: must be an integer >= 1$"):
        pathological(LABELS, 20, 0, seed=0)
    with pytest.raises(UsageError, match=r"^partition\.n=2 x clients\.num=4 < 10 classes"):
        pathological(LABELS, 4, 2, seed=0)
    fit = np.bincount(LABELS).min() * 10  # one holder per sample of the smallest class
    with pytest.raises(UsageError, match=rf"^clients\.num={fit + 1}: .* at most {fit} clients"):
        pathological(LABELS, fit + 1, 1, seed=0)
    assert pathological(LABELS, fit, 1, seed=0).sizes.min() == 1


def test_natural_clients_are_the_groups_in_ascending_id():
    p = natural(GROUPS, 60, seed=0)
    assert_partition(p, len(GROUPS), 60)
    for c in range(60):
        assert np.array_equal(p.client(c), np.flatnonzero(GROUPS == 100 + c))


def test_natural_subset_and_min_size():
    p = natural(GROUPS, 15, seed=3, min_size=30)  # groups 129..159 have >= 30 samples
    chosen = [int(GROUPS[p.client(c)[0]]) for c in range(15)]
    assert chosen == sorted(set(chosen)) and min(chosen) >= 129
    for c, g in enumerate(chosen):
        assert np.array_equal(p.client(c), np.flatnonzero(GROUPS == g))
    assert len(natural(GROUPS, 31, seed=3, min_size=30).sizes) == 31
    with pytest.raises(UsageError, match=r"^clients\.num=32: the dataset has 31 natural clients .*"
                                         r"use at most 31$"):
        natural(GROUPS, 32, seed=3, min_size=30)


def test_make_partition_natural_needs_groups_and_others_ignore_them():
    with pytest.raises(UsageError, match=r"^partition\.kind='natural' needs a dataset with natural "
                                         r"clients \(shakespeare, or an arrays file with 'groups'\)$"):
        make_partition("natural", LABELS, 10, seed=0)
    labels = np.zeros(len(GROUPS), dtype=np.int64)
    p = make_partition("natural", labels, 12, seed=4, groups=GROUPS, min_size=2)
    assert np.array_equal(p.indices, natural(GROUPS, 12, 4, min_size=2).indices)
    q = make_partition("iid", labels, 12, seed=4, groups=GROUPS)
    assert np.array_equal(q.indices, iid(len(GROUPS), 12, 4).indices)


@pytest.mark.parametrize("kind, params, direct", [
    ("dirichlet", {"alpha": 0.2, "balanced": True}, lambda: dirichlet(LABELS, 30, 0.2, 5, balanced=True)),
    ("dirichlet", {"alpha": 0.2, "quantity_alpha": 2.0, "min_size": 4},
     lambda: dirichlet(LABELS, 30, 0.2, 5, min_size=4, quantity_alpha=2.0)),
    ("pathological", {"n": 3}, lambda: pathological(LABELS, 30, 3, 5)),
    ("quantity", {"alpha": 0.7}, lambda: quantity(LABELS, 30, 0.7, 5, min_size=10)),
])
def test_make_partition_dispatches_to_the_kind(kind, params, direct):
    p, q = make_partition(kind, LABELS, 30, 5, **params), direct()
    assert np.array_equal(p.offsets, q.offsets) and np.array_equal(p.indices, q.indices)


def test_partition_params_defaults():
    assert partition_params("dirichlet", {"alpha": 0.3}) == {
        "alpha": 0.3, "min_size": 1, "balanced": False, "quantity_alpha": None}
    assert partition_params("pathological", {"n": 2}) == {"n": 2, "min_size": 1}
    assert partition_params("quantity", {"alpha": 1}) == {"alpha": 1, "min_size": 10}
    assert partition_params("natural", {}) == {"min_size": 1}


@pytest.mark.parametrize("kind, params, message", [
    ("dirichlet", {"alpha": 0.3, "n": 2}, r"partition\.n is not used by partition\.kind='dirichlet'; "
                                          r"allowed: alpha, min_size, balanced, quantity_alpha"),
    ("dirichlet", {"alpha": 0.3, "balanced": "yes"}, r"partition\.balanced='yes': must be true or false"),
    ("dirichlet", {"alpha": 0.3, "quantity_alpha": 0}, r"partition\.quantity_alpha=0: must be a number > 0"),
    ("dirichlet", {"alpha": 0.3, "balanced": True, "quantity_alpha": 0.5},
     r"partition\.quantity_alpha=0\.5 sets unequal client sizes and partition\.balanced = true"),
    ("pathological", {}, r"partition\.n is required for partition\.kind='pathological' \(e\.g\. 2\)"),
    ("pathological", {"n": 1.5}, r"partition\.n=1\.5: must be an integer >= 1"),
    ("pathological", {"n": True}, r"partition\.n=True: must be an integer >= 1"),
    ("pathological", {"n": 2, "alpha": 0.1}, r"partition\.alpha is not used by partition\.kind='pathological'"),
    ("quantity", {}, r"partition\.alpha is required for partition\.kind='quantity' \(e\.g\. 0\.3\)"),
    ("quantity", {"alpha": float("inf")}, r"partition\.alpha=inf: must be a number > 0"),
    ("quantity", {"alpha": 1, "min_size": -1}, r"partition\.min_size=-1: must be an integer >= 0"),
    ("natural", {"alpha": 1}, r"partition\.alpha is not used by partition\.kind='natural'; allowed: min_size"),
    ("natural", {"min_size": 0.5}, r"partition\.min_size=0\.5: must be an integer >= 0"),
])
def test_partition_params_errors_are_one_line(kind, params, message):
    with pytest.raises(UsageError, match="^" + message) as err:
        partition_params(kind, params)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("make", [
    lambda: dirichlet(LABELS, 501, 0.3, 0, min_size=10, balanced=True),
    lambda: quantity(LABELS, 501, 0.3, 0, min_size=10),
    lambda: dirichlet(LABELS, 501, 0.3, 0, min_size=10, quantity_alpha=1.0),
])
def test_more_min_size_than_samples_is_rejected(make):
    with pytest.raises(UsageError, match=r"^partition\.min_size=10 x clients=501 exceeds the 5000"):
        make()


ONE_CLASS = np.zeros(300, dtype=np.int64)
EXTREME = [(LABELS, 5000), (LABELS, 7000), (LABELS, 2), (ONE_CLASS, 300), (ONE_CLASS, 1000)]


@pytest.mark.parametrize("alpha", [1e-3, 1e3])
@pytest.mark.parametrize("labels, num_clients", EXTREME)
def test_extreme_inputs_terminate_with_exact_sizes(alpha, labels, num_clients):
    n = len(labels)
    makes = [lambda: dirichlet(labels, num_clients, alpha, 0, min_size=0),
             lambda: dirichlet(labels, num_clients, alpha, 0, min_size=0, balanced=True),
             lambda: dirichlet(labels, num_clients, 0.3, 0, min_size=0, quantity_alpha=alpha),
             lambda: dirichlet(labels, num_clients, alpha, 0, min_size=0, quantity_alpha=alpha),
             lambda: quantity(labels, num_clients, alpha, 0, min_size=0)]
    if num_clients * 1 >= len(np.unique(labels)):
        makes.append(lambda: pathological(labels, num_clients, 1, 0, min_size=0))
    for make in makes:
        p = make()
        assert_partition(p, n, num_clients)
        assert np.array_equal(class_counts(p, labels, 10).sum(0), np.bincount(labels, minlength=10))
    sizes = dirichlet(labels, num_clients, alpha, 0, min_size=0, balanced=True).sizes
    assert sizes.max() - sizes.min() <= 1


def test_fixed_size_fill_is_exact_and_takes_at_most_c_passes(monkeypatch):
    passes = []
    real = fill_module._fill_pass
    monkeypatch.setattr(fill_module, "_fill_pass", lambda *a: passes.append(1) or real(*a))
    rng = np.random.default_rng(5)
    for _ in range(300):
        num_classes, num_clients = int(rng.integers(1, 25)), int(rng.integers(1, 200))
        supply = rng.integers(0, 100, num_classes)
        supply[0] += 1
        total = int(supply.sum())
        sizes = (partition_module._equal_sizes(total, num_clients) if rng.random() < 0.5 else
                 partition_module._quantity_sizes(total, num_clients, 10 ** rng.uniform(-3, 3), 0, rng))
        prior = rng.dirichlet(np.full(num_classes, 10 ** rng.uniform(-3, 3)), size=num_clients)
        passes.clear()
        counts = fill_module._fill_to_sizes(sizes, supply, prior, rng)
        assert counts.min() >= 0 and len(passes) <= num_classes
        assert np.array_equal(counts.sum(1), sizes) and np.array_equal(counts.sum(0), supply)


def test_fixed_size_fill_follows_the_client_priors():
    """A client whose prior is one class gets only that class while it lasts."""
    prior = np.zeros((4, 3))
    prior[[0, 1, 2, 3], [0, 0, 1, 2]] = 1.0
    counts = fill_module._fill_to_sizes(np.array([10, 10, 10, 10]), np.array([20, 10, 10]),
                                             prior, np.random.default_rng(0))
    assert counts.tolist() == [[10, 0, 0], [10, 0, 0], [0, 10, 0], [0, 0, 10]]


@pytest.mark.skipif(not FASHION_LABELS.exists(), reason="Debian dataset-fashion-mnist not installed")
def test_real_fashion_mnist_labels():
    labels = np.frombuffer(gzip.decompress(FASHION_LABELS.read_bytes())[8:], dtype=np.uint8).astype(np.int64)
    assert np.array_equal(np.bincount(labels), [6000] * 10)
    path = pathological(labels, 100, 2, seed=0)  # 20 holders per class, 300 samples each
    counts = class_counts(path, labels, 10)
    assert set(counts.ravel().tolist()) == {0, 300} and np.all(path.sizes == 600)
    balanced = dirichlet(labels, 100, 0.1, seed=0, balanced=True)
    assert np.all(balanced.sizes == 600)
    assert_partition(balanced, 60000, 100)
    assert emd(balanced, labels) > emd(dirichlet(labels, 100, 1.0, seed=0, balanced=True), labels)


def test_100k_clients_is_fast():
    labels = np.random.default_rng(0).integers(0, 10, 50000)
    timings = {}
    for name, make in [("balanced", lambda: dirichlet(labels, 100_000, 0.3, 0, min_size=0, balanced=True)),
                       ("label+quantity", lambda: dirichlet(labels, 100_000, 0.3, 0, min_size=0,
                                                            quantity_alpha=0.5)),
                       ("pathological", lambda: pathological(labels, 100_000, 2, 0, min_size=0)),
                       ("quantity", lambda: quantity(labels, 100_000, 0.5, 0, min_size=0))]:
        start = time.perf_counter()
        p = make()
        timings[name] = time.perf_counter() - start
        assert p.sizes.sum() == 50000 and p.num_clients == 100_000
    print("\n50,000 samples, 100k clients: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in timings.items()))
    assert max(timings.values()) < 5
