"""Tidy tables over many runs: plain dicts of numpy columns, or lists of row dicts.

Both shapes go into ``pandas.DataFrame(...)`` as they are, and need nothing but numpy
without it. Config values become columns by dotted key (``partition.alpha``); a key a
run lacks reads NaN (numbers) or None. Every table carries each run's ``status``: a
run that did not complete is kept, and visibly so, never averaged in with completed
ones (``group_table`` puts the status in the group).

Which keys tell runs apart: ``differing_keys`` returns the config keys whose values
differ among the runs that have them, ignoring labels and placement (``seed``,
``name``, ``output``, ``data.data_dir``, ``system.*``). A key only one algorithm has
(``algorithm.mu``) counts only if its values differ.

What else differs: ``confounds`` returns the keys that differ among the runs being
compared but are not the grouping keys (hyperparameters nobody grouped by, a precision
``IGNORED_KEYS`` hid), so a table can say that its rows differ in more than their labels.
Each group row says how many distinct seeds its runs have (``seeds``): runs sharing a
seed are replicas, and their spread is not a spread over seeds.
"""

from __future__ import annotations

import difflib
import json
import math

import numpy as np

from fedmpi.analysis import metrics
from fedmpi.analysis.runs import Run
from fedmpi.config import flatten
from fedmpi.errors import UsageError
from fedmpi.results import schema

# Labels and placement: they differ between runs of one setting, so never split groups.
IGNORED_KEYS = ("seed", "name", "output", "data.data_dir", "system.")
# What only places or paces the work (where, on how many threads, in which groups, how
# often it checkpoints): at most the last floating-point bits change. system.precision
# (tf32, bf16) changes the arithmetic itself, so it is not here; a system field added
# later counts as a confound until it is named here.
PLACEMENT_KEYS = ("seed", "name", "output", "data.data_dir", "system.device", "system.gpu_share",
                  "system.deterministic", "system.threads", "system.client_group",
                  "system.state_memory_mb", "system.state_dir", "system.checkpoint_every")
STATUS_ORDER = ("completed", "pruned", "running", "interrupted", "crashed", "failed")


def differing_keys(runs: list[Run], ignore=IGNORED_KEYS) -> list[str]:
    """Config keys whose values differ among the runs that have them; algorithm.name first."""
    flat = [flatten(run.config) for run in runs]
    keys = sorted(set().union(*flat)) if flat else []
    out = [k for k in keys if not _ignored(k, ignore)
           and len({_canonical(f[k]) for f in flat if k in f}) > 1]
    return sorted(out, key=lambda k: k != "algorithm.name")


def group_keys(runs: list[Run]) -> list[str]:
    """The default grouping: algorithm.name plus every differing key (seeds are averaged)."""
    return ["algorithm.name"] + [k for k in differing_keys(runs) if k != "algorithm.name"]


def confounds(runs: list[Run], keys) -> list[str]:
    """Config keys whose values differ among ``runs`` besides the grouping ``keys``, sorted.

    Not counted: ``keys`` themselves, and ``PLACEMENT_KEYS``: the seed (what a table
    averages over), labels (``name``, ``output``, ``data.data_dir``) and the system fields
    that only place or pace the work: ``system.device``, ``gpu_share``, ``threads``,
    ``client_group`` and ``deterministic`` change at most the last floating-point bits,
    ``state_memory_mb``, ``state_dir`` and ``checkpoint_every`` where and how often state
    is written. ``system.precision`` (tf32, bf16) changes the arithmetic, so it counts, as
    does any system field added later. A key only some runs have counts if its values
    differ among those; an algorithm parameter (``algorithm.alpha``) is compared only
    among runs of the same ``algorithm.name``: FedCM's alpha and FedMIM's alpha are
    different parameters, two FedCM runs with different alphas a confound.
    """
    keys = {keys} if isinstance(keys, str) else set(keys or ())
    flat = [flatten(run.config) for run in runs]
    names = sorted(set().union(*flat)) if flat else []
    return [k for k in names if k not in keys and not _ignored(k, PLACEMENT_KEYS) and _differs(flat, k)]


