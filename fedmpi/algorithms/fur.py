"""FedU^2's flexible uniform regulariser (FUR) l_u(Z): the paper's UOT and the code's tangent SW.

Liao et al., "Rethinking the Representation in Federated Unsupervised Learning with
Non-IID Data", CVPR 2024, https://arxiv.org/abs/2403.16398, section 3.3.
A client's loss is l_ssl(Z^1, Z^2) + lambda_U (l_u(Z^1) + l_u(Z^2)) on each view's
representations Z (B x d). Two variants:

``uot_uniformity`` (paper, Eq. 4-6). S_B = normalise(N(0, I)), B x d, fresh per call;
C_ij = c(z_i, s_j); unbalanced OT with quadratic marginal penalties

    l_u(Z) = min_{pi >= 0} <C, pi> + tau_a/2 ||pi 1 - a||^2 + tau_b/2 ||pi^T 1 - b||^2,

solved by projected steepest descent from pi = a b^T with the exact step of the quadratic,
eta* = ||D||_F^2 / (tau_a ||D 1||^2 + tau_b ||D^T 1||^2), pi <- max(0, pi - eta* D), D the
gradient G = C + tau_a (pi 1 - a) 1^T + tau_b 1 (pi^T 1 - b)^T. ``step="eq6"`` (default,
the paper) uses D = G; ``step="projected"`` zeroes the entries of G that push a zero entry of
pi below zero (the projected gradient; equal to Eq. 6 in the interior), which converges much
faster: on B=128, d=512 unit vectors 50 steps leave an objective gap of ~0.06 against ~0.8
for Eq. 6 (optimum ~82.4). pi* is solved without autograd and l_u is the objective at pi*
with C differentiable: by the envelope theorem that is the gradient of the minimum.

Scale (docs/algorithms.md, FedU^2): c = 0.5 ||z - s||^2 and a = b = 1 (unit mass per sample) by default. The printed
convention c = ||z - s||^2 with a = b = 1/B is inert: for unit vectors in high dimension
C_ij ~ 2 > tau_a a_i + tau_b b_j, so G(0) >= 0 entrywise, pi* = 0 is optimal (KKT) and l_u is
a constant with zero gradient (tested). With c = 0.5||.||^2 ~ 1 < tau_a + tau_b = 1.6 the
plan is non-trivial (~56 units of mass at B = 128).

``tangent_sw_uniformity`` (the released code's RepresentationTagentCollapse): B random
tangent points q_t and B uniform samples s on the sphere; for each q_t, log-map Z and S to
T_{q_t} S^{d-1}, project both on ``projections`` Gaussian (unnormalised) directions, sort
each 1-D projection and average the squared differences (sliced W2^2); the sum over the B
tangent points is divided by ``num_tangent_space`` (6 in the code). Written in inner
products, so no B x B x d tensor is formed.

Neither variant normalises Z: the paper applies l_u to l2-normalised projector outputs, the
code to raw projector outputs (normalised for SimCLR only); the caller chooses. Randomness:
every draw comes from ``generator`` (on its device) or torch's global RNG when it is None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedmpi.errors import UsageError

STEPS = ("eq6", "projected")
STOP_CHECK = 10  # UOT steps between the host's reads of the stop flag on a GPU
_ACOS_EPS = {torch.float32: 1e-4, torch.float64: 1e-7}  # geoopt Sphere's clamp of <x, y>


def uniform_sphere(n: int, d: int, generator: torch.Generator | None,
                   like: torch.Tensor) -> torch.Tensor:
    """n points uniform on S^{d-1}: normalised N(0, I) draws, dtype/device of ``like``."""
    device = generator.device if generator is not None else like.device
    draws = torch.randn(n, d, generator=generator, device=device, dtype=like.dtype)
    return F.normalize(draws, dim=1).to(like.device)


@torch.no_grad()
def uot_plan(cost: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tau_a: float = 0.8,
             tau_b: float = 0.8, iters: int = 50, tol: float = 1e-6,
             step: str = "eq6") -> torch.Tensor:
    """pi* of min_{pi >= 0} <C, pi> + tau_a/2||pi1 - a||^2 + tau_b/2||pi^T 1 - b||^2.

    At most ``iters`` steps from a b^T; stops once ||pi_new - pi||_F <= tol ||pi||_F or
    the step direction vanishes (a KKT point). The stop is decided on the device: pi
    freezes there, and the host reads the flag only every ``STOP_CHECK`` steps on a GPU
    (every step on the CPU, where reading costs nothing); the extra steps leave pi as it is.
    """
    pi = torch.outer(a, b).to(cost.dtype)
    stopped = torch.zeros((), dtype=torch.bool, device=cost.device)
    check = 1 if cost.device.type == "cpu" else STOP_CHECK
    for i in range(iters):
        grad = cost + tau_a * (pi.sum(1) - a)[:, None] + tau_b * (pi.sum(0) - b)[None, :]
        if step == "projected":
            grad = grad.masked_fill((pi <= 0) & (grad > 0), 0.0)
        curvature = tau_a * grad.sum(1).square().sum() + tau_b * grad.sum(0).square().sum()
        flat = curvature <= 0  # D = 0, or D 1 = D^T 1 = 0: no descent along D, pi stays
        new = (pi - grad * (grad.square().sum() / curvature)).clamp_min_(0)
        change, size = torch.linalg.vector_norm(new - pi), torch.linalg.vector_norm(pi)
        pi = torch.where(stopped | flat, pi, new)
        # compared in float64 as the host did (tol * size rounded to float32 could differ)
        stopped = stopped | flat | (change.double() <= tol * size.double())
        if (i + 1) % check == 0 and bool(stopped):  # host sync: the stop, every `check` steps
            break
    return pi


def squared_distances(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """||x_i - y_j||^2 as ||x_i||^2 + ||y_j||^2 - 2 x_i.y_j: smooth everywhere (the gradient
    of cdist(x, y)^2 goes through ||.|| and is undefined at coinciding points)."""
    return x.square().sum(1)[:, None] + y.square().sum(1)[None, :] - 2 * x @ y.T


def uot_objective(cost, pi, a, b, tau_a: float, tau_b: float) -> torch.Tensor:
    """<C, pi> + tau_a/2 ||pi 1 - a||^2 + tau_b/2 ||pi^T 1 - b||^2 (differentiable in C)."""
    return ((cost * pi).sum() + tau_a / 2 * (pi.sum(1) - a).square().sum()
            + tau_b / 2 * (pi.sum(0) - b).square().sum())


def uot_divergence(z: torch.Tensor, samples: torch.Tensor, tau_a: float = 0.8, tau_b: float = 0.8,
                   iters: int = 50, tol: float = 1e-6, cost_scale: float = 0.5,
                   mass: float = 1.0, step: str = "eq6") -> torch.Tensor:
    """l_u between the rows of z (B x d) and given samples (M x d); a = mass 1_B, b = mass 1_M."""
    _check_uot(tau_a, tau_b, iters, tol, cost_scale, mass, step)
    cost = cost_scale * squared_distances(z, samples.to(z.dtype))
    a = torch.full((z.shape[0],), mass, dtype=z.dtype, device=z.device)
    b = torch.full((samples.shape[0],), mass, dtype=z.dtype, device=z.device)
    pi = uot_plan(cost.detach(), a, b, tau_a, tau_b, iters, tol, step)
    return uot_objective(cost, pi, a, b, tau_a, tau_b)


def uot_uniformity(z: torch.Tensor, generator: torch.Generator | None = None, tau_a: float = 0.8,
                   tau_b: float = 0.8, iters: int = 50, tol: float = 1e-6,
                   cost_scale: float = 0.5, mass: float = 1.0, step: str = "eq6") -> torch.Tensor:
    """The paper's FUR l_u(Z) against B fresh uniform-sphere samples S_B."""
    samples = uniform_sphere(z.shape[0], z.shape[1], generator, z.detach())
    return uot_divergence(z, samples, tau_a, tau_b, iters, tol, cost_scale, mass, step)


