"""FUR: the paper's UOT (hand case, active gradient, the inert printed scale, envelope
gradient) and the code's tangent sliced-Wasserstein (against a per-tangent-point loop)."""

import math

import pytest
import torch
import torch.nn.functional as F

from fedmpi.algorithms.fur import (sphere_logmap, tangent_sw_uniformity, uot_divergence,
                                   uot_objective, uot_plan, uot_uniformity, uniform_sphere)
from fedmpi.errors import UsageError


def unit(n, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, d, generator=g, dtype=dtype), dim=1)


def test_one_sample_closed_form():
    """B = 1, c = 0.5||(1,0) - (0,1)||^2 = 1: min_pi c pi + 0.8 (pi - 1)^2 -> pi* = 1 - 1/1.6
    = 0.375 (one exact step), l_u = 0.375 + 0.8 * 0.625^2 = 0.6875, dl/dz = pi*(z - s)."""
    z = torch.tensor([[1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    s = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    loss = uot_divergence(z, s)
    assert loss.item() == pytest.approx(0.6875, rel=1e-12)
    loss.backward()
    assert torch.allclose(z.grad, torch.tensor([[0.375, -0.375]], dtype=torch.float64))


@pytest.mark.parametrize("step", ["eq6", "projected"])
def test_paper_fur_is_active(step):
    """B = 128, d = 512 random unit vectors: non-zero, finite gradient."""
    z = unit(128, 512, 0).requires_grad_()
    loss = uot_uniformity(z, torch.Generator().manual_seed(1), step=step)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(z.grad).all()
    assert z.grad.norm() > 1e-2


def test_printed_scale_is_inert():
    """c = ||z - s||^2 ~ 2 with a = b = 1/B: G(0) = C - tau_a a - tau_b b > 0 entrywise, so
    pi* = 0 is the optimum (KKT), the solver returns it and l_u has zero gradient."""
    b = 128
    z = unit(b, 512, 0, torch.float64).requires_grad_()
    s = unit(b, 512, 1, torch.float64)
    cost = torch.cdist(z.detach(), s).square()
    mass = torch.full((b,), 1 / b, dtype=torch.float64)
    assert (cost - 0.8 * mass[:, None] - 0.8 * mass[None, :]).min() > 0
    assert uot_plan(cost, mass, mass).abs().max() == 0
    uot_divergence(z, s, cost_scale=1.0, mass=1 / b).backward()
    assert z.grad.abs().max() == 0
    ones = torch.ones(b, dtype=torch.float64)
    assert uot_plan(0.5 * cost, ones, ones).sum() > 10  # the default convention moves mass


def test_gradient_is_the_envelope_gradient():
    """dl_u/dz_i = sum_j pi*_ij (z_i - s_j) for c = 0.5||z - s||^2 (pi* held fixed)."""
    z = unit(16, 8, 2, torch.float64).requires_grad_()
    s = unit(16, 8, 3, torch.float64)
    uot_divergence(z, s).backward()
    ones = torch.ones(16, dtype=torch.float64)
    pi = uot_plan(0.5 * torch.cdist(z.detach(), s).square(), ones, ones)
    expected = pi.sum(1, keepdim=True) * z.detach() - pi @ s
    assert torch.allclose(z.grad, expected, atol=1e-12)


def test_gradient_finite_where_a_sample_coincides_with_a_representation():
    s = unit(4, 3, 16, torch.float64)
    z = s.clone().requires_grad_()
    uot_divergence(z, s).backward()
    assert torch.isfinite(z.grad).all()


def test_invariant_to_permuting_the_samples():
    z, s = unit(32, 16, 4, torch.float64), unit(32, 16, 5, torch.float64)
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    permuted = uot_divergence(z, s[perm]).item()
    assert uot_divergence(z, s).item() == pytest.approx(permuted, rel=1e-10)


def test_projected_step_gets_closer_to_the_optimum():
    z, s = unit(64, 32, 6, torch.float64), unit(64, 32, 7, torch.float64)
    cost = 0.5 * torch.cdist(z, s).square()
    ones = torch.ones(64, dtype=torch.float64)

    def objective(step, iters):
        return uot_objective(cost, uot_plan(cost, ones, ones, iters=iters, tol=0.0, step=step),
                             ones, ones, 0.8, 0.8).item()

    best = objective("projected", 3000)
    assert best <= objective("projected", 50) <= objective("eq6", 50)
    assert objective("projected", 50) - best < 0.1 * (objective("eq6", 50) - best)


def test_deterministic_given_the_generator():
    z = unit(32, 16, 8)
    for fn in (uot_uniformity, tangent_sw_uniformity):
        a = fn(z, torch.Generator().manual_seed(3))
        assert torch.equal(a, fn(z, torch.Generator().manual_seed(3)))
        assert not torch.equal(a, fn(z, torch.Generator().manual_seed(4)))
    torch.manual_seed(5)
    a = tangent_sw_uniformity(z)
    torch.manual_seed(5)
    assert torch.equal(a, tangent_sw_uniformity(z))


def test_uniform_sphere_draws_unit_vectors():
    like = torch.empty(0, dtype=torch.float64)
    s = uniform_sphere(100, 7, torch.Generator().manual_seed(0), like)
    assert s.dtype == torch.float64
    assert torch.allclose(s.norm(dim=1), torch.ones(100, dtype=torch.float64))


def test_sphere_logmap():
    """||log_q y|| = arccos<q, y>, log_q y is tangent at q, and exp_q(log_q y) = y."""
    q, y = unit(10, 5, 9, torch.float64), unit(10, 5, 10, torch.float64)
    v = sphere_logmap(q, y)
    theta = torch.acos((q * y).sum(1))
    assert torch.allclose(v.norm(dim=1), theta, atol=1e-12)
    assert torch.allclose((v * q).sum(1), torch.zeros(10, dtype=torch.float64), atol=1e-12)
    back = torch.cos(theta)[:, None] * q + torch.sin(theta)[:, None] * v / theta[:, None]
    assert torch.allclose(back, y, atol=1e-12)


def loop_reference(z, generator, projections=6, num_tangent_space=6.0):
    """The released code's loop: per tangent point, log-map both sets, sliced W2^2."""
    n, d = z.shape
    q = uniform_sphere(n, d, generator, z)
    s = uniform_sphere(n, d, generator, z)
    w = torch.randn(n, projections, d, generator=generator, dtype=z.dtype)
    total = 0.0
    for i in range(n):
        prior = (sphere_logmap(q[i], s) @ w[i].T).sort(dim=0).values
        mine = (sphere_logmap(q[i], z) @ w[i].T).sort(dim=0).values
        total = total + (prior - mine).square().mean()
    return total / num_tangent_space


@pytest.mark.parametrize("normalised", [True, False])
def test_tangent_sw_matches_the_loop(normalised):
    z = torch.randn(12, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    if normalised:
        z = F.normalize(z, dim=1)
    fast = tangent_sw_uniformity(z, torch.Generator().manual_seed(12), projections=4)
    slow = loop_reference(z, torch.Generator().manual_seed(12), projections=4)
    assert fast.item() == pytest.approx(slow.item(), rel=1e-10)


def test_tangent_sw_penalises_collapse_with_finite_gradients():
    spread = unit(64, 8, 13).requires_grad_()
    collapsed = unit(1, 8, 14).expand(64, 8).clone().requires_grad_()
    low = tangent_sw_uniformity(spread, torch.Generator().manual_seed(15))
    high = tangent_sw_uniformity(collapsed, torch.Generator().manual_seed(15))
    assert high > 3 * low
    (low + high).backward()
    for z in (spread, collapsed):
        assert torch.isfinite(z.grad).all() and z.grad.norm() > 0


def test_bad_parameters_name_the_field():
    z = unit(4, 3, 0)
    with pytest.raises(UsageError, match="tau_a"):
        uot_uniformity(z, tau_a=0.0)
    with pytest.raises(UsageError, match="step"):
        uot_uniformity(z, step="sinkhorn")
    with pytest.raises(UsageError, match="iters"):
        uot_uniformity(z, iters=0)
    with pytest.raises(UsageError, match="projections"):
        tangent_sw_uniformity(z, projections=0)
    assert math.isfinite(uot_uniformity(z, torch.Generator().manual_seed(0)).item())
