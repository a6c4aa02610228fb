"""Offline analysis of fedmpi results files: the public API for notebooks and tools.

Needs h5py and numpy only (never torch or MPI), so it runs on a laptop next to a
directory of results copied off a cluster; matplotlib only for plots. Everything
returns plain dicts of numpy arrays or lists of dicts, which ``pandas.DataFrame(...)``
takes as they are. docs/analysis.md has the guide; in short::

    from fedmpi import analysis as fa

    runs = fa.load("runs/")                      # every fedmpi *.h5 below runs/
    rounds = fa.rounds_table(runs)               # one row per (run, round)
    fa.best_accuracy(runs[0]), fa.rounds_to(runs[0], 0.8, smooth=0.9)
    rows = fa.group_table(runs, ["algorithm.name", "partition.alpha"], targets=[0.8])
    fa.save_plot(runs, "acc.png", x="traffic", group_by=["algorithm.name"])

Layers: ``runs`` (find and read files into ``Run``), ``metrics`` (numbers of one run),
``tables`` (many runs: tidy tables, groups), ``render`` (text/Markdown/CSV), ``plot``,
``run_summary`` (one run's summary) and ``report`` (a paper-style table; the two are what
``fedmpi report`` prints), ``watch`` (follow a live file); ``fedmpi.analysis.cli`` holds the click commands.
"""

from fedmpi.analysis.metrics import (
    MB, accuracy_at, accuracy_curve, best_accuracy, cumulative_time, cumulative_traffic_mb,
    cumulative_upload_mb, ema, final_accuracy, final_norm, kappa, last_value, rho, rounds_to, summary,
    total_traffic_mb, traffic_per_round_mb, upload_mb, wall_time, window_accuracy,
)
from fedmpi.analysis.plot import plot_accuracy, save_plot
from fedmpi.analysis.runs import Run, SkippedFileWarning, get_key, load
from fedmpi.analysis.tables import (
    clients_table, confounds, differing_keys, group_keys, group_table, pivot, rounds_table, runs_table,
)
from fedmpi.config import flatten

__all__ = [
    "MB", "Run", "SkippedFileWarning", "accuracy_at", "accuracy_curve", "best_accuracy",
    "clients_table", "confounds", "cumulative_time", "cumulative_traffic_mb", "cumulative_upload_mb",
    "differing_keys", "ema", "final_accuracy", "final_norm", "flatten", "get_key", "group_keys", "group_table",
    "kappa", "last_value", "load", "pivot", "plot_accuracy", "rho", "rounds_table", "rounds_to", "runs_table",
    "save_plot", "summary", "total_traffic_mb", "traffic_per_round_mb", "upload_mb", "wall_time",
    "window_accuracy",
]
