"""Accuracy curves of many runs in one figure: against rounds, FL traffic, wall time or
virtual time (runs with the virtual clock, system_model);
or (``spectrum=True``) the feature spectra of self-supervised runs (FedU^2 Figure 3).

``plot_accuracy(runs, ax)`` draws into a matplotlib Axes a notebook already has;
``save_plot(runs, path)`` makes a figure and writes it (PNG, PDF, SVG: by suffix).
The figure is built on ``matplotlib.figure.Figure`` with the Agg canvas, never pyplot,
so it neither needs a display nor changes a notebook's backend.

One line per run, labelled by the config keys that differ between the runs (and the
seed; a key a run lacks is left out of its label), or with ``paper`` by that paper's name
for each method (``tools/paper_table.py``'s rows: FedU2-BYOL, L-DAWA-SimCLR, ...). More
than eight lines put the legend beside the axes. With ``group_by``, one line per group:
the mean over its runs with a shaded band of ± one std. Runs are aligned on round
numbers: a group's point at round r averages each run's last evaluated accuracy at or
before r, and its x is the mean of the runs' cumulative MB, seconds or virtual hours at r.
Runs that did not complete are labelled with their status and never averaged with
completed ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedmpi import figures
from fedmpi.analysis import metrics
from fedmpi.analysis.render import key_header, value
from fedmpi.analysis.tables import check_keys, differing_keys
from fedmpi.errors import UsageError

X_AXES = {"round": "round", "traffic": "cumulative FL traffic (MB)",
          "upload": "cumulative FL upload (MB)", "time": "wall time (s)",
          "vtime": "virtual time (h)"}


def plot_accuracy(runs, ax, x: str = "round", group_by=None, smooth: float | None = None,
                  paper: str | None = None):
    """Draw test accuracy (%) against ``x`` (round | traffic | time | vtime) into ``ax``."""
    if x not in X_AXES:
        raise UsageError(f"--x {x!r}: allowed are {', '.join(X_AXES)}")
    if x == "vtime":
        _need_virtual_clock(runs)
    if group_by and paper:
        raise UsageError("--paper names runs one by one; with --group-by each line is a "
                         "group, named by its keys")
    if group_by:
        keys = check_keys(runs, group_by, "--group-by")
        for label, members in _groups(runs, keys):
            xs, mean, std = _mean_curve(members, x, smooth)
            (line,) = ax.plot(xs, 100 * mean, label=f"{label} (n={len(members)})", **_style(xs))
            if len(members) > 1:
                ax.fill_between(xs, 100 * (mean - std), 100 * (mean + std), color=line.get_color(),
                                alpha=0.2, linewidth=0)
    else:
        labels = _run_labels(runs, paper)
        _colours(ax, len(runs))
        for run, label in zip(runs, labels):
            xs, acc = _curve(run, x, smooth)
            ax.plot(xs, 100 * acc, label=label, **_style(xs))
    ax.set_xlabel(X_AXES[x])
    ax.set_ylabel("test accuracy (%)" + (f", EMA({smooth:g})" if smooth else ""))
    ax.grid(True, alpha=0.3)
    _legend(ax)
    return ax


def plot_spectrum(runs, ax, top: int = 100, paper: str | None = None):
    """FedU^2 Figure 3: the top singular values (log10) of each run's feature covariance,
    from its last probe that measured the spectrum (/eval/spectrum)."""
    drawn = 0
    _colours(ax, len(runs))
    for run, label in zip(runs, _run_labels(runs, paper)):
        rows = [(int(r), v) for r, v in zip(run.evals.get("round", ()), run.spectrum)
                if np.isfinite(v).all()]
        if not rows:
            continue
        round_, values = rows[-1]
        values = np.clip(values[:top], 1e-12, None)
        ax.plot(np.arange(1, len(values) + 1), np.log10(values),
                label=f"{label} (round {round_})")
        drawn += 1
    if not drawn:
        raise UsageError("no run has a feature spectrum: set eval.probes = [\"spectrum\"] "
                         "or run fedmpi evaluate FILE --probe spectrum")
    ax.set_xlabel("singular value index")
    ax.set_ylabel("log10 singular value (feature covariance)")
    ax.grid(True, alpha=0.3)
    _legend(ax)
    return ax


LEGEND_INSIDE = 8   # more lines than this: the legend beside the axes, not over the curves


def _colours(ax, lines: int) -> None:
    """Twenty colours where the default ten would repeat (a seed paper's table of runs)."""
    if lines > 10:
        from matplotlib import colormaps   # deferred, as every matplotlib import here
        ax.set_prop_cycle(color=colormaps["tab20"].colors)


def _legend(ax) -> None:
    if len(ax.get_lines()) > LEGEND_INSIDE:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.02, 1.0),
                  borderaxespad=0.0)
    else:
        ax.legend(fontsize="small")