def _differs(flat: list[dict], key: str) -> bool:
    """Whether ``key``'s values differ among the runs that have it; for an algorithm
    parameter, among the runs of one algorithm."""
    if key.startswith("algorithm.") and key != "algorithm.name":
        by_algorithm: dict[str, set] = {}
        for f in flat:
            if key in f:
                by_algorithm.setdefault(_canonical(f.get("algorithm.name")), set()).add(_canonical(f[key]))
        return any(len(values) > 1 for values in by_algorithm.values())
    return len({_canonical(f[key]) for f in flat if key in f}) > 1


def _distinct_seeds(seeds) -> int:
    """Distinct seeds; a run without one (None) counts as distinct from every other."""
    return len({_canonical(s) for s in seeds if s is not None}) + sum(s is None for s in seeds)


def check_keys(runs: list[Run], keys, option: str = "keys") -> list[str]:
    """Every key must be a config key of some run; a typo gets the closest known key."""
    known = set().union(*(flatten(run.config) for run in runs))
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UsageError(f"{option}: no run has the config key {key!r}{hint}; keys are "
                             "dotted config fields as `fedmpi config` prints them, e.g. partition.alpha")
    return list(keys)


def rounds_table(runs: list[Run], keys=None) -> dict[str, np.ndarray]:
    """One row per (run, round): run path, status, the config ``keys``, every round field,
    and ``cum_fl_mb`` / ``cum_time_s`` (FL MB and wall seconds up to that round).

    ``keys`` defaults to ``seed`` plus the default grouping keys.
    """
    keys = _row_keys(runs, keys)
    derived = [{"cum_fl_mb": metrics.cumulative_traffic_mb(run),
                "cum_time_s": metrics.cumulative_time(run)} for run in runs]
    return _stack(runs, keys, [{**run.rounds, **extra} for run, extra in zip(runs, derived)])


def clients_table(runs: list[Run], keys=None) -> dict[str, np.ndarray]:
    """One row per (run, round, client) participation, with the same leading columns."""
    keys = _row_keys(runs, keys)
    return _stack(runs, keys, [run.clients for run in runs])


def runs_table(runs: list[Run], keys=None, at=(), targets=(), smooth=None, windows=(),
               norm=False) -> list[dict]:
    """One row per run: path, status, config (every key, or ``keys``), then the metrics
    of ``metrics.summary`` (accuracies as fractions, rounds_to_T None if never reached;
    window@A-B per ``windows``, final_norm with ``norm``)."""
    if keys is None:
        keys = sorted(set().union(*(flatten(run.config) for run in runs)))
    else:
        keys = check_keys(runs, keys)
    return [{"run": str(run.path), "status": run.status, **{k: run.get(k) for k in keys},
             **metrics.summary(run, at, targets, smooth, windows, norm)} for run in runs]


def group_table(runs: list[Run], group_by=None, at=(), targets=(), smooth=None, windows=(),
                norm=False) -> list[dict]:
    """Runs grouped by ``group_by`` (default ``group_keys``) and status, aggregated.

    One row per group: the key values, ``status``, ``n`` (runs), ``seeds`` (distinct seeds
    among them: fewer than ``n`` where runs are replicas of one seed), then for each metric
    ``<m>_mean`` and ``<m>_std`` (sample std, ddof=1; NaN for one run) over the runs where
    it is defined, and for each target ``rounds_to_T_reached`` (runs that reached it;
    the mean and std are over those runs only), and likewise ``hours_to_T_reached`` when
    some run has the virtual clock.
    """
    if not runs:
        return []
    keys = group_keys(runs) if not group_by else check_keys(runs, group_by, "--group-by")
    per_run = runs_table(runs, keys, at, targets, smooth, windows, norm)
    groups: dict[tuple, list[tuple[dict, object]]] = {}
    for run, row in zip(runs, per_run):
        group = tuple(_canonical(row[k]) for k in keys) + (row["status"],)
        groups.setdefault(group, []).append((row, run.get("seed")))
    ordered = sorted(groups.values(), key=lambda members: _sort_key(members[0][0], keys))
    names = list(dict.fromkeys(k for row in per_run for k in row if k not in ("run", "status", *keys)))
    return [_aggregate([row for row, _ in members], keys, names, [seed for _, seed in members])
            for members in ordered]


