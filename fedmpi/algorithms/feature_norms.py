"""Class-average feature norms and FNR-FL's regulariser, as pure pieces.

Symbols of the paper: phi(x) the penultimate representation (``module.features``),
F_i[l] the mean of ||phi(x)||_2 over the public samples of class l under client i's model,
A_i its accuracy there, S_re the refined clients, and for j in S_re

    Delta_j[l] = sum_{m in M_j} (F_m[l] - F_j[l]),
    M_j = S \\ S_re (paper, Alg. 2)  or  S \\ {j} (authors' code, calculate_feature_norm_diff).

The paper's regulariser lambda sum_{l in B} (n_l(B)/|B|) Delta_j[l] is a constant of the
batch (zero gradient); the differentiable extension (NOT in the paper) is
sum_{l in B} (n_l(B)/|B|) (Fbar_j[l] - F_j^B[l])^2 with Fbar_j[l] = mean_{m in M_j} F_m[l]
and F_j^B[l] the batch's class-l mean norm computed with gradient.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

MEASURE_BATCH = 256  # only the forward pass: a large batch, no gradient


@torch.no_grad()
def class_feature_norms(module, data, num_classes: int) -> tuple[torch.Tensor, float]:
    """(F [C], accuracy) of ``module`` over one pass of ``data`` (a ClientData).

    Classes with no sample get F = 0: they never occur in a batch, so their Delta is unused.
    Sums and counts stay on the device until the pass is over (one read, not one per batch).
    """
    was_training = module.training
    module.eval()
    sums = counts = correct = None
    for x, y in data.batches(1, MEASURE_BATCH):
        feats = module.features(x)
        norms = torch.linalg.vector_norm(feats.flatten(1), dim=1).double()
        if sums is None:
            sums = torch.zeros(num_classes, dtype=torch.float64, device=norms.device)
            counts = torch.zeros_like(sums)
            correct = torch.zeros((), dtype=torch.int64, device=norms.device)
        sums.index_add_(0, y, norms)
        counts += class_counts(y, num_classes, torch.float64)
        correct += (module.classifier(feats).argmax(1) == y).sum()
    module.train(was_training)
    sums, counts = sums.cpu(), counts.cpu()  # host sync: once per measurement, its result
    total, correct = float(counts.sum()), int(correct)  # host sync: once per measurement
    means = sums / counts.clamp_min(1.0)
    return means.float(), correct / max(total, 1.0)


def refine_sets(num: int, selected: np.ndarray, over: str) -> list[np.ndarray]:
    """M_j (positions into the S participants) for each selected position j."""
    kept = np.setdiff1d(np.arange(num), selected)
    if over == "unselected":
        return [kept for _ in selected]
    return [np.setdiff1d(np.arange(num), [j]) for j in selected]


def norm_differences(norms: np.ndarray, selected: np.ndarray, over: str) -> np.ndarray:
    """Delta_j for each selected position: rows of sum_{m in M_j} (F_m - F_j), float64."""
    sets = refine_sets(len(norms), selected, over)
    return np.stack([(norms[m] - norms[j]).sum(axis=0) for j, m in zip(selected, sets)]) \
        if len(selected) else np.zeros((0, norms.shape[1]))


def norm_targets(norms: np.ndarray, selected: np.ndarray, over: str) -> np.ndarray:
    """Fbar_j = mean_{m in M_j} F_m for each selected position (the extension's target)."""
    sets = refine_sets(len(norms), selected, over)
    return np.stack([norms[m].mean(axis=0) for m in sets]) \
        if len(selected) else np.zeros((0, norms.shape[1]))


def class_counts(y: torch.Tensor, num_classes: int, dtype=torch.float32) -> torch.Tensor:
    """n_l(B) for every class, exact integers as ``dtype``: torch.bincount would read the
    labels' maximum on the host (a GPU sync) to size its output."""
    return torch.zeros(num_classes, dtype=dtype, device=y.device).index_add_(
        0, y, torch.ones(y.shape, dtype=dtype, device=y.device))


def class_weights(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """rho_l = n_l(B) / |B| for every class (0 for classes not in the batch)."""
    return class_counts(y, num_classes) / y.numel()


def constant_penalty(y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """sum_{l in B} (n_l(B)/|B|) Delta_j[l]: a number with no gradient (the paper's term)."""
    return (class_weights(y, delta.numel()) * delta).sum()


def differentiable_penalty(feats: torch.Tensor, y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """sum_{l in B} rho_l (Fbar_j[l] - F_j^B[l])^2, F_j^B with gradient (NOT in the paper)."""
    norms = torch.linalg.vector_norm(feats.flatten(1), dim=1)
    counts = class_counts(y, target.numel(), norms.dtype)
    sums = torch.zeros_like(target, dtype=norms.dtype).index_add(0, y, norms)
    batch_means = sums / counts.clamp_min(1.0)
    return ((counts / y.numel()) * (target - batch_means).square()).sum()


class RefineLoss:
    """loss_fn(module, x, y) of the refinement: the task loss (CE when ``base_loss`` is None)
    plus lam * J, J the penalty of ``mode``; ``signal`` is Delta_j (faithful) or Fbar_j
    (differentiable). Keeps the sum of J over its calls: the paper's J is only logged."""

    def __init__(self, mode: str, lam: float, signal: torch.Tensor, base_loss=None):
        self.mode, self.lam, self.signal, self.base_loss = mode, lam, signal, base_loss
        self.penalty_sum = torch.zeros((), device=signal.device)
        self.calls = 0

    def __call__(self, module, x, y) -> torch.Tensor:
        if self.mode == "faithful":
            loss = self.base_loss(module, x, y) if self.base_loss else F.cross_entropy(module(x), y)
            penalty = constant_penalty(y, self.signal).detach()   # a number: no gradient
        else:
            feats = module.features(x)
            loss = self.base_loss(module, x, y) if self.base_loss \
                else F.cross_entropy(module.classifier(feats), y)
            penalty = differentiable_penalty(feats, y, self.signal)
        self.penalty_sum += penalty.detach()
        self.calls += 1
        return loss + self.lam * penalty

    def mean_penalty(self) -> float:
        return float(self.penalty_sum) / max(self.calls, 1)  # host sync: once per client
