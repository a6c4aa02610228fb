"""How heterogeneous a partition is, from its client x class count matrix alone.

Everything here is a pure function of `counts` [K clients, C classes] (what
`partition.class_counts` returns and the results file stores), so the same numbers come
out of `fedmpi partition` before training and out of a results file afterwards.

Label-skew scores compare each client's label distribution p_i (its row, normalised)
with the global one g (the column sums, normalised):

- earth mover's distance (Zhao et al. 2018, "Federated Learning with Non-IID Data"). For
  categorical labels the ground metric is 0 between equal classes and 1 otherwise, and
  EMD under that metric is the total-variation distance TV(p_i, g) = 1/2 sum_k |p_ik - g_k|:
  0 = the client has the label mix of the whole set; as the client is part of the set,
  TV < 1 (a one-class client of C balanced classes scores 1 - 1/C). Zhao et al. report
  sum_k |p_ik - g_k|, i.e. 2 TV.
- KL(p_i || g) = sum_k p_ik ln(p_ik / g_k) in nats, with 0 ln 0 = 0. No epsilon is needed:
  g_k >= n_ik / N > 0 wherever p_ik > 0, as the client's samples are part of the global
  set. The size-weighted mean sum_i (n_i / N) KL(p_i || g) is the mutual information
  I(client; label).

Each is reported as a plain mean over non-empty clients (empty clients have no label
distribution) and as a mean weighted by client size.
"""

from __future__ import annotations

import numpy as np

from fedmpi import figures
from fedmpi.errors import UsageError


def summary(counts: np.ndarray) -> dict:
    """Sizes, classes per client and label-skew scores of a [clients, classes] count matrix.

    Plain Python ints and floats (JSON-ready); scores are NaN when no client has samples.
    """
    counts = np.asarray(counts, dtype=np.int64)
    sizes = counts.sum(1)
    held = (counts > 0).sum(1)
    return {
        "clients": int(counts.shape[0]), "classes": int(counts.shape[1]),
        "samples": int(sizes.sum()), "empty_clients": int((sizes == 0).sum()),
        "size_min": int(sizes.min()), "size_median": float(np.median(sizes)),
        "size_max": int(sizes.max()), "size_mean": float(sizes.mean()),
        "size_std": float(sizes.std()),
        "classes_per_client_mean": float(held.mean()), "classes_per_client_min": int(held.min()),
        "classes_per_client_max": int(held.max()),
        **label_skew(counts),
    }


def label_skew(counts: np.ndarray) -> dict:
    """emd_mean, emd_weighted (total variation, see the module docstring), kl_mean, kl_weighted."""
    counts = np.asarray(counts, dtype=np.float64)
    sizes = counts.sum(1)
    kept = sizes > 0
    if not kept.any():
        return dict.fromkeys(("emd_mean", "emd_weighted", "kl_mean", "kl_weighted"), float("nan"))
    p = counts[kept] / sizes[kept, None]
    g = counts.sum(0) / sizes.sum()
    tv = 0.5 * np.abs(p - g).sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):  # p = 0 terms are masked to 0
        kl = np.where(p > 0, p * np.log(p / g), 0.0).sum(1)
    w = sizes[kept] / sizes.sum()
    return {"emd_mean": float(tv.mean()), "emd_weighted": float(w @ tv),
            "kl_mean": float(kl.mean()), "kl_weighted": float(w @ kl)}


def format_summary(s: dict) -> str:
    """Aligned text lines for the CLI (`fedmpi partition`)."""
    rows = [
        ("clients", f"{s['clients']}  ({s['empty_clients']} empty)"),
        ("samples", f"{s['samples']}  in {s['classes']} classes"),
        ("client size", f"min {s['size_min']}  median {s['size_median']:g}  max {s['size_max']}"
                        f"  mean {s['size_mean']:.1f}  std {s['size_std']:.1f}"),
        ("classes per client", f"mean {s['classes_per_client_mean']:.2f}  min "
                               f"{s['classes_per_client_min']}  max {s['classes_per_client_max']}"),
        ("label skew, EMD (TV)", f"mean {s['emd_mean']:.4f}  size-weighted {s['emd_weighted']:.4f}"
                                 f"  (0 = the whole set's label mix)"),
        ("label skew, KL", f"mean {s['kl_mean']:.4f}  size-weighted {s['kl_weighted']:.4f}  "
                           f"nats (KL(client || global))"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def plot_heatmap(counts: np.ndarray, path, title: str | None = None,
                 max_clients: int = 200) -> None:
    """Client x class heatmap of sample counts (as FNR-FL's Figure 2), written to `path`.

    Clients run along x, classes along y, colour = number of samples (white = none). Past
    `max_clients` clients only the first max_clients are drawn, and the title says so.
    """
    if isinstance(max_clients, bool) or not isinstance(max_clients, (int, np.integer)) \
            or max_clients < 1:
        raise UsageError(f"max_clients={max_clients!r}: must be an integer >= 1")
    counts = np.asarray(counts)
    shown = counts[:max_clients]
    title = title or "samples per client and class"
    if len(counts) > max_clients:
        title += f" (first {max_clients} of {len(counts)} clients)"
    fig = figures.new_figure("--plot", figsize=(min(4 + 0.05 * len(shown), 16),
                                                min(2 + 0.25 * counts.shape[1], 12)))
    from matplotlib.ticker import MaxNLocator   # deferred: matplotlib is optional (figures.py)
    ax = fig.add_subplot()
    # Zeros are masked (white), so one sample (yellow end of viridis_r) stands out from none.
    image = ax.imshow(np.ma.masked_equal(shown.T, 0), aspect="auto", interpolation="nearest",
                      cmap="viridis_r", origin="lower", vmin=0, vmax=max(shown.max(initial=0), 1),
                      extent=(-0.5, len(shown) - 0.5, -0.5, counts.shape[1] - 0.5))
    fig.colorbar(image, ax=ax, label="samples")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="client", ylabel="class")
    ax.set_title(title)
    figures.save(fig, path, "heatmap file", "--plot", dpi=100, bbox_inches="tight")