def _aggregate(rows: list[dict], keys: list[str], names: list[str], seeds: list) -> dict:
    out = {**{k: rows[0][k] for k in keys}, "status": rows[0]["status"], "n": len(rows),
           "seeds": _distinct_seeds(seeds)}
    for name in names:
        # an infinite value (an overflowed clock) is a value: it shows as inf, not as missing
        values = [r[name] for r in rows if r.get(name) is not None and not math.isnan(r[name])]
        out[f"{name}_mean"], out[f"{name}_std"] = _mean_std(values)
        if name.startswith(("rounds_to_", "hours_to_")):
            out[f"{name}_reached"] = len(values)
    return out


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    if not all(math.isfinite(v) for v in values):   # inf (an overflowed clock): no spread
        return sum(values) / len(values), math.nan
    std = float(np.std(values, ddof=1)) if len(values) > 1 else math.nan
    return float(np.mean(values)), std


def pivot(rows: list[dict], index: str, columns: list[str]) -> tuple[list, list[tuple], dict]:
    """Rows x settings from ``group_table`` rows: (row labels, setting tuples, cells) with
    ``cells[(row label, setting)]`` the group row (or absent: no run has that cell).
    List values (model.channels) become tuples, to serve as keys."""
    labels, settings, cells = [], [], {}
    for row in rows:
        label, setting = _hashable(row[index]), tuple(_hashable(row[k]) for k in columns)
        if label not in labels:
            labels.append(label)
        if setting not in settings:
            settings.append(setting)
        cells[(label, setting)] = row
    settings.sort(key=lambda s: tuple(_value_key(v) for v in s))
    return labels, settings, cells


def _row_keys(runs: list[Run], keys) -> list[str]:
    if keys is None:
        return ["seed"] + group_keys(runs)
    return check_keys(runs, keys)


def _stack(runs: list[Run], keys: list[str], parts: list[dict]) -> dict[str, np.ndarray]:
    """Concatenate per-run column dicts, a field a run lacks filled as NaN (or -1)."""
    fields = list(dict.fromkeys(name for part in parts for name in part))
    lengths = [len(next(iter(part.values()), ())) for part in parts]
    table = {"run": column([str(run.path) for run, n in zip(runs, lengths) for _ in range(n)]),
             "status": column([run.status for run, n in zip(runs, lengths) for _ in range(n)])}
    for key in keys:
        table[key] = column([run.get(key) for run, n in zip(runs, lengths) for _ in range(n)])
    for name in fields:
        pieces = [part[name] if name in part else np.full(n, schema.fill_value(name))
                  for part, n in zip(parts, lengths)]
        table[name] = np.concatenate(pieces) if pieces else np.array([])
    return table


def column(values: list) -> np.ndarray:
    """A numpy column for config values: int, float (None -> NaN), bool, str or object."""
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present) and len(present) == len(values):
        return np.array(values, dtype=bool)
    if present and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        if len(present) == len(values) and all(isinstance(v, int) for v in present):
            return np.array(values, dtype=np.int64)
        return np.array([math.nan if v is None else v for v in values], dtype=np.float64)
    if present and all(isinstance(v, str) for v in present) and len(present) == len(values):
        return np.array(values, dtype=str)
    out = np.empty(len(values), dtype=object)  # element by element: lists stay lists
    for i, v in enumerate(values):
        out[i] = v
    return out


def _hashable(value):
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def _ignored(key: str, ignore) -> bool:
    return any(key == i or (i.endswith(".") and key.startswith(i)) for i in ignore)


def _canonical(value) -> str:
    """Equal config values compare equal (lists, dicts, 1 vs 1.0 kept apart by JSON)."""
    return json.dumps(value, sort_keys=True)


def _value_key(value) -> tuple:
    """Sorts None < numbers (numerically) < strings < anything else (by JSON)."""
    if value is None:
        return (0, 0, "")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (1, value, "")
    if isinstance(value, str):
        return (2, 0, value)
    return (3, 0, _canonical(value))


def _sort_key(row: dict, keys: list[str]) -> tuple:
    status = row["status"]
    rank = STATUS_ORDER.index(status) if status in STATUS_ORDER else len(STATUS_ORDER)
    return tuple(_value_key(row[k]) for k in keys) + (rank,)
