"""The virtual clock's inputs (fedmpi.runtime.vclock): the tables it reads from files,
the bound that keeps its times finite, and what a resume compares.

Tables (``profile_file``, ``availability_file``): a CSV with a header row (columns in any
order, others ignored, none twice) or an .npz with arrays of the columns' names. Client
ids are positions in the population, 0..N-1 (N: its identities), read exactly: a CSV's
ids as text, never through a float (2^53 + 1 stays itself; ``7.0`` is client 7), an
.npz's in their own dtype. An id that is not a whole number, or that no client has, is
refused with the file's line (CSV, the header being line 1) or row (.npz, from 1).

Overflow: every time is finite by construction of the inputs' ranges except through
their sizes (``step_time = 1e308``, a bandwidth of 5e-324 Mbit/s). ``overflow`` bounds
the clock after the last round by ``rounds`` participations of the slowest client (times
FedBuff's arrivals per step, times HEADROOM for a later phase's own bytes and steps,
which the clock learns only in the round), after the last opening of a trace; the config
check bounds it with one unit of work and one byte each way, the clock's set-up with
the real ones.
"""

from __future__ import annotations

import csv
import hashlib
import zipfile
from decimal import Decimal, InvalidOperation
from pathlib import Path

import numpy as np

from ..errors import UsageError

PROFILE_FIELDS = ("speed", "down_mbps", "up_mbps", "latency")
TRACE_FIELDS = ("client", "start", "end")
ID_LIMIT = 2 ** 63   # ids are int64: no population reaches it
HEADROOM = 2 ** 10
TIER_FIELDS = {"speed": "tier_speeds", "down_mbps": "tier_down_mbps", "up_mbps": "tier_up_mbps"}


def read_table(path, columns: tuple[str, ...], field: str,
               num_clients: int | None = None) -> dict[str, np.ndarray]:
    """The named ``columns`` of a user file, ``columns[0]`` the client ids (int64, each in
    0..num_clients-1, or 0..2^63-1 when the population is not known yet), the others
    float64. Anything wrong is a one-line UsageError naming ``field``."""
    def bad(message: str) -> UsageError:
        return UsageError(f"config field {field}: {message}")

    if not isinstance(path, str) or not path:
        raise bad(f"needs a file path (a .csv or .npz file with columns {', '.join(columns)})")
    file = Path(path).expanduser()
    if not file.exists():
        raise bad(f"{path} does not exist")
    if file.is_dir():
        raise bad(f"{path} is a directory; give a .csv or .npz file")
    if not file.is_file():   # a link to /dev/zero: a CSV line that never ends
        raise bad(f"{path} is not a regular file (a device, a pipe or a socket); give a .csv "
                  f"or .npz file")
    suffix = file.suffix.lower()
    if suffix not in (".csv", ".npz"):
        raise bad(f"{path} is not a .csv or .npz file name")
    ids = _Ids(file, bad, num_clients)
    try:
        read = _read_npz if suffix == ".npz" else _read_csv
        out = read(file, columns, bad, ids)
    except UsageError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, csv.Error) as exc:
        detail = " ".join(str(exc).split()) or "no message"
        raise bad(f"cannot read {path} ({type(exc).__name__}: {detail})") from None
    if not len(out[columns[0]]):
        raise bad(f"{path} has no rows")
    return out


class _Ids:
    """Client ids checked one row at a time: whole numbers in 0..limit-1, exactly."""

    def __init__(self, file, bad, num_clients: int | None):
        self.file, self.bad, self.num = file, bad, num_clients
        self.limit = ID_LIMIT if num_clients is None else num_clients

    def refuse(self, where: str, shown: str, whole: bool) -> UsageError:
        if whole and self.num is not None:
            return self.bad(f"{self.file} {where}: client {shown} is not in the population of "
                            f"{self.num} (ids 0..{self.num - 1})")
        return self.bad(f"{self.file} {where}: client {shown} is not a client id (a whole "
                        f"number in 0..{self.limit - 1})")

    def from_text(self, texts: list[str], lines: list[int]) -> np.ndarray:
        out = np.empty(len(texts), dtype=np.int64)
        for i, (text, line) in enumerate(zip(texts, lines)):
            try:
                value = int(text)   # exact, however long (within Python's digit limit)
            except ValueError:
                value = _decimal(text)
            if value is None:
                raise self.bad(f"{self.file} line {line}: client {text[:40]!r} is not a number")
            if isinstance(value, Decimal):   # 1e30, 7.0, 1.5, nan: exact, no float
                whole = value.is_finite() and value >= 0 and value == value.to_integral_value()
            else:
                whole = value >= 0
            if not whole or value >= self.limit:
                raise self.refuse(f"line {line}", text[:40], whole)
            out[i] = int(value)
        return out

    def from_array(self, a: np.ndarray) -> np.ndarray:
        if a.dtype.kind == "f":
            whole = np.isfinite(a) & (a >= 0) & (a == np.round(a))
            over = whole & (a >= float(self.limit))
        else:   # integers and booleans, compared in their own dtype
            whole = a >= 0 if a.dtype.kind == "i" else np.ones(len(a), dtype=bool)
            over = whole & (a >= self.limit)
        wrong = np.flatnonzero(~whole | over)
        if len(wrong):
            i = int(wrong[0])
            shown = repr(float(a[i])) if a.dtype.kind == "f" else str(int(a[i]))
            raise self.refuse(f"row {i + 1}", shown, bool(whole[i]))
        return a.astype(np.int64)


