"""Follow a run's results file while it is written: one line per new round, then its end.

The writer flushes once per round in SWMR mode, so a reader sees each round as soon as
it is complete. Each poll opens the file afresh: attributes (the status) are read only
when a file is opened, and a fresh open also survives the writer briefly leaving SWMR
to set the status or write a checkpoint (a poll that fails then is simply retried).

A run whose process died leaves its file saying "running" for ever, so each poll also
asks whether the writer the file records (``fedmpi.results.liveness``) is alive. On its
own host that is known, and a dead writer ends the watch at once. From another host (or
for a file that records no writer) it is not: the watch gives up when no new round has
come for ``_STALL_ROUNDS`` times the median round time, and never sooner than
``_STALL_MIN`` seconds, counted from the file's last change.

Exit codes (``watch`` returns them; ``fedmpi watch`` exits with them): 0 the run
completed (or, with ``once``, is still running; or a tuning study pruned it), 1 it failed or crashed (its writer is
gone, or presumed gone after such a stall), 75 it was interrupted (preempted; resumable,
as ``fedmpi run`` exits then), 124 ``timeout`` seconds passed without a new round (or,
with ``wait``, without the file), 2 bad input (also a damaged file).
"""

from __future__ import annotations

import math
import os
import socket
import time
from pathlib import Path

import numpy as np

from fedmpi.analysis.runs import latest_rows
from fedmpi.errors import UsageError, did_you_mean
from fedmpi.results import liveness, open_run

EXIT_CODES = {"completed": 0, "pruned": 0, "failed": 1, "interrupted": 75}
EXIT_CRASHED = 1
EXIT_TIMEOUT = 124      # as coreutils timeout
_RECENT = 5             # rounds averaged for s/round and the ETA
_MAX_FAILED_POLLS = 50  # consecutive unreadable polls before giving up
_STALL_ROUNDS = 30      # median rounds without a new one before an unverifiable writer is presumed dead
_STALL_MIN = 1800.0     # ... but never fewer seconds than this (a slow evaluation, a busy file system)


def watch(path, interval: float = 2.0, once: bool = False, wait: bool = False, echo=print,
          timeout: float | None = None, note=None) -> int:
    """Print progress lines as rounds appear until the run ends; return the exit code.

    ``wait``: the file need not exist yet (a job still queued); poll until it can be read,
    saying so once through ``note`` (default: ``echo``; ``fedmpi watch``: stderr).
    ``timeout``: give up (EXIT_TIMEOUT) after this many seconds without a new round.
    """
    quiet_since = time.monotonic()   # when a round (or the status) last changed
    current = _first_read(path, interval, wait, note or echo, _until(quiet_since, timeout))
    if current is None:
        echo(f"timeout: {path} did not become readable within {_seconds(timeout)}")
        return EXIT_TIMEOUT
    status, config, rounds, attrs = current
    echo(header(path, status, config))
    shown = max(len(rounds.get("round", ())) - 1, 0) if once else 0  # once: the newest row only
    stalled_since = quiet_since - file_age(path)  # a file untouched for a day has been stalled that long
    seen, dead = (len(rounds.get("round", ())), status), False
    while True:
        status, config, rounds, attrs = current
        n = len(rounds.get("round", ()))
        for i in range(shown, n):  # only the newest row has the file's current status
            echo(progress_line(rounds, i, config, status if i == n - 1 else "running"))
        shown = max(shown, n)
        if status in EXIT_CODES:
            echo(ending(path, status, rounds, config, attrs))
            return EXIT_CODES[status]
        if dead:
            echo(crashed(path, rounds, config, attrs))
            return EXIT_CRASHED
        writer = attrs.get("writer")
        state = liveness.state(writer)
        if state == liveness.GONE:
            # read once more: it may have ended the run just before it exited; a resume
            # started meanwhile records a new writer
            current = _poll(path)
            dead = current[3].get("writer") == writer
            continue
        if once:
            return 0
        now = time.monotonic()
        if (n, status) != seen:
            seen, quiet_since, stalled_since = (n, status), now, now
        if timeout is not None and now - quiet_since >= timeout:
            echo(timed_out(rounds, config, timeout))
            return EXIT_TIMEOUT
        limit = stall_limit(rounds) if state == liveness.UNKNOWN else math.inf
        if now - stalled_since >= limit:
            echo(presumed_dead(path, rounds, config, writer, now - stalled_since))
            return EXIT_CRASHED
        until = min(math.inf if timeout is None else quiet_since + timeout, stalled_since + limit)
        time.sleep(max(min(interval, until - now), 0))
        current = _poll(path, _until(quiet_since, timeout))
        if current is None:
            echo(timed_out(rounds, config, timeout))
            return EXIT_TIMEOUT


def _first_read(path, interval: float, wait: bool, note, until: float | None):
    """The first read; with ``wait``, after the file appears (None if ``until`` passes)."""
    if not wait:
        return _read(path)
    waiting = False
    while not os.path.exists(path):
        if not waiting:
            note(f"waiting for {path} to appear...{_near(path)}")
            waiting = True
        if until is not None and time.monotonic() + interval >= until:
            time.sleep(max(until - time.monotonic(), 0))
            if not os.path.exists(path):
                return None
            break
        time.sleep(interval)
    return _poll(path, until)


