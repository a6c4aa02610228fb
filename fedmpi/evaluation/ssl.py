"""Evaluating a self-supervised encoder: kNN monitor, linear probe, semi-supervised
fine-tuning, and the singular-value spectrum of its features.

Protocols of FedU^2 (Liao et al., "Rethinking the Representation in Federated
Unsupervised Learning with Non-IID Data", CVPR 2024, https://arxiv.org/abs/2403.16398)
[code: XeniaLLL/FedU2 src/my/algo/commons/evaluate.py, linear_eval.py, semi_eval.py]:

- kNN (InstDisc monitor): z = encoder(x) / ||encoder(x)||, bank = the whole training
  set; for a test z the k = 200 largest cosine similarities s_j, weights exp(s_j / T),
  T = 0.1; class score = sum of the weights of its neighbours; prediction = argmax.
- Linear probe: Linear(F, C) on frozen features, Adam lr 3e-3, 200 epochs, batch 512.
- Semi-supervised: 1% / 10% of the training set (stratified), encoder + Linear trained
  jointly by SGD (momentum 0.9, lr 1e-3 encoder, 0.3 head), 200 epochs, batch 128,
  random resized crop (scale 0.64-1, ratio 1) + flip; best of the evaluations.
- Spectrum (FedU^2 Figure 3): singular values of the covariance of the centred
  features, descending (log10 for the plot); `effective_rank` summarises it.

Sharding (the lead's runtime; every worker holds the whole data set). Features are
computed in fixed chunks of `chunk_size` rows (`features` starts a batch every
`chunk_size` rows), so a chunk's features do not depend on which worker computes them.
kNN: bank chunk j goes to worker j mod W; the worker computes the bank chunk's features
and `knn_partial(test_feats, bank_chunk, labels_chunk, k, bank_offset)` against ALL test
features (the test set is small next to the bank: compute it on every worker, or shard
it and allgather N_test x F floats). `merge_partials` is exact and associative, so a
worker first merges its own chunks, and the server (or an MPI tree reduction) merges
the workers' lists; `knn_vote` turns the final list into predictions. Traffic: per
worker N_test x k x (4 + 8 + 8) bytes (similarity, bank index, label: 40 MB for
10 000 test samples, k = 200; 12 bytes if the label is dropped and looked up from the
index, which every worker can do), instead of N_bank x F x 4 bytes of bank features
(100 MB for 50 000 x 512). Layout independence: the candidates are totally ordered by
(similarity descending, bank index ascending), and similarities come from matrix
products of ONE fixed shape (TEST_BLOCK x F) @ (F x BANK_BLOCK), zero-padded, so a pair's
similarity does not depend on how the bank or the test set was split (BLAS picks a
different kernel for other shapes, e.g. a single row; checked bitwise on MKL).
Spectrum: per-chunk `covariance_sums` (n, mean, centred scatter: F + F^2 float64)
combined in chunk order by `combine_covariance_sums` (Chan et al.'s pairwise update).
Linear probe: one rank, on gathered features ([N, F], cheap next to the forward passes).
Fine-tuning: one sequential training run per labelled fraction, so task-parallel (the
1% and 10% runs on different workers), not sharded.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedmpi.data.augment import to_float
from fedmpi.errors import UsageError

Prepare = Callable[[torch.Tensor], torch.Tensor]
"""A uint8 (or raw) batch -> the encoder's input (e.g. ``lambda x: data.prepare(x, None)``)."""
Augment = Callable[[torch.Tensor, torch.Generator], torch.Tensor]
"""A prepared float batch [B, C, H, W] and a generator -> an augmented batch."""

TEST_BLOCK = 256    # rows of test features per similarity product
BANK_BLOCK = 4096   # rows of bank features per similarity product (bank chunks: multiples)
_NO_INDEX = torch.iinfo(torch.int64).max  # bank index of padding entries (sorts last)


def _positive(name: str, value, integer: bool = True) -> None:
    ok = (isinstance(value, int) and not isinstance(value, bool)) if integer else \
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise UsageError(f"{name} must be {kind}, got {value!r}")


def _as_input(x: torch.Tensor, prepare: Prepare | None) -> torch.Tensor:
    if prepare is not None:
        return prepare(x)
    return to_float(x) if x.dtype == torch.uint8 else x.float()


# ---- features ----------------------------------------------------------------------------

