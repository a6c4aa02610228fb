"""Byzantine-robust aggregation (``[robust]``): rules that replace the mean of the client
updates, computed where the updates are (fedmpi.runtime.gram), never with every update
on one rank.

Distance rules need only the Gram matrix G of the round's updates (G_kl = <Delta_k,
Delta_l>, float64, participants in ascending id), from which every pairwise distance
||Delta_k - Delta_l||^2 = G_kk + G_ll - 2 G_kl follows; each gives coefficients c (sum 1)
and the aggregate sum_k c_k Delta_k:

- ``krum`` (Blanchard et al. 2017): the update whose n - f - 2 nearest others are
  closest in sum of squared distances (at least 1 neighbour);
- ``multikrum``: the mean of the n - f updates with the best Krum scores;
- ``geomed``: the geometric median (RFA, Pillutla et al. 2022) by smoothed Weiszfeld
  iterations, z = sum_k w_k Delta_k with w_k proportional to 1 / max(nu, ||z -
  Delta_k||), the distances from G as z stays in the updates' span;
- ``normbound`` (Sun et al. 2019): the mean of the updates each scaled to norm at most
  ``bound``;
- ``centered_clip`` (Karimireddy, He and Jaggi 2021): from the centre v (the previous
  round's aggregate, zero at first), ``cc_iterations`` times v <- v + (1/n) sum_k
  clip_bound(Delta_k - v); v joins the updates as one more row of the Gram matrix, and
  every iterate stays in their span, so its distances come from G;
- ``fltrust`` (Cao et al. 2021): the server's own update g_0, the method's local update on
  a root set of ``root_per_class`` training samples per class (keyed, in
  /partition/robust_root), trained on every worker from the round's payload (the same
  bits on each in deterministic mode) and joined to the updates as one more row; each
  update's trust max(0, cos(Delta_k, g_0)), the update rescaled to ||g_0||, and the
  trust-weighted mean (zero where every trust is 0);
- ``bulyan`` (El Mhamdi et al. 2018): n - 2f updates chosen by Krum one after another (each
  from those left), then, coordinate by coordinate, the mean of the n - 4f chosen values
  closest to their median: a Gram selection, then a coordinate rule on the chosen rows.

Coordinate rules run on the transposed blocks, each worker its run of coordinates of
every update:

- ``mean``: the plain mean of the raw updates (no defence: the reference every rule is
  compared with, and the aggregate the cohort attacks of fedmpi.runtime.omniscient need);
- ``median``: the coordinate-wise median (the mean of the two middle values for even n);
- ``trimmed_mean`` (Yin et al. 2018): the coordinate-wise mean after removing the f
  largest and f smallest values.

A rule sees the raw updates Delta_k, never n_k Delta_k (a weight a client reports would
let it grow its say), and every rule is a plain mean when all updates are equal. Where a
round has too few participants for f (Bernoulli sampling, dropouts), the rule uses what
it can: Krum at least one neighbour, the trimmed mean at most (n - 1) // 2 a side, Bulyan
at least one update chosen and one value a coordinate.

Every rule also says how much each update counted (``weights``, summing to 1, recorded
per client in /clients as ``robust_weight``): a Gram rule's coefficient; a coordinate
rule's share of the coordinates, where a value kept among m counts 1/m.
"""

from __future__ import annotations

import numpy as np
import torch

from .rng import numpy_rng

RULES = ("none", "mean", "median", "trimmed_mean", "krum", "multikrum", "geomed", "normbound",
         "bulyan", "centered_clip", "fltrust")
ROOT_CLIENT = 1 << 62   # the key of FLTrust's root update: an id no client has
COORDINATE = ("mean", "median", "trimmed_mean")   # no Gram matrix: a rule on the shards


def distances(gram: np.ndarray) -> np.ndarray:
    """Squared pairwise distances from the Gram matrix (clamped at 0 against rounding)."""
    diag = np.diag(gram)
    return np.maximum(diag[:, None] + diag[None, :] - 2 * gram, 0.0)


def krum_scores(gram: np.ndarray, f: int) -> np.ndarray:
    """Each update's sum of squared distances to its n - f - 2 nearest others."""
    n = len(gram)
    dist = distances(gram)
    near = max(1, n - f - 2)
    scores = np.zeros(n)
    for k in range(n):
        others = np.sort(np.delete(dist[k], k), kind="stable")
        scores[k] = others[:near].sum()
    return scores


def krum(gram: np.ndarray, f: int) -> np.ndarray:
    c = np.zeros(len(gram))
    c[int(np.argmin(krum_scores(gram, f)))] = 1.0
    return c


def multikrum(gram: np.ndarray, f: int) -> np.ndarray:
    n = len(gram)
    keep = np.argsort(krum_scores(gram, f), kind="stable")[:max(1, n - f)]
    c = np.zeros(n)
    c[keep] = 1.0 / len(keep)
    return c