def _run_labels(runs, paper: str | None) -> list[str]:
    """Each run's label: the paper's method name (then the differing keys where two runs
    share one), or the differing keys (and the seed)."""
    seeds = len({r.get("seed") for r in runs}) > 1
    keys = differing_keys(runs) + (["seed"] if seeds else [])
    plain = [_label(run, keys or ["algorithm.name"]) for run in runs]
    if paper is None:
        return plain
    from fedmpi.analysis.papers import LAYOUTS   # deferred: the papers' tables
    if paper not in LAYOUTS:
        raise UsageError(f"--paper {paper!r}: allowed are {', '.join(sorted(LAYOUTS))}")
    layout = LAYOUTS[paper]
    names = [layout.label({k: run.get(k) for k in layout.method_keys}) for run in runs]
    if seeds:
        names = [f"{n}, seed={value(r.get('seed'))}" for n, r in zip(names, runs)]
    return [f"{n} ({p})" if names.count(n) > 1 else n for n, p in zip(names, plain)]


def save_plot(runs, path, x: str = "round", group_by=None, smooth: float | None = None,
              title: str | None = None, spectrum: bool = False, log_x: bool = False,
              y_from: float | None = None, paper: str | None = None) -> Path:
    """Write the figure to ``path``; the format comes from its suffix (.png, .pdf, .svg).
    ``log_x``: a logarithmic x axis (points at x = 0, such as round 0, are left out).
    ``y_from``: the accuracy (a fraction) where the y axis starts; the top stays automatic."""
    figure = figures.new_figure("fedmpi plot", figsize=(6.4, 4.4), dpi=120)
    ax = figure.add_subplot()
    if spectrum:
        plot_spectrum(runs, ax, paper=paper)
    else:
        plot_accuracy(runs, ax, x, group_by, smooth, paper)
    if log_x:
        ax.set_xscale("log", nonpositive="mask")
    if y_from is not None:   # the automatic top, unless the data all lie below the start
        ax.set_ylim(100 * y_from, max(ax.get_ylim()[1], 100 * y_from + 1))
    ax.set_title(title if title is not None else default_title(runs), fontsize="medium")
    figure.tight_layout()   # a legend beside the axes: the saved area grows to hold it
    return figures.save(figure, path, "plot file", "fedmpi plot", bbox_inches="tight")


def default_title(runs) -> str:
    """The settings every run shares: dataset, model, partition, clients."""
    parts = []
    for key, fmt in (("data.dataset", "{}"), ("model.name", "{}"), ("partition.kind", "{}"),
                     ("partition.alpha", "alpha={}"), ("clients.num", "{} clients"),
                     ("clients.per_round", "{} per round")):
        values = {value(r.get(key)) for r in runs}
        if len(values) == 1 and runs[0].get(key) is not None:
            parts.append(fmt.format(values.pop()))
    # per round is the expected count under bernoulli sampling: say which scheme when shared
    sampling = {r.get("clients.sampling") or "uniform" for r in runs}
    if len(sampling) == 1 and sampling != {"uniform"}:
        parts.append(f"{sampling.pop()} sampling")
    return ", ".join(parts) or "test accuracy"