@torch.no_grad()
def features(encoder: nn.Module, x: torch.Tensor, prepare: Prepare | None = None,
             chunk_size: int = 512, normalize: bool = False) -> torch.Tensor:
    """encoder(prepare(x)) as float32 [N, F], in eval mode, one batch per `chunk_size` rows.

    `prepare` None: uint8 -> x / 255, anything else -> float. `normalize`: each row
    divided by its L2 norm (the kNN monitor's z). The encoder's train/eval mode is restored.
    """
    _positive("chunk_size", chunk_size)
    was_training = encoder.training
    encoder.eval()
    try:
        out = []
        for start in range(0, len(x), chunk_size):
            z = encoder(_as_input(x[start:start + chunk_size], prepare)).float()
            out.append(F.normalize(z, dim=1) if normalize else z)
    finally:
        encoder.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, 0)


# ---- kNN monitor -------------------------------------------------------------------------

def _host(tensor: torch.Tensor):
    return tensor.detach().cpu().numpy()  # host sync: once per evaluation, to cross ranks


def _from_host(cls, *fields):
    return cls(*(torch.from_numpy(f) if hasattr(f, "dtype") else f for f in fields))


@dataclass(frozen=True)
class KnnPartial:
    """Each test sample's k best bank entries, ordered by (sim descending, index ascending).

    Missing entries (a bank smaller than k) have sim -inf, index int64 max, label 0.
    """
    sims: torch.Tensor    # [N, k] float32 cosine similarities
    index: torch.Tensor   # [N, k] int64 bank indices (position in the whole training set)
    labels: torch.Tensor  # [N, k] int64 labels of those bank entries

    def __reduce__(self):
        """Workers send these to the server: as host arrays, arriving as CPU tensors (a
        pickled GPU tensor would be unpickled onto a GPU the server must not touch)."""
        return _from_host, (KnnPartial, *(_host(t) for t in (self.sims, self.index, self.labels)))


