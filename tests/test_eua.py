"""EUA: min-norm weights (K = 2 closed form, simplex always, KKT on random K = 10, dense
checks), the Gram matrix from raw inner products, and the server step."""

import numpy as np
import pytest
import torch

from fedmpi.algorithms.eua import (directions, duality_gap, eua_step, eua_weights,
                                   gram_from_inner, min_norm_weights, update_coefficients)
from fedmpi.errors import UsageError


def gram(vectors):
    v = np.asarray(vectors, dtype=np.float64)
    return v @ v.T


def assert_on_simplex(p):
    assert np.all(p >= 0) and abs(p.sum() - 1) <= 1e-12


def assert_kkt(g, p, tol=1e-10):
    """p* minimises p^T G p on the simplex iff (G p)_k >= p^T G p for all k, with equality
    on the support (tol relative to max G_kk)."""
    scale = tol * max(1.0, np.max(np.diag(g)))
    gp, value = g @ p, p @ g @ p
    assert np.all(gp >= value - scale)
    assert np.all(np.abs(gp[p > 1e-9] - value) <= scale)


def test_two_clients_closed_form():
    rng = np.random.default_rng(0)
    for _ in range(50):
        v = rng.standard_normal((2, 5)) * rng.uniform(0.1, 10, size=(2, 1))
        g = gram(v)
        p1 = np.clip((g[1, 1] - g[0, 1]) / (g[0, 0] + g[1, 1] - 2 * g[0, 1]), 0, 1)
        p = min_norm_weights(g)
        assert p == pytest.approx([p1, 1 - p1], abs=1e-15)
        grid = np.linspace(0, 1, 100001)
        values = grid ** 2 * g[0, 0] + 2 * grid * (1 - grid) * g[0, 1] + (1 - grid) ** 2 * g[1, 1]
        assert p @ g @ p <= values.min() + 1e-12


def test_two_clients_clipped_and_identical():
    assert min_norm_weights(gram([[1, 0], [2, 0]])).tolist() == [1.0, 0.0]  # (4-2)/(1) -> clip
    assert min_norm_weights(gram([[1, 1], [1, 1]])).tolist() == [0.5, 0.5]


def test_orthogonal_equal_norms_give_uniform_weights():
    p = min_norm_weights(4 * np.eye(5))
    assert p == pytest.approx(np.full(5, 0.2), abs=1e-14)


def test_orthogonal_unequal_norms_closed_form():
    """min sum p_k^2 a_k on the simplex: p_k = (1/a_k) / sum_j (1/a_j)."""
    a = np.array([1.0, 2.0, 4.0, 0.5])
    p = min_norm_weights(np.diag(a))
    assert p == pytest.approx((1 / a) / np.sum(1 / a), abs=1e-14)


def test_equal_directions_any_weights_same_objective():
    v = np.array([[0.3, -1.2, 2.0]] * 4)
    g = gram(v)
    p = min_norm_weights(g)
    assert_on_simplex(p)
    assert p @ g @ p == pytest.approx(g[0, 0], rel=1e-12)


def test_random_ten_clients_kkt_and_sampling():
    rng = np.random.default_rng(1)
    for d in (20, 5):  # general position, and K > d (0 can be in the hull)
        g = gram(rng.standard_normal((10, d)))
        p = min_norm_weights(g)
        assert_on_simplex(p)
        assert_kkt(g, p)
        assert duality_gap(g, p) <= 1e-12 * np.max(np.diag(g))
        samples = rng.dirichlet(np.full(10, 0.3), size=20000)
        assert p @ g @ p <= np.min(np.einsum("nk,kl,nl->n", samples, g, samples)) + 1e-12


def test_three_clients_dense_grid():
    rng = np.random.default_rng(2)
    g = gram(rng.standard_normal((3, 4)))
    p = min_norm_weights(g)
    a, b = np.meshgrid(np.linspace(0, 1, 401), np.linspace(0, 1, 401))
    inside = a + b <= 1
    grid = np.stack([a[inside], b[inside], 1 - a[inside] - b[inside]], axis=1)
    assert p @ g @ p <= np.min(np.einsum("nk,kl,nl->n", grid, g, grid)) + 1e-12