def _decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def _read_csv(file: Path, columns, bad, ids: _Ids) -> dict[str, np.ndarray]:
    rows, lines = [], []   # the non-blank rows, and the line each ends on
    with open(file, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        for r in reader:
            if any(x.strip() for x in r):
                rows.append(r)
                lines.append(reader.line_num)
    if not rows:
        raise bad(f"{file} is empty (it needs a header row: {','.join(columns)})")
    header = [h.strip().lower() for h in rows[0]]
    for j, name in enumerate(header):
        if name and name in header[:j]:
            raise bad(f"{file} has the column {name} twice (columns {header.index(name) + 1} "
                      f"and {j + 1}); each column once")
    missing = [c for c in columns if c not in header]
    if missing:
        raise bad(f"{file} has no column {', '.join(missing)} (its header row: "
                  f"{','.join(header)[:80]}; needed: {','.join(columns)})")
    for line, r in zip(lines[1:], rows[1:]):
        if len(r) != len(header):
            raise bad(f"{file} line {line} has {len(r)} fields, the header {len(header)}")
    out = {}
    for c in columns:
        i = header.index(c)
        values = [r[i].strip() for r in rows[1:]]
        if c == columns[0]:
            out[c] = ids.from_text(values, lines[1:])
            continue
        try:
            out[c] = np.array(values, dtype=np.float64)
        except ValueError:
            k = next(k for k, v in enumerate(values) if not _is_number(v))
            raise bad(f"{file} line {lines[k + 1]}: {c} {values[k][:40]!r} is not a "
                      f"number") from None
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _read_npz(file: Path, columns, bad, ids: _Ids) -> dict[str, np.ndarray]:
    if not zipfile.is_zipfile(file):
        raise bad(f"{file} is not an .npz file (numpy.savez writes one)")
    with np.load(file, allow_pickle=False) as z:
        twice = sorted({name for name in z.files if z.files.count(name) > 1})
        if twice:   # a zip may hold two members of one name; numpy would take one
            raise bad(f"{file} has the array {twice[0]} twice (two members of one name in the "
                      f"zip); each array once")
        missing = [c for c in columns if c not in z.files]
        if missing:
            raise bad(f"{file} has no array {', '.join(missing)} (needed: {', '.join(columns)})")
        out = {}
        for c in columns:
            a = z[c]
            if a.ndim != 1 or a.dtype.kind not in "biuf":
                raise bad(f"{file}: array {c} must be 1-D numbers, got {a.dtype} {a.shape}")
            out[c] = a
    if len({len(a) for a in out.values()}) > 1:
        raise bad(f"{file}: arrays {', '.join(columns)} differ in length")
    return {c: ids.from_array(a) if c == columns[0] else a.astype(np.float64)
            for c, a in out.items()}


def read_profiles(path, num_clients: int | None = None) -> dict[str, np.ndarray]:
    """``profiles = "file"``: the table of ``profile_file`` (``read_table``), values finite,
    speed and bandwidths > 0, latency >= 0, each client once; with ``num_clients`` every
    id 0..num_clients-1 exactly once, and the profiles come back in client order (as
    ``draw_profiles``'s)."""
    field = "system_model.profile_file"
    t = read_table(path, ("client",) + PROFILE_FIELDS, field, num_clients)
    ids = t["client"]
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise UsageError(f"config field {field}: {path}: client {uniq[counts > 1][0]} has "
                         f"{counts[counts > 1][0]} rows (each client exactly once)")
    for name in PROFILE_FIELDS:
        v = t[name]
        ok = np.isfinite(v) & ((v >= 0) if name == "latency" else (v > 0))
        if not ok.all():
            need = ">= 0" if name == "latency" else "> 0"
            raise UsageError(f"config field {field}: {path}: client {ids[~ok][0]}'s {name} must "
                             f"be a finite number {need}, got {v[~ok][0]}")
    if num_clients is not None and len(ids) != num_clients:
        missing = np.setdiff1d(np.arange(num_clients), ids)
        raise UsageError(f"config field {field}: {path} has no row for client {missing[0]} "
                         f"({len(missing)} of the {num_clients} clients missing; every id "
                         f"0..{num_clients - 1} needs one)")
    order = np.argsort(ids, kind="stable")
    return {name: t[name][order] for name in PROFILE_FIELDS}


def read_trace(path, num_clients: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``availability = "trace"``: (client, start, end) of ``availability_file``, in
    virtual seconds: start finite, end > start (may be inf); clients below
    ``num_clients`` when known; a client may have any number of intervals."""
    field = "system_model.availability_file"
    t = read_table(path, TRACE_FIELDS, field, num_clients)
    ids, start, end = t["client"], t["start"], t["end"]
    ok = np.isfinite(start) & ~np.isnan(end) & (end > start)
    if not ok.all():
        i = np.flatnonzero(~ok)[0]
        raise UsageError(f"config field {field}: {path}: client {ids[i]}'s interval "
                         f"[{start[i]}, {end[i]}) needs a finite start before its end")
    return ids, start, end


# ---- a clock that stays finite ----------------------------------------------------------------

def horizon(config) -> float:
    """Participations of the slowest client the clock can add up over the run: one a
    round (a FedBuff step waits for K arrivals, each at most one participation after the
    last), times HEADROOM."""
    m = config.system_model
    per_step = (m.buffer or m.concurrency or config.clients.per_round) \
        if m.policy == "fedbuff" else 1
    return float(config.rounds) * per_step * HEADROOM


def overflow(profiles: dict, units, bytes_down: float, bytes_up: float, step_time: float,
             times: float, opening: float = 0.0) -> tuple[int, str] | None:
    """(index, the largest term: "speed" for compute, "down_mbps", "up_mbps", "latency")
    of the first device whose participation (``units`` of work at ``step_time`` each)
    ``times`` over, after ``opening``, is not a finite number of seconds; None when
    every one is."""
    n = len(profiles["speed"])
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        terms = {"speed": np.asarray(units, dtype=np.float64) * step_time / profiles["speed"],
                 "down_mbps": bytes_down * 8 / (profiles["down_mbps"] * 1e6),
                 "up_mbps": bytes_up * 8 / (profiles["up_mbps"] * 1e6),
                 "latency": 2 * profiles["latency"]}
        terms = {k: np.broadcast_to(v, (n,)) for k, v in terms.items()}
        total = opening + times * sum(terms.values())
    wrong = np.flatnonzero(~np.isfinite(total))
    if not len(wrong):
        return None
    i = int(wrong[0])
    return i, max(terms, key=lambda k: np.nan_to_num(terms[k][i], nan=np.inf))


def overflow_error(config, profiles: dict, hit: tuple[int, str], units, step_time: float,
                   who: str) -> UsageError:
    """The one line for ``overflow``'s ``hit`` (``who``: the device it names), naming the
    field whose value makes it: compute blames the speed when one unit of work is faster
    than the speed is slow, else the step time; a profile file's device by its client id."""
    m, (i, term) = config.system_model, hit
    source = m.profiles
    value = float(profiles[term][i])
    if term == "speed" and float(np.max(units)) * step_time >= 1 / value:
        field, shown = "system_model.step_time", repr(float(step_time))
    elif source == "file":
        field = "system_model.profile_file"
        shown = f"{m.profile_file}: client {i}'s {term} {value!r}"
    elif source == "tiers" and term != "latency":
        field, shown = f"system_model.{TIER_FIELDS[term]}", repr(value)
    else:
        name = {"speed": "speed_sigma"}.get(term, term)
        field, shown = f"system_model.{name}", repr(float(getattr(m, name)))
    return UsageError(f"config field {field}: {shown} makes the virtual clock overflow: "
                      f"{config.rounds} rounds of {who}'s participation (download, "
                      f"compute, upload) would not be a finite number of seconds; give values "
                      f"a real deployment has")


def check_config_clock(config, table: dict | None, trace) -> None:
    """The config's bound: every device the config names (the lognormal medians, each
    tier, each row of ``table``, the profile file's), one unit of work each epoch and one
    byte each way, over ``horizon`` after the trace's last opening."""
    m = config.system_model
    if m.profiles == "file":
        profiles = table
    elif m.profiles == "tiers":
        profiles = {"speed": np.asarray(m.tier_speeds, dtype=np.float64),
                    "down_mbps": np.asarray(m.tier_down_mbps, dtype=np.float64),
                    "up_mbps": np.asarray(m.tier_up_mbps, dtype=np.float64)}
        profiles["latency"] = np.full(len(profiles["speed"]), float(m.latency))
    else:   # lognormal: the medians (the set-up checks every draw)
        profiles = {"speed": np.ones(1), "down_mbps": np.array([float(m.down_mbps)]),
                    "up_mbps": np.array([float(m.up_mbps)]),
                    "latency": np.array([float(m.latency)])}
    step_time = 0.0 if m.measure_step_time else float(m.step_time)   # measured: at set-up
    units = config.train.local_epochs
    opening = float(trace[1].max()) if trace is not None else 0.0
    hit = overflow(profiles, units, 1, 1, step_time, horizon(config), opening)
    if hit is not None:
        who = {"file": f"client {hit[0]}", "tiers": f"a tier-{hit[0]} device"}.get(
            m.profiles, "the median device")
        raise overflow_error(config, profiles, hit, units, step_time, who)


# ---- what a resume compares --------------------------------------------------------------------

def trace_digest(trace) -> str:
    """SHA-256 of the trace as read, its rows in one order (client, start, end): the same
    table in another row or column order, or written otherwise (1e3, 1000.0), has the
    same digest."""
    client, start, end = (np.asarray(a) for a in trace)
    order = np.lexsort((end, start, client))
    digest = hashlib.sha256(b"fedmpi availability trace v1")
    for a, dtype in ((client, "<i8"), (start + 0.0, "<f8"), (end + 0.0, "<f8")):   # -0.0 is 0.0
        digest.update(np.ascontiguousarray(a[order], dtype=dtype).tobytes())
    return digest.hexdigest()


def input_digests(config, clock) -> dict[str, str]:
    """What the results file keeps of the files the clock read: each file's SHA-256 (which
    file the run had) and the trace's table digest (``trace_digest``: what a resume
    compares; the device table itself is kept under /partition)."""
    m = config.system_model
    files = {"profile_file_sha256": m.profile_file if m.profiles == "file" else "",
             "availability_file_sha256": m.availability_file if m.availability == "trace" else ""}
    out = {k: hashlib.sha256(Path(f).read_bytes()).hexdigest() for k, f in files.items() if f}
    if clock.availability is not None and clock.availability.kind == "trace":
        out["availability_trace_sha256"] = trace_digest(clock.availability.trace)
    return out


def input_changes(config, clock, stored: dict, attrs: dict) -> list[str]:
    """How the devices and the trace a resume reads differ from the run's (its file's
    /partition ``stored`` and attributes ``attrs``), one text each; [] when they do not."""
    m = config.system_model
    hint = "was system_model.profile_file changed?" if m.profiles == "file" else \
        "was the code changed?"
    changes = []
    was = {k: stored.get(f"device_{k}") for k in clock.profiles}
    lengths = {len(v) for v in was.values() if v is not None}
    count = len(clock.profiles["speed"])
    if any(v is None for v in was.values()) or lengths != {count}:
        changes.append(f"the run had {max(lengths, default=0)} devices, this resume {count}; "
                       f"{hint}")
    else:
        diffs = [f"client {c} {k} {np.asarray(was[k][c]).item()!r} -> "
                 f"{np.asarray(v[c]).item()!r}"
                 for k, v in clock.profiles.items() for c in np.flatnonzero(was[k] != v)]
        if diffs:
            more = f" and {len(diffs) - 3} more" if len(diffs) > 3 else ""
            changes.append(f"{', '.join(diffs[:3])}{more}; {hint}")
    if m.availability == "trace":
        now = input_digests(config, clock)
        key = "availability_trace_sha256" if "availability_trace_sha256" in attrs else \
            "availability_file_sha256"   # a file written before the table's digest
        if attrs.get(key) != now.get(key):
            changes.append("the availability trace is another table than the run's, its rows "
                           "taken in any order; was system_model.availability_file changed?")
    return changes