def _first_k(sims: torch.Tensor, index: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k first by (sim desc, index asc); equal sims must already be in index order."""
    order = torch.sort(sims, dim=1, descending=True, stable=True).indices[:, :k]
    return sims.gather(1, order), index.gather(1, order)


def _block_best(sims: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's k best columns by (sim desc, column asc), returned in column order.

    topk's choice among values tied with the k-th is arbitrary, so it only gives the k-th
    value: every column above it is kept, then the first columns equal to it up to k. Exact
    without asking the host whether there is a tie. NaN counts as the largest value, as in
    a sort (similarities of normalised features are never infinite)."""
    n = sims.shape[1]
    column = torch.arange(n, device=sims.device)
    if n <= k:
        return sims, column.expand_as(sims)
    key = sims.masked_fill(sims.isnan(), math.inf)
    kth = key.topk(k, dim=1, sorted=False).values.min(1, keepdim=True).values  # k-th largest
    above, tied = key > kth, key == kth
    keep = above | (tied & (tied.cumsum(1) <= k - above.sum(1, keepdim=True)))
    cols = torch.where(keep, column, n).topk(k, dim=1, largest=False).values  # ascending
    return sims.gather(1, cols), cols


def _padded(rows: torch.Tensor, size: int) -> torch.Tensor:
    """`rows` zero-padded to `size` rows: every product then has the same shape."""
    if len(rows) == size:
        return rows
    out = rows.new_zeros((size, rows.shape[1]))
    out[:len(rows)] = rows
    return out


def _test_block_best(rows: torch.Tensor, bank_feats: torch.Tensor, k: int, bank_offset: int):
    """(sims, bank index) of the k best bank rows for <= TEST_BLOCK test rows."""
    m = len(rows)
    block = _padded(rows, TEST_BLOCK)
    best_sims = torch.full((m, k), -math.inf, dtype=rows.dtype, device=rows.device)
    best_index = torch.full((m, k), _NO_INDEX, dtype=torch.int64, device=rows.device)
    for b in range(0, len(bank_feats), BANK_BLOCK):
        n = min(BANK_BLOCK, len(bank_feats) - b)
        sims, cols = _block_best((block @ _padded(bank_feats[b:b + n], BANK_BLOCK).T)[:m, :n], k)
        # the running best come first and have smaller indices: index order holds
        best_sims, best_index = _first_k(torch.cat([best_sims, sims], 1),
                                         torch.cat([best_index, cols + (bank_offset + b)], 1), k)
    return best_sims, best_index


@torch.no_grad()
def knn_partial(test_feats: torch.Tensor, bank_feats: torch.Tensor, bank_labels: torch.Tensor,
                k: int = 200, bank_offset: int = 0) -> KnnPartial:
    """Top-k of every test sample within one contiguous bank chunk.

    Features must be L2-normalised (`features(..., normalize=True)`), so the dot product
    is the cosine similarity. Bank row i has index `bank_offset + i` in the whole bank.
    """
    _positive("k", k)
    if bank_offset < 0:
        raise UsageError(f"bank_offset must be >= 0, got {bank_offset}")
    if test_feats.dim() != 2 or bank_feats.dim() != 2 or len(bank_feats) != len(bank_labels):
        raise UsageError("knn_partial: features must be [N, F] and bank labels [N_bank]")
    blocks = [_test_block_best(test_feats[t:t + TEST_BLOCK], bank_feats, k, bank_offset)
              for t in range(0, len(test_feats), TEST_BLOCK)]
    sims = torch.cat([s for s, _ in blocks]) if blocks else test_feats.new_zeros((0, k))
    index = torch.cat([i for _, i in blocks]) if blocks else sims.new_zeros((0, k), dtype=torch.int64)
    labels = torch.zeros_like(index)
    if len(bank_labels):
        found = index != _NO_INDEX  # used as a mask: boolean indexing would wait for the host
        rows = torch.where(found, index - bank_offset, 0)
        labels = torch.where(found, bank_labels.to(index.device, torch.int64)[rows], labels)
    return KnnPartial(sims, index, labels)


def merge_partials(partials: Sequence[KnnPartial], k: int = 200) -> KnnPartial:
    """The exact top-k of the union of several chunks' lists (any grouping, any order)."""
    _positive("k", k)
    if not partials:
        raise UsageError("merge_partials: no partial results to merge")
    sims, index, labels = (torch.cat([getattr(p, f) for p in partials], 1)
                           for f in ("sims", "index", "labels"))
    by_index = torch.sort(index, dim=1, stable=True).indices
    sims, index, labels = sims.gather(1, by_index), index.gather(1, by_index), labels.gather(1, by_index)
    order = torch.sort(sims, dim=1, descending=True, stable=True).indices[:, :k]
    return KnnPartial(sims.gather(1, order), index.gather(1, order), labels.gather(1, order))


def knn_vote(partial: KnnPartial, num_classes: int, temperature: float = 0.1) -> torch.Tensor:
    """argmax_c sum_{j in top-k, label_j = c} exp(s_j / T): int64 predictions [N]."""
    _positive("num_classes", num_classes)
    _positive("temperature", temperature, integer=False)
    weights = torch.exp(partial.sims / temperature)  # padding: exp(-inf) = 0
    scores = weights.new_zeros((len(weights), num_classes))
    for j in range(weights.shape[1]):  # one neighbour per row and step: a fixed summation order
        scores.scatter_add_(1, partial.labels[:, j:j + 1], weights[:, j:j + 1])
    return scores.argmax(1)


def knn_merge(partials: Sequence[KnnPartial], k: int = 200, temperature: float = 0.1,
              num_classes: int = 10) -> torch.Tensor:
    """Predictions from every chunk's partial top-k lists."""
    return knn_vote(merge_partials(partials, k), num_classes, temperature)


def knn_predict(test_feats: torch.Tensor, bank_feats: torch.Tensor, bank_labels: torch.Tensor,
                num_classes: int, k: int = 200, temperature: float = 0.1) -> torch.Tensor:
    """Unsharded kNN predictions (L2-normalised features), equal to any sharded merge."""
    return knn_vote(knn_partial(test_feats, bank_feats, bank_labels, k), num_classes, temperature)


# ---- linear probe ------------------------------------------------------------------------

def _linear(in_features: int, out_features: int, generator: torch.Generator, device) -> nn.Linear:
    """nn.Linear with its default U(-1/sqrt(F), 1/sqrt(F)) init drawn from `generator`."""
    layer = nn.Linear(in_features, out_features)
    bound = 1.0 / math.sqrt(in_features)
    with torch.no_grad():
        for p in (layer.weight, layer.bias):
            u = torch.rand(p.shape, generator=generator, device=generator.device)
            p.copy_(u * (2 * bound) - bound)
    return layer.to(device)


def _batches(n: int, batch_size: int, generator: torch.Generator) -> Iterable[torch.Tensor]:
    order = torch.randperm(n, generator=generator, device=generator.device)
    return order.split(batch_size)


def standardize(train_feats: torch.Tensor, test_feats: torch.Tensor):
    """Both sets shifted and scaled by the training features' per-feature mean and std
    (BatchNorm without affine, with the exact training statistics); a constant feature is
    only shifted."""
    mean, std = train_feats.mean(0), train_feats.std(0, correction=0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return (train_feats - mean) / std, (test_feats - mean) / std


def linear_probe(train_feats: torch.Tensor, train_labels: torch.Tensor, test_feats: torch.Tensor,
                 test_labels: torch.Tensor, num_classes: int, generator: torch.Generator,
                 epochs: int = 200, lr: float = 3e-3, batch_size: int = 512,
                 head_input: str = "raw") -> float:
    """Test accuracy of Linear(F, C) trained by Adam on frozen features (no augmentation).

    `head_input`: "raw" (the features as they are: FedU^2's code) or "standard"
    (``standardize``: Adam's steps move the logits in proportion to the features' scale,
    so raw features of norm in the hundreds leave the probe oscillating). Initialisation
    and batch order come from `generator` only: deterministic.
    """
    for name, value in (("num_classes", num_classes), ("epochs", epochs), ("batch_size", batch_size)):
        _positive(name, value)
    _positive("lr", lr, integer=False)
    if head_input not in ("raw", "standard"):
        raise UsageError(f"head_input={head_input!r}: must be 'raw' or 'standard'")
    device = train_feats.device
    train_feats, test_feats = train_feats.float(), test_feats.float()
    if head_input == "standard":
        train_feats, test_feats = standardize(train_feats, test_feats)
    train_labels, test_labels = train_labels.to(device, torch.int64), test_labels.to(device, torch.int64)
    head = _linear(train_feats.shape[1], num_classes, generator, device)
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    for _ in range(epochs):
        for idx in _batches(len(train_feats), batch_size, generator):
            idx = idx.to(device)
            loss = F.cross_entropy(head(train_feats[idx]), train_labels[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        # host sync: once per probe, its result
        return float((head(test_feats).argmax(1) == test_labels).float().mean())


# ---- semi-supervised fine-tuning ---------------------------------------------------------

def stratified_subset(labels, fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of round(fraction * n_c) (at least 1) random samples of each class c."""
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0 < fraction <= 1:
        raise UsageError(f"fraction must be in (0, 1], got {fraction!r}")
    # host sync: once per evaluation, before any training
    labels = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels)
    rng = np.random.default_rng(seed)
    chosen = []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        count = max(1, int(math.floor(fraction * len(members) + 0.5)))
        chosen.append(rng.permutation(members)[:count])
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, dtype=np.int64)


def random_resized_crop_flip(x: torch.Tensor, generator: torch.Generator,
                             scale: tuple[float, float] = (0.64, 1.0),
                             ratio: tuple[float, float] = (1.0, 1.0), flip: bool = True) -> torch.Tensor:
    """Batched RandomResizedCrop (bilinear, back to H x W) + horizontal flip on float images.

    Per sample: area fraction s ~ U(scale), log aspect ratio ~ U(log ratio); crop
    w = sqrt(s H W r), h = sqrt(s H W / r) (clamped to the image, not rounded to pixels,
    no retries: a continuous torchvision RandomResizedCrop), position uniform. Commutes
    with per-channel normalisation, so it may follow `prepare`.
    """
    b, c, h, w = x.shape
    u = torch.rand(5, b, generator=generator, device=generator.device, dtype=torch.float64)
    area = (scale[0] + (scale[1] - scale[0]) * u[0]) * (h * w)
    r = torch.exp(math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * u[1])
    fw = ((area * r).sqrt() / w).clamp(max=1.0)
    fh = ((area / r).sqrt() / h).clamp(max=1.0)
    sign = torch.where(u[4] < 0.5, -1.0, 1.0) if flip else torch.ones_like(fw)
    theta = torch.zeros(b, 2, 3, dtype=torch.float64, device=generator.device)
    theta[:, 0, 0], theta[:, 0, 2] = fw * sign, (2 * u[2] - 1) * (1 - fw)
    theta[:, 1, 1], theta[:, 1, 2] = fh, (2 * u[3] - 1) * (1 - fh)
    grid = F.affine_grid(theta.to(x.device, x.dtype), [b, c, h, w], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


@dataclass(frozen=True)
class FineTuneResult:
    best: float                      # best test accuracy over the evaluations
    accuracy: dict[int, float]       # epoch -> test accuracy


@torch.no_grad()
def _accuracy(model: nn.Module, x, y, prepare, chunk_size: int) -> float:
    model.eval()
    correct = 0  # a device tensor after the first chunk: one read at the end
    for start in range(0, len(x), chunk_size):
        logits = model(_as_input(x[start:start + chunk_size], prepare))
        labels = y[start:start + chunk_size].to(logits.device)
        correct = correct + (logits.argmax(1) == labels).sum()
    return int(correct) / len(x)  # host sync: once per evaluation, its result


class _RowNorm(nn.Module):
    """Each row divided by its L2 norm (the kNN monitor's z), as a layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=1)


def fine_tune(encoder: nn.Module, train_x: torch.Tensor, train_y: torch.Tensor,
              test_x: torch.Tensor, test_y: torch.Tensor, num_classes: int,
              generator: torch.Generator, *, prepare: Prepare | None = None, epochs: int = 200,
              eval_epochs: Sequence[int] | None = None, lr_encoder: float = 1e-3,
              lr_head: float = 0.3, momentum: float = 0.9, batch_size: int = 128,
              augment: Augment | None = random_resized_crop_flip,
              chunk_size: int = 512, head_input: str = "raw") -> FineTuneResult:
    """Train a copy of `encoder` + Linear(F, C) on the labelled (train_x, train_y).

    Batches: prepare(train_x[batch]) then augment(x, generator). SGD with momentum, lr
    `lr_encoder` for the encoder and `lr_head` for the head; test accuracy after each
    epoch in `eval_epochs` (default: epochs // 2 and epochs, as [code] 100 and 200).
    Randomness (head init, order, augmentation) from `generator`; the caller's encoder is
    never modified. ``head_input`` "l2": the head sees each feature row divided by its
    norm. FedU^2's head lr 0.3 was set for ResNet-18's features; on an encoder without
    normalisation layers (the CNN, feature norms in the hundreds) the raw head's first
    steps wreck it and the accuracy falls to chance.
    """
    if head_input not in ("raw", "l2"):
        raise UsageError(f"head_input={head_input!r}: must be 'raw' or 'l2'")
    for name, value in (("num_classes", num_classes), ("epochs", epochs),
                        ("batch_size", batch_size), ("chunk_size", chunk_size)):
        _positive(name, value)
    _positive("lr_encoder", lr_encoder, integer=False)
    _positive("lr_head", lr_head, integer=False)
    eval_at = sorted(set(eval_epochs if eval_epochs is not None else (max(1, epochs // 2), epochs)))
    if not eval_at or not all(isinstance(e, int) and 1 <= e <= epochs for e in eval_at):
        raise UsageError(f"eval_epochs must be epochs in [1, {epochs}], got {eval_epochs!r}")
    body = copy.deepcopy(encoder)
    device = next(body.parameters()).device
    feature_dim = features(body, train_x[:1], prepare).shape[1]
    head = _linear(feature_dim, num_classes, generator, device)
    model = nn.Sequential(body, _RowNorm(), head) if head_input == "l2" else nn.Sequential(body, head)
    optimizer = torch.optim.SGD([{"params": body.parameters(), "lr": lr_encoder},
                                 {"params": head.parameters(), "lr": lr_head}], momentum=momentum)
    accuracy = {}
    for epoch in range(1, epochs + 1):
        model.train()
        for idx in _batches(len(train_x), batch_size, generator):
            idx = idx.to(train_x.device)
            x = _as_input(train_x[idx], prepare)
            if augment is not None:
                x = augment(x, generator)
            loss = F.cross_entropy(model(x), train_y[idx].to(device, torch.int64))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if epoch in eval_at:
            accuracy[epoch] = _accuracy(model, test_x, test_y, prepare, chunk_size)
    return FineTuneResult(max(accuracy.values()), accuracy)
