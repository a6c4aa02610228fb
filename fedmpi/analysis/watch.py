"""Follow a run's results file while it is written: one line per new round, then its end.

The writer flushes once per round in SWMR mode, so a reader sees each round as soon as
it is complete. Each poll opens the file afresh: attributes (the status) are read only
when a file is opened, and a fresh open also survives the writer briefly leaving SWMR
to set the status or write a checkpoint (a poll that fails then is simply retried).

Exit codes (``watch`` returns them; ``fedmpi watch`` exits with them): 0 the run
completed (or, with ``once``, is still running), 1 it failed, 75 it was interrupted
(preempted; resumable, as ``fedmpi run`` exits then), 2 bad input.
"""

from __future__ import annotations

import math
import time

import numpy as np

from fedmpi.analysis.runs import latest_rows
from fedmpi.errors import UsageError
from fedmpi.results import open_run

EXIT_CODES = {"completed": 0, "failed": 1, "interrupted": 75}
_RECENT = 5          # rounds averaged for s/round and the ETA
_MAX_FAILED_POLLS = 50  # consecutive unreadable polls before giving up


def watch(path, interval: float = 2.0, once: bool = False, wait: bool = False, echo=print) -> int:
    """Print progress lines as rounds appear until the run ends; return the exit code.

    ``wait``: the file need not exist yet (a job still queued); poll until it can be read.
    """
    status, config, rounds, attrs = _first_read(path, interval, wait, echo)
    echo(header(path, status, config))
    shown = max(len(rounds.get("round", ())) - 1, 0) if once else 0  # once: the newest row only
    while True:
        n = len(rounds.get("round", ()))
        for i in range(shown, n):  # only the newest row has the file's current status
            echo(progress_line(rounds, i, config, status if i == n - 1 else "running"))
        shown = max(shown, n)
        if status in EXIT_CODES:
            echo(ending(path, status, rounds, config, attrs))
            return EXIT_CODES[status]
        if once:
            return 0
        time.sleep(interval)
        status, config, rounds, attrs = _poll(path)


def _first_read(path, interval: float, wait: bool, echo):
    if not wait:
        return _read(path)
    waiting = False
    while True:
        try:
            return _read(path)
        except (UsageError, OSError, KeyError):
            if not waiting:
                echo(f"waiting for {path}")
                waiting = True
            time.sleep(interval)


def _read(path):
    """status, config, round rows (superseded rows dropped) and attrs, from a fresh open."""
    with open_run(path) as f:
        return f.status, f.config, latest_rows(f.rounds(), by_block=False), f.attrs


def _poll(path):
    """_read, retried while the writer has the file out of SWMR for a moment."""
    for attempt in range(_MAX_FAILED_POLLS):
        try:
            return _read(path)
        except (UsageError, OSError, KeyError):
            time.sleep(0.1 * (attempt + 1))
    return _read(path)


def header(path, status: str, config: dict) -> str:
    algorithm = (config.get("algorithm") or {}).get("name", "?")
    dataset = (config.get("data") or {}).get("dataset", "?")
    return f"watching {path}: {algorithm} on {dataset}, {config.get('rounds', '?')} rounds, {status}"


def progress_line(rounds: dict, i: int, config: dict, status: str) -> str:
    """round, train loss, test acc (if evaluated), s/round, ETA, status."""
    planned = config.get("rounds")
    r = int(rounds["round"][i])
    parts = [f"round {r:>4}/{planned if planned is not None else '?'}"]
    parts.append(f"train_loss {_get(rounds, 'train_loss', i):.4f}")
    acc = _get(rounds, "test_acc", i)
    if math.isfinite(acc):
        parts.append(f"test_acc {acc:.4f}")
    recent = rounds.get("time_wall", np.array([]))[max(0, i + 1 - _RECENT):i + 1]
    recent = recent[np.isfinite(recent)]
    if len(recent):
        per_round = float(recent.mean())
        parts.append(f"{per_round:.2f} s/round")
        if isinstance(planned, int):
            parts.append(f"eta {duration(per_round * max(planned - r, 0))}")
    parts.append(status)
    return "  ".join(parts)


def ending(path, status: str, rounds: dict, config: dict, attrs: dict) -> str:
    """The run's last word: completed with its accuracy, failed with why, or interrupted."""
    done = int(rounds["round"][-1]) if len(rounds.get("round", ())) else 0
    planned = config.get("rounds", "?")
    if status == "completed":
        acc = rounds.get("test_acc", np.array([]))
        acc = acc[np.isfinite(acc)]
        final = f", final test_acc {acc[-1]:.4f} (best {acc.max():.4f})" if len(acc) else ""
        wall = float(np.nansum(rounds.get("time_wall", [])))
        return f"completed: {done}/{planned} rounds{final}, {duration(wall)} of training"
    if status == "failed":
        where = f" at round {attrs['failed_round']}" if attrs.get("failed_round") is not None else ""
        return f"failed{where} after {done}/{planned} rounds: {attrs.get('error', 'no error recorded')}"
    return f"interrupted after {done}/{planned} rounds; continue with: fedmpi run --resume {path}"


def duration(seconds: float) -> str:
    """46 s, 12.5 min, 3.2 h."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _get(rounds: dict, field: str, i: int) -> float:
    column = rounds.get(field)
    return float(column[i]) if column is not None else math.nan
