"""Clustering on the sphere for federated self-supervised methods (Orchestra,
fedmpi.algorithms.orchestra): Sinkhorn-Knopp equal-size assignments, equal-size K-means,
the Orchestra server's SGD clustering, and generators keyed by (seed, purpose, key)
alone, so a clustering gives the same bits on any rank count."""

from __future__ import annotations

import zlib

import numpy as np
import torch
import torch.nn.functional as F


@torch.no_grad()
def sinkhorn(scores: torch.Tensor, lam: float = 25.0, max_iters: int = 100,
             tol: float = 1e-2) -> torch.Tensor:
    """Equal-size soft assignments of N samples to K centroids from ``scores`` [N, K]
    (the code's ``sknopp``): P = diag(c) softmax(lam scores) diag(r), alternately scaling
    the centroids' mass to 1/K and the samples' to 1/N; stops when the samples' scaling
    changes by less than ``tol`` (sum of relative changes, checked every 10th iteration).
    Returns N P: every row sums to 1, every column to about N / K."""
    n, k = scores.shape
    probs = F.softmax(scores * lam, dim=1).T                      # [K, N]
    c = torch.full((n, 1), 1.0 / n, dtype=probs.dtype, device=probs.device)
    r = torch.full((k, 1), 1.0 / k, dtype=probs.dtype, device=probs.device)
    for it in range(max_iters):
        r = (1.0 / k) / (probs @ c)
        c_new = (1.0 / n) / (r.T @ probs).T
        stop = False
        if it % 10 == 0:   # clustering only, never per step
            stop = float(torch.nansum(torch.abs(c / c_new - 1))) < tol  # host sync: once per 10 iterations
        c = c_new
        if stop:
            break
    return (probs * c.reshape(1, n)).T * r.reshape(1, k) * n


@torch.no_grad()
def equal_size_kmeans(z: torch.Tensor, k: int, iters: int, generator: torch.Generator,
                      lam: float = 25.0, sinkhorn_iters: int = 10) -> torch.Tensor:
    """K-means of the rows of ``z`` [N, D] into k unit centroids with equal-size
    assignments (the code's ``local_clustering``): start from k distinct random rows;
    per iteration assign each row to argmax_j SK(z C^T)_ij, C_j = normalize(mean of its
    rows), an empty cluster takes a random row. ``generator`` (CPU) draws every index,
    the same count whatever the data, so the stream never depends on it."""
    n = z.shape[0]
    if n < k:
        raise ValueError(f"{n} rows cannot start {k} distinct centroids")
    start = torch.randperm(n, generator=generator)[:k]
    centroids = z[start.to(z.device)].clone()
    for _ in range(iters):
        choice = sinkhorn(z @ centroids.T, lam, sinkhorn_iters).argmax(dim=1)
        onehot = F.one_hot(choice, k).to(z.dtype)                 # [N, k]
        sums, counts = onehot.T @ z, onehot.sum(dim=0)
        reseed = z[torch.randint(n, (k,), generator=generator).to(z.device)]
        centroids = F.normalize(torch.where(counts[:, None] > 0, sums, reseed), dim=1)
    return centroids


def sgd_clustering(z: torch.Tensor, centroids: torch.Tensor, temperature: float, steps: int,
                   lr: float, momentum: float, weight_decay: float, lam: float = 25.0,
                   sinkhorn_iters: int = 100) -> torch.Tensor:
    """The code's server clustering: ``steps`` steps of torch.optim.SGD (momentum buffer
    new, dampening 0, weight decay in the gradient) on C [G, D] for
    -mean_i cos(SK(z C^T)_i, softmax(normalize(z_i) C^T / T)), rows of C renormalised after
    every step."""
    zn = F.normalize(z, dim=1)
    c, buf = centroids.detach().clone(), None
    for _ in range(steps):
        target = sinkhorn(z @ c.T, lam, sinkhorn_iters)
        c.requires_grad_(True)
        with torch.enable_grad():
            probs = F.softmax(zn @ c.T / temperature, dim=1)
            loss = -F.cosine_similarity(target, probs, dim=-1).mean()
            (grad,) = torch.autograd.grad(loss, c)
        with torch.no_grad():
            c = c.detach()
            step = grad + weight_decay * c
            buf = step if buf is None else buf.mul_(momentum).add_(step)
            c = F.normalize(c - lr * buf, dim=1)
    return c


def generator_for(seed: int, purpose: str, *key: int, device="cpu") -> torch.Generator:
    """A torch generator keyed by (seed, purpose, key) alone (never by rank)."""
    state = np.random.SeedSequence([int(seed), zlib.crc32(purpose.encode()), *map(int, key)])
    g = torch.Generator(device=device)
    g.manual_seed(int(state.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1)))  # host sync: none, numpy
    return g
