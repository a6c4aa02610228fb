"""Heterogeneity statistics on hand-computed count matrices; the heatmap writes a real PNG."""

import math
import sys

import numpy as np
import pytest

from fedmpi.data.heterogeneity import format_summary, label_skew, plot_heatmap, summary
from fedmpi.data.partition import class_counts, dirichlet
from fedmpi.errors import UsageError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_two_clients_two_classes_disjoint():
    # global (1/2, 1/2); each client one class: TV = 1/2 (|1 - 1/2| + |0 - 1/2|) = 1/2, KL = ln 2
    s = summary(np.array([[2, 0], [0, 2]]))
    assert s["emd_mean"] == s["emd_weighted"] == 0.5
    assert s["kl_mean"] == pytest.approx(math.log(2), abs=1e-15)
    assert s["kl_weighted"] == pytest.approx(math.log(2), abs=1e-15)
    assert (s["clients"], s["classes"], s["samples"], s["empty_clients"]) == (2, 2, 4, 0)
    assert s["classes_per_client_mean"] == 1.0


def test_three_by_three_by_hand():
    """Sizes 6, 4, 0; global (0.7, 0.1, 0.2); client 0 = (1, 0, 0), client 1 = (.25, .25, .5)."""
    s = summary(np.array([[6, 0, 0], [1, 1, 2], [0, 0, 0]]))
    tv0, tv1 = 0.5 * (0.3 + 0.1 + 0.2), 0.5 * (0.45 + 0.15 + 0.3)
    kl0 = math.log(1 / 0.7)
    kl1 = 0.25 * math.log(0.25 / 0.7) + 0.25 * math.log(2.5) + 0.5 * math.log(2.5)
    assert s["emd_mean"] == pytest.approx((tv0 + tv1) / 2, abs=1e-15)  # empty client left out
    assert s["emd_weighted"] == pytest.approx(0.6 * tv0 + 0.4 * tv1, abs=1e-15)
    assert s["kl_mean"] == pytest.approx((kl0 + kl1) / 2, abs=1e-15)
    assert s["kl_weighted"] == pytest.approx(0.6 * kl0 + 0.4 * kl1, abs=1e-15)
    assert s["empty_clients"] == 1 and s["samples"] == 10
    assert (s["size_min"], s["size_median"], s["size_max"]) == (0, 4.0, 6)
    assert s["size_mean"] == pytest.approx(10 / 3) and s["size_std"] == pytest.approx(np.std([6, 4, 0]))
    assert (s["classes_per_client_mean"], s["classes_per_client_min"],
            s["classes_per_client_max"]) == (pytest.approx(4 / 3), 0, 3)


def test_identical_label_mix_scores_zero():
    s = label_skew(np.array([[1, 2, 3], [2, 4, 6], [3, 6, 9]]))
    assert s == {"emd_mean": 0.0, "emd_weighted": 0.0, "kl_mean": 0.0, "kl_weighted": 0.0}


def test_weighted_kl_is_the_mutual_information_and_tv_is_bounded():
    rng = np.random.default_rng(0)
    for _ in range(20):
        counts = rng.integers(0, 5, (rng.integers(1, 30), rng.integers(1, 12)))
        counts[0, 0] += 1
        joint = counts / counts.sum()
        outer = joint.sum(1, keepdims=True) * joint.sum(0, keepdims=True)
        mask = joint > 0
        mutual_information = float((joint[mask] * np.log(joint[mask] / outer[mask])).sum())
        s = label_skew(counts)
        assert s["kl_weighted"] == pytest.approx(mutual_information, rel=1e-12, abs=1e-15)
        assert 0 <= s["emd_weighted"] < 1 and 0 <= s["emd_mean"] < 1


def test_all_empty_is_nan():
    s = summary(np.zeros((3, 4), dtype=np.int64))
    assert s["empty_clients"] == 3 and all(math.isnan(s[k]) for k in ("emd_mean", "kl_weighted"))


def test_summary_is_plain_python_and_format_aligns():
    labels = np.random.default_rng(0).integers(0, 10, 2000)
    s = summary(class_counts(dirichlet(labels, 25, 0.2, seed=0), labels, 10))
    assert all(type(v) in (int, float) for v in s.values())
    text = format_summary(s)
    lines = text.splitlines()
    assert len(lines) == 6 and lines[0].startswith("clients") and "25" in lines[0]
    starts = {len(line) - len(line.split("  ", 1)[1].lstrip()) for line in lines}
    assert len(starts) == 1  # every value starts in the same column
    assert f"{s['emd_weighted']:.4f}" in text and f"{s['kl_mean']:.4f}" in text


def test_heatmap_writes_png(tmp_path):
    counts = np.array([[5, 0, 1], [0, 3, 0]])
    path = tmp_path / "heat.png"
    plot_heatmap(counts, path, title="two clients")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_heatmap_shows_the_first_max_clients_and_says_so(tmp_path, monkeypatch):
    from matplotlib.axes import Axes
    titles = []
    monkeypatch.setattr(Axes, "set_title", lambda self, t, *a, **k: titles.append(t))
    counts = np.random.default_rng(0).integers(0, 9, (500, 10))
    plot_heatmap(counts, tmp_path / "a.png", max_clients=100)
    plot_heatmap(counts[:50], tmp_path / "b.png", title="mine")
    assert titles == ["samples per client and class (first 100 of 500 clients)", "mine"]
    assert (tmp_path / "a.png").read_bytes()[:8] == PNG_MAGIC


def test_heatmap_without_matplotlib_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import fails
    with pytest.raises(UsageError, match=r"^--plot needs matplotlib: pip install matplotlib$"):
        plot_heatmap(np.ones((2, 2), dtype=np.int64), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