def geomed(gram: np.ndarray, iterations: int = 10, nu: float = 1e-6) -> np.ndarray:
    """Smoothed Weiszfeld from the mean: w <- (1 / max(nu, d_k)) normalised, d_k = ||z -
    Delta_k||, ||z - Delta_k||^2 = w^T G w - 2 (G w)_k + G_kk."""
    n = len(gram)
    w = np.full(n, 1.0 / n)
    for _ in range(iterations):
        gw = gram @ w
        d = np.sqrt(np.maximum(w @ gw - 2 * gw + np.diag(gram), 0.0))
        inv = 1.0 / np.maximum(d, nu)
        w = inv / inv.sum()
    return w


def normbound(gram: np.ndarray, bound: float) -> np.ndarray:
    norms = np.sqrt(np.maximum(np.diag(gram), 0.0))
    scale = np.minimum(1.0, bound / np.maximum(norms, 1e-30))
    return scale / len(gram)


def centered_clip(gram: np.ndarray, tau: float, iterations: int) -> np.ndarray:
    """Coefficients over the n updates and the centre (row n of ``gram``) of centred
    clipping's last iterate: v_l = sum_j a_j r_j, ||Delta_k - v_l||^2 = G_kk - 2 (G a)_k +
    a^T G a."""
    n = len(gram) - 1
    a = np.zeros(n + 1)
    a[n] = 1.0
    for _ in range(iterations):
        ga = gram @ a
        dist = np.sqrt(np.maximum(np.diag(gram)[:n] - 2 * ga[:n] + a @ ga, 0.0))
        s = np.minimum(1.0, tau / np.maximum(dist, 1e-30))
        a = a * (1 - s.sum() / n)
        a[:n] += s / n
    return a


def fltrust(gram: np.ndarray) -> np.ndarray:
    """Coefficients over the n updates and g_0 (row n of ``gram``, coefficient 0)."""
    n = len(gram) - 1
    norms = np.sqrt(np.maximum(np.diag(gram), 0.0))
    c = np.zeros(n + 1)
    if norms[n] == 0:
        return c
    live = norms[:n] > 0
    trust = np.zeros(n)
    trust[live] = np.maximum(gram[:n, n][live] / (norms[:n][live] * norms[n]), 0.0)
    if trust.sum() > 0:
        c[:n][live] = trust[live] * norms[n] / norms[:n][live] / trust.sum()
    return c


def root_set(config, labels: np.ndarray) -> np.ndarray:
    """FLTrust's root set: ``robust.root_per_class`` training samples of each class (all
    of a class that has fewer), drawn from the stream keyed by (seed, "fltrust-root"),
    ascending."""
    rng = numpy_rng(config.seed, "fltrust-root")
    labels = np.asarray(labels)
    chosen = []
    for y in np.unique(labels):
        members = np.flatnonzero(labels == y)
        chosen.append(rng.choice(members, min(len(members), config.robust.root_per_class),
                                 replace=False))
    return np.sort(np.concatenate(chosen)).astype(np.int64) if chosen else np.zeros(0, np.int64)


def bulyan_selection(gram: np.ndarray, f: int) -> np.ndarray:
    """Bulyan's first stage: n - 2f updates (at least 1), each the Krum choice among those
    not yet chosen; 1 for a chosen update, 0 otherwise."""
    n = len(gram)
    left = list(range(n))
    chosen = np.zeros(n)
    for _ in range(max(1, n - 2 * f)):
        pick = left[int(np.argmin(krum_scores(gram[np.ix_(left, left)], f)))]
        chosen[pick] = 1.0
        left.remove(pick)
    return chosen


def coefficients(rule: str, config):
    """The Gram rule of ``rule`` as ``gram -> c`` (Bulyan's: its selection)."""
    r = config.robust
    return {"krum": lambda g: krum(g, r.f), "multikrum": lambda g: multikrum(g, r.f),
            "geomed": lambda g: geomed(g, r.geomed_iterations, r.geomed_nu),
            "normbound": lambda g: normbound(g, r.bound),
            "bulyan": lambda g: bulyan_selection(g, r.f),
            "centered_clip": lambda g: centered_clip(g, r.bound, r.cc_iterations),
            "fltrust": fltrust}[rule]


class _NumpyBlocks:
    """The coordinate rules' array operations on the CPU: numpy, whose vectorised sort of
    short contiguous rows is 2-3x its sort along a strided axis (and 10x torch's on a
    2-core CPU); the transposed block goes into one buffer kept from block to block."""

    def __init__(self):
        self.buffer = np.empty(0, np.float64)

    def array(self, rows: torch.Tensor) -> np.ndarray:
        return rows.numpy()

    def sorted_t(self, a: np.ndarray) -> np.ndarray:
        if self.buffer.size < a.size:
            self.buffer = np.empty(a.size, np.float64)
        t = self.buffer[:a.size].reshape(a.shape[1], a.shape[0])
        np.copyto(t, a.T)
        t.sort(axis=1)
        return t

    def arange(self, n: int, like) -> np.ndarray:
        return np.arange(n)

    def window(self, t: np.ndarray, index: np.ndarray) -> np.ndarray:
        return np.take_along_axis(t, index, axis=1)

    def maximum(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.maximum(a, b)

    def column(self, t: np.ndarray, j: int) -> np.ndarray:
        return t[:, j].copy()   # contiguous: 3x the compares with a strided column

    def count(self, inside: np.ndarray, axis: int) -> np.ndarray:
        return np.count_nonzero(inside, axis=axis)

    def distinct(self, count: np.ndarray) -> list[int]:
        return np.unique(count).tolist()

    def tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a)