def _near(path) -> str:
    """A hint for a file that may never appear: a folder on its way is a file (an error),
    or a file of a close name is there already (a typo)."""
    folder = Path(path).absolute().parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"results file {path} cannot appear: {folder} is not a directory")
    if folder != Path(path).absolute().parent:
        return ""
    try:
        names = [entry.name for entry in os.scandir(folder) if entry.is_file()]
    except OSError:
        return ""
    return did_you_mean(Path(path).name, names, dotted=False)


def _read(path):
    """status, config, round rows (superseded rows dropped) and attrs, from a fresh open."""
    with open_run(path) as f:
        return f.status, f.config, latest_rows(f.rounds(), by_block=False), f.attrs


def _poll(path, until: float | None = None):
    """_read, retried while the writer has the file out of SWMR for a moment; None if the
    monotonic time ``until`` comes first."""
    for attempt in range(_MAX_FAILED_POLLS):
        try:
            return _read(path)
        except (UsageError, OSError, KeyError):
            pause = 0.1 * (attempt + 1)
            if until is not None and time.monotonic() + pause >= until:
                return None
            time.sleep(pause)
    return _read(path)


def stall_limit(rounds: dict) -> float:
    """Seconds without a new round after which a writer that cannot be checked is
    presumed dead: _STALL_ROUNDS median rounds, at least _STALL_MIN."""
    wall = np.asarray(rounds.get("time_wall", []), dtype=float)
    wall = wall[np.isfinite(wall)]
    return max(_STALL_ROUNDS * float(np.median(wall)), _STALL_MIN) if len(wall) else _STALL_MIN


def header(path, status: str, config: dict) -> str:
    algorithm = (config.get("algorithm") or {}).get("name", "?")
    dataset = (config.get("data") or {}).get("dataset", "?")
    return f"watching {path}: {algorithm} on {dataset}, {config.get('rounds', '?')} rounds, {status}"


def progress_line(rounds: dict, i: int, config: dict, status: str) -> str:
    """round, train loss, test acc (if evaluated), s/round, ETA, status; round 0 (the
    initial model, only evaluated) has no loss and says nothing of round times."""
    planned = config.get("rounds")
    r = int(rounds["round"][i])
    parts = [f"round {r:>4}/{planned if planned is not None else '?'}"]
    parts.append(f"train_loss {_get(rounds, 'train_loss', i):.4f}" if r else "initial model")
    acc = _get(rounds, "test_acc", i)
    if math.isfinite(acc):
        parts.append(f"test_acc {acc:.4f}")
    start = max(0, i + 1 - _RECENT)
    ids = rounds["round"][start:i + 1]
    recent = rounds.get("time_wall", np.full(len(rounds["round"]), np.nan))[start:i + 1]
    recent = recent[np.isfinite(recent) & (ids >= 1)]
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
    if status == "pruned":
        return f"pruned by its tuning study after {done}/{planned} rounds"
    return f"interrupted after {done}/{planned} rounds; continue with: fedmpi run --resume {path}"


def crashed(path, rounds: dict, config: dict, attrs: dict) -> str:
    """The file still says running but its writer is dead: a crash (kill, OOM, node loss)."""
    return (f"crashed after {_done(rounds, config)} rounds: its writer "
            f"({liveness.describe(attrs.get('writer'))}) is gone and the file still says running; "
            f"continue with: fedmpi run --resume {path}")


def presumed_dead(path, rounds: dict, config: dict, writer, idle: float) -> str:
    """No new round for stall_limit seconds, from a writer this host cannot check."""
    if isinstance(writer, dict):
        who = f"its writer ({liveness.describe(writer)}) cannot be checked from {socket.gethostname()}"
    else:
        who = "the file records no writer to check"
    return (f"presumed crashed after {_done(rounds, config)} rounds: no new round for {duration(idle)} "
            f"(the limit: {_STALL_ROUNDS} x the median round time, at least {duration(_STALL_MIN)}) "
            f"and {who}; if it is gone, continue with: fedmpi run --resume {path}")


def timed_out(rounds: dict, config: dict, timeout: float) -> str:
    return (f"timeout: no new round within {_seconds(timeout)}, after {_done(rounds, config)} rounds "
            f"(the run itself is left alone)")


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


def _done(rounds: dict, config: dict) -> str:
    done = int(rounds["round"][-1]) if len(rounds.get("round", ())) else 0
    return f"{done}/{config.get('rounds', '?')}"


def _until(start: float, timeout: float | None) -> float | None:
    return None if timeout is None else start + timeout


def _seconds(timeout: float) -> str:
    return f"{timeout:g} s"


def file_age(path) -> float:
    """Seconds since the file last changed (0 if that is unknown or in the future)."""
    try:
        return max(time.time() - os.stat(path).st_mtime, 0.0)
    except OSError:
        return 0.0