def test_never_leaves_the_simplex_on_degenerate_grams():
    rng = np.random.default_rng(3)
    for trial in range(200):
        k, d = rng.integers(3, 12), rng.integers(1, 6)
        v = rng.standard_normal((k, d)) * 10.0 ** rng.uniform(-4, 4, size=(k, 1))
        v[rng.integers(0, k)] = v[rng.integers(0, k)]       # a duplicate
        if trial % 3 == 0:
            v[rng.integers(0, k)] = 0                         # a client that did not move
        if trial % 5 == 0:
            v = np.outer(rng.standard_normal(k), rng.standard_normal(d))  # rank one
        g = gram(v)
        p = min_norm_weights(g)
        assert_on_simplex(p)
        assert duality_gap(g, p) <= 1e-10 * np.max(np.diag(g))


def test_gram_from_inner_products_matches_the_directions():
    rng = np.random.default_rng(4)
    deltas = torch.tensor(rng.standard_normal((4, 9)) * [[0.1], [1.0], [3.0], [0.5]])
    inner = (deltas @ deltas.T).numpy()
    for variant in ("paper", "code"):
        v = directions(deltas, variant).numpy()
        assert gram_from_inner(inner, variant) == pytest.approx(v @ v.T, rel=1e-12)
    norms = np.linalg.norm(deltas.numpy(), axis=1)
    assert np.diag(gram_from_inner(inner, "code")) == pytest.approx(np.full(4, 4.0))
    assert np.diag(gram_from_inner(inner, "paper")) == pytest.approx(4 / norms ** 2)
    with pytest.raises(UsageError, match="variant"):
        gram_from_inner(inner, "admm")


def test_same_model_from_every_client_moves_towards_it():
    delta = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    deltas = torch.stack([delta] * 3)
    for variant, length in (("code", 2 / delta.norm()), ("paper", 2 / delta.norm() ** 2)):
        p = eua_weights((deltas @ deltas.T).numpy(), variant)
        assert_on_simplex(p)
        step = -eua_step(p, deltas, variant)  # theta_g - lr d moves along -d
        assert torch.allclose(step, length * delta, atol=1e-14)


def test_update_coefficients_reproduce_the_step():
    rng = np.random.default_rng(5)
    deltas = torch.tensor(rng.standard_normal((5, 7)))
    norms = deltas.norm(dim=1).numpy()
    for variant in ("paper", "code"):
        p = eua_weights((deltas @ deltas.T).numpy(), variant)
        c = torch.tensor(update_coefficients(p, norms, variant))
        assert torch.allclose(-eua_step(p, deltas, variant), c @ deltas, atol=1e-13)


def test_opposite_clients_cancel():
    deltas = torch.tensor([[1.0, 2.0], [-1.0, -2.0]], dtype=torch.float64)
    p = eua_weights((deltas @ deltas.T).numpy(), "paper")
    assert p.tolist() == [0.5, 0.5]
    assert torch.allclose(eua_step(p, deltas, "paper"), torch.zeros(2, dtype=torch.float64))


def test_clients_that_did_not_move_are_left_out():
    deltas = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    p = eua_weights((deltas @ deltas.T).numpy(), "code")
    assert p.tolist() == [0.5, 0.0, 0.5]
    assert directions(deltas, "paper")[1].abs().max() == 0
    zero = np.zeros((3, 3))
    assert eua_weights(zero, "code") == pytest.approx(np.full(3, 1 / 3))


def test_single_client_and_bad_input():
    assert min_norm_weights([[2.5]]).tolist() == [1.0]
    with pytest.raises(ValueError):
        min_norm_weights(np.ones((2, 3)))
    with pytest.raises(ValueError):
        min_norm_weights([[np.nan, 0], [0, 1]])
