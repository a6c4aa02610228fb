"""FedU^2's efficient unified aggregator (EUA): min-norm client weights on the simplex (pure).

Liao et al., "Rethinking the Representation in Federated Unsupervised Learning with
Non-IID Data", CVPR 2024, https://arxiv.org/abs/2403.16398, section 3.4.
With u_k = ||theta_g - theta_k||^2 and client update Delta_k = theta_k - theta_g,

    v_k = grad log u_k = 2 (theta_g - theta_k) / u_k = -2 Delta_k / s_k,
    p* = argmin_{p in simplex} p^T G p,   G_kl = <v_k, v_l> = 4 <Delta_k, Delta_l> / (s_k s_l),
    d* = (eta_g / phi) sum_k p*_k v_k,   theta_g <- theta_g - eta d*,

with s_k = u_k = ||Delta_k||^2 (variant "paper") or s_k = ||Delta_k|| (variant "code",
XeniaLLL/FedU2 src/my/algo/commons/mtl.py: unit-length directions times 2). The variants
only rescale the rows and columns of the Gram matrix of the raw updates, so the runtime
can compute <Delta_k, Delta_l> where the vectors are and ship a K x K matrix. The server
step is a weighted sum of the updates: theta_g - lr d = theta_g + lr sum_k c_k Delta_k with
c_k = 2 p_k / s_k (``update_coefficients``).

The QP is solved exactly (to a certified Frank-Wolfe duality gap) by Wolfe's min-norm-point
algorithm on G (P. Wolfe, "Finding the nearest point in a polytope", Math. Programming
11, 1976), a finite active-set method that keeps its support affinely independent; the
paper's ADMM (Eq. 12, with a slip: rho I should be rho 1 1^T) and the code's MinNormSolver
are replaced by it. K = 2 uses the closed form of MinNormSolver._min_norm_element_from2.
A client with Delta_k = 0 has no defined direction (u_k = 0); ``eua_weights`` leaves it out
of the QP (p_k = 0) instead of letting its zero vector stop the server.
"""

from __future__ import annotations

import numpy as np
import torch

from fedmpi.errors import UsageError

VARIANTS = ("paper", "code")
GAP_TOL = 1e-12  # relative to max_k G_kk


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        allowed = ", ".join(map(repr, VARIANTS))
        raise UsageError(f"eua variant={variant!r}: must be one of {allowed}")


def _scales(norms: np.ndarray, variant: str) -> np.ndarray:
    """s_k: ||Delta_k||^2 (paper) or ||Delta_k|| (code)."""
    _check_variant(variant)
    return norms ** 2 if variant == "paper" else norms.copy()


def _inverse(scales: np.ndarray) -> np.ndarray:
    """1 / s_k, and 0 for a client that did not move (s_k = 0)."""
    out = np.zeros_like(scales)
    np.divide(1.0, scales, out=out, where=scales > 0)
    return out


def _stack(deltas) -> torch.Tensor:
    return deltas if isinstance(deltas, torch.Tensor) else torch.stack(list(deltas))


def directions(deltas, variant: str) -> torch.Tensor:
    """v_k = -2 Delta_k / s_k as [K, d] (0 for Delta_k = 0); deltas [K, d] or K tensors."""
    stacked = _stack(deltas)
    # host sync: server side, once per round
    norms = torch.linalg.vector_norm(stacked.double(), dim=1).cpu().numpy()
    coef = -2 * _inverse(_scales(norms, variant))
    return stacked * torch.as_tensor(coef, dtype=stacked.dtype, device=stacked.device)[:, None]


def gram_from_inner(inner_products, variant: str, norms=None) -> np.ndarray:
    """G_kl = 4 <Delta_k, Delta_l> / (s_k s_l) from the K x K raw inner products (float64);
    norms ||Delta_k|| default to sqrt of the diagonal. Rows of non-moving clients are 0."""
    inner = np.asarray(inner_products, dtype=np.float64)
    if inner.ndim != 2 or inner.shape[0] != inner.shape[1]:
        raise ValueError(f"inner products must be K x K, got shape {inner.shape}")
    if norms is None:
        norms = np.sqrt(np.clip(np.diag(inner), 0, None))
    inv = _inverse(_scales(np.asarray(norms, dtype=np.float64), variant))
    gram = 4 * inner * inv[:, None] * inv[None, :]
    return (gram + gram.T) / 2


def min_norm_weights(gram, tol: float = GAP_TOL) -> np.ndarray:
    """Exact argmin_{p in simplex} p^T G p for a PSD K x K Gram matrix (float64 result).

    Stops when the Frank-Wolfe gap p^T G p - min_k (G p)_k (>= the objective's suboptimality)
    is <= tol * max_k G_kk; the result is always on the simplex.
    """
    g = np.asarray(gram, dtype=np.float64)
    if g.ndim != 2 or g.shape[0] != g.shape[1] or g.shape[0] == 0:
        raise ValueError(f"gram must be a non-empty K x K matrix, got shape {g.shape}")
    if not np.all(np.isfinite(g)):
        raise ValueError("gram has non-finite entries")
    g = (g + g.T) / 2
    k = g.shape[0]
    if k == 1:
        return np.ones(1)
    if k == 2:
        return _two(g)
    scale = float(np.max(np.diag(g)))
    if scale <= 0:  # every direction is 0: any p is optimal
        return np.full(k, 1.0 / k)
    # p* is invariant to scaling G; unit diagonal scale keeps the KKT systems, whose
    # constraint rows are O(1), well balanced
    return _wolfe(g / scale, tol)


