"""A short plain-text summary of one run, read from its results file.

Config keys are read defensively: files from older or partial configs still summarize,
showing only what they record.
"""

from __future__ import annotations

import math

import numpy as np

from fedmpi.results import open_run

_WIDTH = 13  # label column
_MB = 1e6  # MB here means 10^6 bytes, as network traffic is usually quoted
_SPLIT = ("compute", "comm", "aggregate", "eval")


def summarize(path) -> str:
    """File, status, experiment, progress, accuracy, traffic and timing, one fact per line."""
    with open_run(path) as run:
        attrs, config, rounds = run.attrs, run.config, run.rounds()
    lines = [("file", str(path)), ("status", _status(attrs))]
    lines += _experiment(config)
    lines.append(("rounds", _progress(rounds, config)))
    lines += _accuracy(rounds)
    lines += _traffic(rounds)
    lines += _timing(rounds)
    return "\n".join(f"{label:<{_WIDTH}}{text}" for label, text in lines)


def _get(config: dict, dotted: str):
    """config["a"]["b"] for "a.b", or None when any level is absent or not a dict."""
    value = config
    for key in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _status(attrs: dict) -> str:
    text = str(attrs.get("status", "unknown"))
    if attrs.get("failed_round") is not None:
        text += f" at round {attrs['failed_round']}"
    if attrs.get("error"):
        text += f": {attrs['error']}"
    created = attrs.get("created")
    return f"{text} (created {created}, fedmpi {attrs.get('fedmpi_version', '?')})" if created else text


def _experiment(config: dict) -> list[tuple[str, str]]:
    """Algorithm, data + partition, model, client counts: whichever the config has."""
    lines = []
    for label, key in (("algorithm", "algorithm.name"), ("dataset", "data.dataset"), ("model", "model.name")):
        if _get(config, key) is not None:
            lines.append((label, str(_get(config, key))))
    kind, alpha = _get(config, "partition.kind"), _get(config, "partition.alpha")
    if kind is not None:
        lines.append(("partition", f"{kind} (alpha={alpha})" if alpha is not None and kind == "dirichlet" else str(kind)))
    clients, per_round = _get(config, "clients.num"), _get(config, "clients.per_round")
    parts = [f"{clients} total" if clients is not None else None,
             f"{per_round} per round" if per_round is not None else None]
    if any(parts):
        lines.append(("clients", ", ".join(p for p in parts if p)))
    return lines


def _progress(rounds: dict, config: dict) -> str:
    done = len(next(iter(rounds.values()), []))
    planned = _get(config, "rounds")
    return f"{done} of {planned} completed" if planned is not None else f"{done} completed"


def _round_numbers(rounds: dict) -> np.ndarray:
    """The recorded round ids, or 1..n if the file has no round column."""
    n = len(next(iter(rounds.values()), []))
    return rounds.get("round", np.arange(1, n + 1))


def _accuracy(rounds: dict) -> list[tuple[str, str]]:
    """Final = last evaluated round (NaN rows were not evaluated); best and when."""
    acc = rounds.get("test_acc")
    if acc is None or not np.any(np.isfinite(acc)):
        return []
    evaluated = np.flatnonzero(np.isfinite(acc))
    last, best = evaluated[-1], evaluated[np.argmax(acc[evaluated])]
    ids = _round_numbers(rounds)
    return [("test acc", f"final {_pct(acc[last])} (round {ids[last]}), "
                         f"best {_pct(acc[best])} (round {ids[best]})")]


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.2f}%"


def _total(rounds: dict, field: str) -> int | None:
    """Sum of a byte column, None when the column is absent or never measured."""
    column = rounds.get(field)
    if column is None or not np.any(np.isfinite(column)):
        return None
    return int(round(float(np.nansum(column))))


def _traffic(rounds: dict) -> list[tuple[str, str]]:
    lines = []
    down, up = _total(rounds, "fl_bytes_down"), _total(rounds, "fl_bytes_up")
    if down is not None or up is not None:
        total = (down or 0) + (up or 0)
        split = f": {_mb(down or 0)} down, {_mb(up or 0)} up"
        lines.append(("FL traffic", f"{_mb(total)} ({total} bytes){split}"))
    mpi = _total(rounds, "mpi_bytes")
    if mpi is not None:
        lines.append(("MPI traffic", f"{_mb(mpi)} ({mpi} bytes)"))
    return lines


def _mb(n_bytes: int) -> str:
    return f"{n_bytes / _MB:.2f} MB"


def _mean(rounds: dict, field: str) -> float | None:
    column = rounds.get(field)
    if column is None or not np.any(np.isfinite(column)):
        return None
    return float(np.nanmean(column))


def _timing(rounds: dict) -> list[tuple[str, str]]:
    """Mean wall seconds per round and how it splits, each part with its share of wall."""
    wall = _mean(rounds, "time_wall")
    parts = [(name, _mean(rounds, f"time_{name}")) for name in _SPLIT]
    parts = [(name, sec) for name, sec in parts if sec is not None]
    lines = []
    if wall is not None:
        lines.append(("time/round", f"{wall:.3f} s mean wall"))
    if parts:
        share = (lambda s: f" ({100 * s / wall:.0f}%)") if wall and math.isfinite(wall) else (lambda s: "")
        lines.append(("  split", ", ".join(f"{name} {sec:.3f} s{share(sec)}" for name, sec in parts)))
    return lines