def _check_uot(tau_a, tau_b, iters, tol, cost_scale, mass, step) -> None:
    for name, value in (("tau_a", tau_a), ("tau_b", tau_b), ("cost_scale", cost_scale),
                        ("mass", mass)):
        if not value > 0:
            raise UsageError(f"fur {name}={value}: must be > 0")
    if not (isinstance(iters, int) and iters >= 1):
        raise UsageError(f"fur iters={iters}: must be an integer >= 1")
    if not tol >= 0:
        raise UsageError(f"fur tol={tol}: must be >= 0")
    if step not in STEPS:
        raise UsageError(f"fur step={step!r}: must be one of {', '.join(map(repr, STEPS))}")


def sphere_logmap(q: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log_q(y) on the unit sphere, as geoopt's Sphere.logmap: u = y - <q, y> q,
    theta = arccos(clamp(<q, y>, -1 + eps, 1 - eps)); theta u / ||u|| (u if theta <= eps)."""
    eps = _ACOS_EPS.get(y.dtype, 1e-4)
    inner = (q * y).sum(-1, keepdim=True)
    u = y - inner * q
    theta = torch.acos(inner.clamp(-1 + eps, 1 - eps))
    scale = theta / torch.linalg.vector_norm(u, dim=-1, keepdim=True).clamp_min(eps)
    return u * torch.where(theta > eps, scale, torch.ones_like(scale))


def _tangent_projections(y: torch.Tensor, q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """<log_{q_t}(y_n), w_tp> for all n, t, p as [T, P, N], from inner products only.

    <log_q y, w> = scale * (<y, w> - <q, y><q, w>) with ||u||^2 = ||y||^2 - 2c^2 + c^2||q||^2.
    """
    t, p, d = w.shape
    eps = _ACOS_EPS.get(y.dtype, 1e-4)
    c = y @ q.T                                                   # [N, T]
    u_sq = y.square().sum(1, keepdim=True) - 2 * c.square() + c.square() * q.square().sum(1)
    theta = torch.acos(c.clamp(-1 + eps, 1 - eps))
    scale = theta / u_sq.clamp_min(eps * eps).sqrt()
    scale = torch.where(theta > eps, scale, torch.ones_like(scale))
    yw = (y @ w.reshape(t * p, d).T).view(-1, t, p)               # [N, T, P]
    qw = (q[:, None, :] * w).sum(-1)                              # [T, P]
    return (scale[..., None] * (yw - c[..., None] * qw)).permute(1, 2, 0)


def tangent_sw_uniformity(z: torch.Tensor, generator: torch.Generator | None = None,
                          projections: int = 6, num_tangent_space: float = 6.0) -> torch.Tensor:
    """The released code's FUR: sum over B random tangent points of the sliced W2^2 between
    the log-maps of Z and of B uniform samples, divided by ``num_tangent_space``.

    Draws, in order: B tangent points, B uniform samples, a [B, projections, d] Gaussian.
    """
    if not (isinstance(projections, int) and projections >= 1):
        raise UsageError(f"fur projections={projections}: must be an integer >= 1")
    if not num_tangent_space > 0:
        raise UsageError(f"fur num_tangent_space={num_tangent_space}: must be > 0")
    n, d = z.shape
    ref = z.detach()
    q = uniform_sphere(n, d, generator, ref)
    s = uniform_sphere(n, d, generator, ref)
    device = generator.device if generator is not None else z.device
    w = torch.randn(n, projections, d, generator=generator, device=device, dtype=z.dtype)
    w = w.to(z.device)
    mine = _tangent_projections(z, q, w).sort(dim=-1).values
    prior = _tangent_projections(s, q, w).sort(dim=-1).values
    per_point = (prior - mine).square().mean(dim=(1, 2))         # one sliced W2^2 per q_t
    return per_point.sum() / num_tangent_space