def _style(xs) -> dict:
    """Markers while the evaluated points are few enough to tell apart."""
    return {"marker": "o", "markersize": 3} if len(xs) <= 40 else {}


def _label(run, keys: list[str]) -> str:
    parts = [value(run.get(k)) if k == "algorithm.name"
             else f"{key_header(k, keys)}={value(run.get(k))}"
             for k in keys if k == "algorithm.name" or run.get(k) is not None]
    status = "" if run.completed else f" [{run.status}]"
    return ", ".join(parts) + status


def _groups(runs, keys: list[str]) -> list[tuple[str, list]]:
    """(label, runs) per distinct key values and status, in first-seen order."""
    groups: dict[tuple, list] = {}
    for run in runs:
        groups.setdefault(tuple(value(run.get(k)) for k in keys) + (run.status,), []).append(run)
    return [(_label(members[0], keys), members) for members in groups.values()]


def _need_virtual_clock(runs) -> None:
    """--x vtime: every run must have the virtual clock's column (one line naming a run)."""
    missing = [run for run in runs if not metrics.has_virtual_clock(run)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UsageError(f"--x vtime: {missing[0].path}{more} has no virtual clock "
                         "(set system_model.profiles = \"lognormal\" to run with one)")


def _x_values(run, x: str) -> np.ndarray:
    """x per round row: the round, cumulative FL MB, cumulative wall seconds, or the
    virtual clock in hours."""
    if x == "traffic":
        return metrics.cumulative_traffic_mb(run)
    if x == "upload":
        return metrics.cumulative_upload_mb(run)
    if x == "time":
        return metrics.cumulative_time(run)
    if x == "vtime":
        return metrics.cumulative_virtual_hours(run)
    return np.asarray(run.rounds.get("round", ()), dtype=np.float64)


def _curve(run, x: str, smooth) -> tuple[np.ndarray, np.ndarray]:
    """(x, accuracy) at the evaluated rounds of one run."""
    acc = np.asarray(run.rounds.get("test_acc", ()), dtype=np.float64)
    evaluated = np.isfinite(acc)
    _, curve = metrics.accuracy_curve(run, smooth)
    return _x_values(run, x)[evaluated], curve


def _mean_curve(runs, x: str, smooth) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean x, mean and std accuracy over runs on the union of their evaluated rounds."""
    grid = np.unique(np.concatenate([metrics.accuracy_curve(r)[0] for r in runs]))
    acc = np.array([[metrics.accuracy_at(r, int(g), smooth) for g in grid] for r in runs])
    xs = np.array([_at_rounds(r, _x_values(r, x), grid) for r in runs])
    ok = np.isfinite(acc).sum(axis=0) > 0
    acc, xs, grid = acc[:, ok], xs[:, ok], grid[ok]
    count = np.isfinite(acc).sum(axis=0)
    mean = np.nansum(acc, axis=0) / count
    spread = np.nansum((acc - mean) ** 2, axis=0) / np.maximum(count - 1, 1)
    return _nanmean(xs), mean, np.sqrt(spread)


def _at_rounds(run, values: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """values at the last row at or before each grid round; NaN before the first row."""
    ids = np.asarray(run.rounds.get("round", ()))
    pos = np.searchsorted(ids, grid, side="right") - 1
    out = np.where(pos >= 0, values[np.clip(pos, 0, None)] if len(values) else np.nan, np.nan)
    return np.where(grid > (ids[-1] if len(ids) else 0), np.nan, out)


def _nanmean(xs: np.ndarray) -> np.ndarray:
    count = np.isfinite(xs).sum(axis=0)
    return np.where(count > 0, np.nansum(xs, axis=0) / np.maximum(count, 1), np.nan)