class _TorchBlocks(_NumpyBlocks):
    """The same operations in torch, on the block's device (a GPU's sort of a whole block
    at once); the CPU runs them in tests."""

    def array(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def sorted_t(self, a: torch.Tensor) -> torch.Tensor:
        return torch.sort(a.T.contiguous(), dim=1).values

    def arange(self, n: int, like) -> torch.Tensor:
        return torch.arange(n, device=like.device)

    def window(self, t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return torch.gather(t, 1, index)

    def maximum(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum(a, b)

    def column(self, t: torch.Tensor, j: int) -> torch.Tensor:
        return t[:, j].contiguous()

    def count(self, inside: torch.Tensor, axis: int) -> torch.Tensor:
        return inside.sum(dim=axis, dtype=torch.float64)   # a float64 share when divided

    def distinct(self, count: torch.Tensor) -> list[int]:
        return torch.unique(count).tolist()

    def tensor(self, a: torch.Tensor) -> torch.Tensor:
        return a


def coordinate_rule(rule: str, f: int, backend: str | None = None):
    """The coordinate rule of ``rule`` on a block of rows (float64 [n, width]), given the
    Gram rule's coefficients (Bulyan's selection; None for the others): (values [width],
    each row's summed weight over the block's coordinates [n]). A coordinate's kept values
    are a run [lo, hi) of its sorted values; each row whose value lies in [s_lo, s_hi-1]
    shares the coordinate's weight 1 equally (ties at the run's ends share it too).

    The sorts run on the block transposed, each coordinate's n values contiguous ([width,
    n]); the shares count each row's kept values per distinct count of kept values rather
    than adding a fraction per coordinate. A block on the CPU is sorted by numpy, one on a
    GPU by torch where it is (``backend`` "numpy" or "torch" chooses for every block)."""
    on_cpu, on_device = _NumpyBlocks(), _TorchBlocks()

    def ops(rows: torch.Tensor) -> _NumpyBlocks:
        if backend is not None:
            return on_device if backend == "torch" else on_cpu
        return on_cpu if rows.device.type == "cpu" else on_device

    def kept(x: _NumpyBlocks, rows, t, lo, hi):
        """The mean of the sorted values lo..hi-1 (ints, or per-coordinate start indices
        and the run's length ``hi``) of each coordinate, and each row's share."""
        if isinstance(lo, int):
            window = t[:, lo:hi]
        else:
            window = x.window(t, lo[:, None] + x.arange(hi, t)[None, :])
        inside = rows >= x.column(window, 0)
        inside &= rows <= x.column(window, -1)
        count = x.count(inside, 0)
        counts = x.distinct(count)   # one, but where values tie at the run's ends
        if len(counts) == 1:
            share = x.count(inside, 1) / counts[0]
        else:
            share = sum(x.count(inside[:, count == c], 1) / c for c in counts)
        return x.tensor(window.mean(1)), x.tensor(share)

    def mean(rows, coef=None):
        return rows.mean(dim=0), torch.full((len(rows),), rows.shape[1] / len(rows),
                                            dtype=torch.float64, device=rows.device)

    def median(rows, coef=None):
        x = ops(rows)
        a, n = x.array(rows), len(rows)
        return kept(x, a, x.sorted_t(a), (n - 1) // 2, n // 2 + 1)

    def trimmed(rows, coef=None):
        x = ops(rows)
        a, n = x.array(rows), len(rows)
        cut = min(f, (n - 1) // 2)
        return kept(x, a, x.sorted_t(a), cut, n - cut)

    def bulyan(rows, coef):
        """The beta values nearest the median are a run of the sorted values: the window
        of beta whose farther end is nearest (the first such)."""
        x = ops(rows)
        chosen = torch.from_numpy(np.flatnonzero(coef)).to(rows.device)
        sub = x.array(rows[chosen])
        theta = len(sub)
        beta = max(1, theta - 2 * f)
        t = x.sorted_t(sub)
        middle = t[:, (theta - 1) // 2:theta // 2 + 1].mean(1)
        starts = x.arange(theta - beta + 1, t)
        reach = x.maximum(middle[:, None] - t[:, starts], t[:, starts + beta - 1] - middle[:, None])
        values, share = kept(x, sub, t, reach.argmin(1), beta)
        count = torch.zeros(len(rows), dtype=torch.float64, device=rows.device)
        count[chosen] = share
        return values, count
    return {"mean": mean, "median": median, "trimmed_mean": trimmed, "bulyan": bulyan}[rule]
