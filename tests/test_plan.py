import numpy as np

from fedmpi.runtime.plan import place, sample_clients


def test_sampling_is_keyed_by_seed_and_round():
    a = sample_clients(0, 5, 100, 10)
    assert np.array_equal(a, sample_clients(0, 5, 100, 10))
    assert not np.array_equal(a, sample_clients(0, 6, 100, 10))
    assert not np.array_equal(a, sample_clients(1, 5, 100, 10))
    assert len(set(a.tolist())) == 10 and np.all(np.diff(a) > 0)
    assert np.array_equal(sample_clients(0, 0, 7, 7), np.arange(7))


def test_placement_covers_every_client_once_and_balances_samples():
    sizes = np.array([100, 90, 10, 10, 10, 10, 50, 40])
    clients = np.arange(8)
    parts = place(clients, sizes, 3)
    assert sorted(np.concatenate(parts).tolist()) == list(range(8))
    loads = [sizes[p].sum() for p in parts]
    assert max(loads) - min(loads) <= 20
    assert all(np.all(np.diff(p) > 0) for p in parts)
    assert [p.tolist() for p in parts] == [p.tolist() for p in place(clients, sizes, 3)]


def test_more_workers_than_clients_leaves_some_idle():
    parts = place(np.array([3, 9]), np.ones(10, dtype=int), 4)
    assert sum(len(p) for p in parts) == 2 and sum(len(p) == 0 for p in parts) == 2