def _two(g: np.ndarray) -> np.ndarray:
    """p1 = clip((G22 - G12) / (G11 + G22 - 2 G12), 0, 1); 1/2 for identical directions."""
    denom = g[0, 0] + g[1, 1] - 2 * g[0, 1]
    p1 = 0.5 if denom <= 0 else float(np.clip((g[1, 1] - g[0, 1]) / denom, 0.0, 1.0))
    return np.array([p1, 1.0 - p1])


def _wolfe(g: np.ndarray, gap_tol: float) -> np.ndarray:
    """Wolfe's min-norm point on the Gram matrix: support S and convex weights lam on it."""
    k = g.shape[0]
    support, lam = [int(np.argmin(np.diag(g)))], np.ones(1)
    for _ in range(50 * k + 100):  # finite in exact arithmetic; the cap guards rounding
        gp = g[:, support] @ lam
        j, value = int(np.argmin(gp)), float(lam @ gp[support])  # host sync: none, numpy
        if value - gp[j] <= gap_tol or j in support:
            break
        grown, weights = _minor_cycles(g, support + [j], np.append(lam, 0.0))
        if _norm2(g, grown, weights) >= value:  # rounding stalled the strict decrease
            break
        support, lam = grown, weights
    p = np.zeros(k)
    p[support] = lam
    return _on_simplex(p)


def _minor_cycles(g: np.ndarray, support: list[int], lam: np.ndarray):
    """Move lam to the affine minimiser of the support, dropping points that leave the hull."""
    while True:
        alpha = _affine_minimiser(g[np.ix_(support, support)])
        if np.all(alpha > 0):
            return support, alpha
        out = alpha <= 0
        ratio = np.zeros(int(out.sum()))  # host sync: none, numpy
        np.divide(lam[out], lam[out] - alpha[out], out=ratio, where=lam[out] - alpha[out] > 0)
        theta = float(np.min(ratio))
        lam = (1 - theta) * lam + theta * alpha
        keep = lam > 0
        keep[np.argmin(np.where(out, lam, np.inf))] = False  # the blocking point always leaves
        support, lam = [s for s, kept in zip(support, keep) if kept], lam[keep]
        lam = lam / lam.sum()


def _norm2(g: np.ndarray, support: list[int], lam: np.ndarray) -> float:
    return float(lam @ g[np.ix_(support, support)] @ lam)  # host sync: none, numpy


def _affine_minimiser(g_ss: np.ndarray) -> np.ndarray:
    """Weights (summing to 1) of the min-norm point of the affine hull: the KKT system
    [[G, 1], [1^T, 0]] [alpha; mu] = [0; 1], by least squares for near-singular G."""
    m = g_ss.shape[0]
    kkt = np.zeros((m + 1, m + 1))
    kkt[:m, :m], kkt[:m, m], kkt[m, :m] = g_ss, 1.0, 1.0
    rhs = np.zeros(m + 1)
    rhs[m] = 1.0
    alpha = np.linalg.lstsq(kkt, rhs, rcond=None)[0][:m]
    return alpha / alpha.sum()


def _on_simplex(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 0.0, None)
    return p / p.sum()


def duality_gap(gram, p) -> float:
    """Frank-Wolfe gap p^T G p - min_k (G p)_k: >= p^T G p - min over the simplex."""
    g, p = np.asarray(gram, dtype=np.float64), np.asarray(p, dtype=np.float64)
    gp = g @ p
    return float(p @ gp - gp.min())  # host sync: none, numpy


def eua_weights(inner_products, variant: str, norms=None) -> np.ndarray:
    """p* over all K clients from raw <Delta_k, Delta_l>; clients with Delta_k = 0 get 0
    (uniform if no client moved)."""
    inner = np.asarray(inner_products, dtype=np.float64)
    if norms is None:
        norms = np.sqrt(np.clip(np.diag(inner), 0, None))
    norms = np.asarray(norms, dtype=np.float64)
    moved = np.flatnonzero(norms > 0)
    p = np.zeros(len(norms))
    if len(moved) == 0:
        return np.full(len(norms), 1.0 / len(norms))
    gram = gram_from_inner(inner[np.ix_(moved, moved)], variant, norms[moved])
    p[moved] = min_norm_weights(gram)
    return p


def update_coefficients(p, norms, variant: str) -> np.ndarray:
    """c_k = 2 p_k / s_k, so that theta_g - lr sum_k p_k v_k = theta_g + lr sum_k c_k Delta_k."""
    norms = np.asarray(norms, dtype=np.float64)
    return 2 * np.asarray(p, dtype=np.float64) * _inverse(_scales(norms, variant))


def eua_step(p, deltas, variant: str) -> torch.Tensor:
    """The server direction d = sum_k p_k v_k (the paper's d* up to eta_g / phi); the server
    moves theta_g <- theta_g - lr d, towards the clients."""
    stacked = _stack(deltas)
    weights = torch.as_tensor(np.asarray(p, dtype=np.float64), dtype=stacked.dtype,
                              device=stacked.device)
    return weights @ directions(stacked, variant)

