"""The virtual clock: how long a round would take on the simulated deployment, and who
finishes it in time.

With ``[system_model]`` on, every client has a device (fedmpi.runtime.devices: a speed
and bandwidths, drawn from the seed or read from ``profile_file``). A client's
participation then takes, from the round's start,

    download = bytes_down * 8 / downlink + latency
    compute  = local steps * step_time / speed
    upload   = bytes_up * 8 / uplink + latency

with the bytes of the exact FL ledger (what the algorithm declares it sends, at the
codecs' encoded sizes) and the local steps its data gives (E ceil(n_i / B); or its E n_i
samples with ``step_unit = "sample"``). ``step_time`` is given or measured at start-up
(``measure_step_time``). A method with later phases (FNR-FL's refinement) has them timed
after the first (``later_phase``). All of it is known before anyone trains,
so the server decides who finishes in time at sampling (``schedule``), and the clients
that would not are not trained at all: their work would be wasted, and the file says
how many they were. Round policies (``system_model.policy``):

- ``wait_all``: the round ends when its last client has uploaded;
- ``deadline``: the round ends at the deadline; clients that would finish later are
  dropped (the round ends earlier when everyone is done before it);
- ``overselect`` (Bonawitz et al., "Towards Federated Learning at Scale", 2019): S (1 + e)
  clients are selected (rounded up) and the first S to finish are kept; the round ends
  with the S-th.

Who can be selected (``system_model.availability``) and who drops out mid-round
(``system_model.dropout``) is fedmpi.runtime.availability's: the server samples S_t among
the clients available in round t only (``sample_available``: the round's
``clients.sampling`` over the available subset; all of them when fewer than it needs are
available, nobody when none is: the round then trains nobody); the round's policy applies
to those who do not drop out (the server does not wait for the others). The clients a
round drops get /clients rows of their own (``dropped_rows``).

Every draw is keyed by (seed, round, client) through fedmpi.runtime.rng, vectorised over
the whole population: the virtual times are a pure function of (seed, round, profiles,
sizes), the same for any number of ranks. Ties are broken by client id. Server work
(aggregation) is given no time.
"""

from __future__ import annotations

import math

import numpy as np

from .availability import Availability, dropout_mask
from .devices import device_profiles
from .plan import sample_clients
from .vclock_inputs import PROFILE_FIELDS, horizon, overflow, overflow_error


def sample_available(seed: int, round_: int, pool: np.ndarray, per_round: int,
                     sampling: str = "uniform", sizes: np.ndarray | None = None,
                     empty: str = "redraw") -> np.ndarray:
    """S_t among the available slots ``pool`` (ascending): ``plan.sample_clients`` over
    them, keyed by (seed, round), with the drawn indices mapped back to slots. Fewer
    available than ``per_round`` (for ``size``: fewer with data): all of them; none: an
    empty round."""
    pool = np.asarray(pool, dtype=np.int64)
    k = min(per_round, len(pool))
    sub = None
    if sampling == "size":
        sub = np.asarray(sizes)[pool]
        k = min(k, int(np.count_nonzero(sub)))
    if not k:
        return np.zeros(0, dtype=np.int64)
    return pool[sample_clients(seed, round_, len(pool), k, sampling, sizes=sub, empty=empty)]


def durations(clients: np.ndarray, steps: np.ndarray, bytes_down: float, bytes_up: float,
              profiles: dict[str, np.ndarray], step_time: float) -> np.ndarray:
    """Seconds of each client's participation (download + compute + upload), [len(clients)];
    ``steps`` the local steps of each of ``clients``."""
    p = {k: profiles[k][clients] for k in PROFILE_FIELDS}
    download = bytes_down * 8 / (p["down_mbps"] * 1e6) + p["latency"]
    upload = bytes_up * 8 / (p["up_mbps"] * 1e6) + p["latency"]
    return download + np.asarray(steps, dtype=np.float64) * step_time / p["speed"] + upload


def selection_size(policy: str, per_round: int, overselect: float, num_clients: int) -> int:
    """How many clients a round selects: S, or ceil(S (1 + e)) for over-selection."""
    if policy != "overselect":
        return per_round
    return min(num_clients, math.ceil(per_round * (1 + overselect) - 1e-9))


def schedule(clients: np.ndarray, times: np.ndarray, policy: str, per_round: int,
             deadline: float) -> tuple[np.ndarray, float]:
    """(the mask of ``clients`` the round keeps, the round's length in seconds) for
    participations of ``times`` seconds."""
    keep = np.ones(len(clients), dtype=bool)
    if not len(clients):
        return keep, 0.0
    if policy == "deadline":
        keep = times <= deadline
        return keep, float(deadline if not keep.all() else times.max())
    if policy == "overselect" and len(clients) > per_round:
        order = np.lexsort((clients, times))   # by finishing time, ties by client id
        keep = np.zeros(len(clients), dtype=bool)
        keep[order[:per_round]] = True
        return keep, float(times[order[per_round - 1]])
    return keep, float(times.max())


class VirtualClock:
    """The server's virtual time: profiles, availability, the current time, and each
    round's schedule."""

    def __init__(self, config, message_bytes: tuple[int, int], work: np.ndarray):
        """``work``: each client's units of ``step_unit`` in one epoch (its steps, or its
        samples)."""
        self.config, self.model = config, config.system_model
        self.seed = config.seed
        # one device per client identity (a dynamic population has more than clients.num)
        num = len(work)
        self.profiles = device_profiles(self.model, config.seed, num)
        self.availability = Availability(self.model, config.seed, num) \
            if self.model.availability != "always" else None
        # a participation's bytes: the FL ledger's, at the codecs' encoded sizes
        self.bytes_down, self.bytes_up = message_bytes
        # each participation's units of step_time: E epochs of steps (or samples)
        self.steps = np.asarray(work) * config.train.local_epochs
        # a later phase's steps in units of step_time (per sample: a full batch a step)
        self.steps_per_step = 1 if self.model.step_unit == "step" else config.train.batch_size
        self.per_round = config.clients.per_round
        self.now = 0.0   # seconds since the run's start, at the end of the last round
        self.step_time = self.model.step_time   # or the one measured at start-up

    @property
    def step_time(self) -> float:
        return self._step_time

    @step_time.setter
    def step_time(self, seconds: float) -> None:
        """Set with the configured, the measured or a resumed run's step time alike, each
        checked against the real devices, bytes and steps: a clock that would overflow
        (vclock_inputs.overflow) is refused before anything is written."""
        self._step_time = seconds
        trace = self.availability.trace if self.availability is not None else None
        opening = float(trace[1].max()) if trace is not None else 0.0
        hit = overflow(self.profiles, self.steps, self.bytes_down, self.bytes_up, seconds,
                       horizon(self.config), opening)
        if hit is not None:
            raise overflow_error(self.config, self.profiles, hit, self.steps, seconds,
                                 f"client {hit[0]}")

    def durations(self) -> np.ndarray:
        """Every client's seconds per participation (asynchronous FL's schedule)."""
        clients = np.arange(len(self.steps))
        return durations(clients, self.steps, self.bytes_down, self.bytes_up, self.profiles,
                         self.step_time)

    def available(self, round_: int) -> np.ndarray | None:
        """Round ``round_``'s mask of available client identities, at its start (``now``);
        None with ``availability = "always"``. A trace round that finds nobody waits for
        the next interval to open: ``now`` moves there."""
        if self.availability is None:
            return None
        mask = self.availability.mask(round_, self.now)
        if self.availability.kind == "trace" and not mask.any():
            opening = self.availability.next_opening(self.now)
            if opening is not None:
                self.now = opening
                mask = self.availability.mask(round_, self.now)
        return mask

    def round(self, clients: np.ndarray, round_: int, n_available: int) -> dict:
        """Round plan for the selected ``clients``: who is kept, their start and end times,
        the dropped count and bytes (late, not among the first S, or dropped out), and the
        clock after the round. ``n_available``: how many clients the draw had to choose
        from (recorded)."""
        times = durations(clients, self.steps[clients], self.bytes_down, self.bytes_up,
                          self.profiles, self.step_time)
        stay = np.ones(len(clients), dtype=bool)
        if self.model.dropout:   # who drops out never uploads: the policy times the others
            stay = ~dropout_mask(self.seed, round_, clients, len(self.steps), self.model.dropout)
            kept, length = schedule(clients[stay], times[stay], self.model.policy,
                                    self.per_round, self.model.deadline)
            keep = np.zeros(len(clients), dtype=bool)
            keep[stay] = kept
        else:
            keep, length = schedule(clients, times, self.model.policy, self.per_round,
                                    self.model.deadline)
        start = self.now
        self.now = start + length
        return {"clients": clients, "keep": keep, "out": ~stay, "start": start,
                "end": start + times, "now": self.now, "bytes_down": self.bytes_down,
                "n_dropped": int((~keep).sum()),
                "dropped_bytes_down": float((~keep).sum() * self.bytes_down),
                "n_available": int(n_available)}


    def later_phase(self, clients: np.ndarray, steps: np.ndarray, bytes_down: float,
                    bytes_up: float) -> tuple[float, np.ndarray]:
        """A later phase of the round (FNR-FL's refinement): its participants start when
        the phase before has ended and the round waits for all of them (the server chose
        them); ``steps``: the steps each ran. Returns (its start, each one's end)."""
        start = self.now
        times = durations(clients, steps, bytes_down, bytes_up, self.profiles, self.step_time)
        self.now = start + (float(times.max()) if len(times) else 0.0)
        return start, start + times


ROUND_FIELDS = ["virtual_time", "n_dropped", "dropped_bytes_down", "n_available"]
CLIENT_FIELDS = ["vt_start", "vt_end", "dropped"]
KEPT, LATE, DROPPED_OUT = 0, 1, 2   # /clients "dropped": why a selected client did not count


def virtual_columns(plan: dict, clients: dict, clock: VirtualClock | None = None,
                    later: list | None = None) -> dict[str, float]:
    """The round's /rounds values of ``plan`` (``VirtualClock.round``); adds the kept
    clients' start and end times to ``clients``, the round's /clients columns (ascending
    client id, as the kept clients are). ``later``: (rows, bytes down, bytes up) of each
    later phase, timed by ``clock`` after the first (their rows get their times too)."""
    ends = plan["end"][plan["keep"]]
    clients["vt_start"] = np.full(len(ends), plan["start"])
    clients["vt_end"] = ends
    clients["dropped"] = np.full(len(ends), KEPT)
    for rows, down, up in later or []:
        unit = clock.steps_per_step
        start, rows["vt_end"] = clock.later_phase(rows["client"].astype(np.int64),
                                                  rows["steps"] * unit, down, up)
        rows["vt_start"] = np.full(len(rows["client"]), start)
        rows["dropped"] = np.full(len(rows["client"]), KEPT)
        plan["now"] = clock.now
    return {"virtual_time": plan["now"], "n_dropped": plan["n_dropped"],
            "dropped_bytes_down": plan["dropped_bytes_down"], "n_available": plan["n_available"]}


def dropped_rows(plan: dict, sizes: np.ndarray) -> dict[str, np.ndarray] | None:
    """/clients rows of the round's selected clients that did not count (``plan``:
    ``VirtualClock.round``), ascending client id, or None: ``dropped`` says why (LATE:
    past the deadline or not among the first S to finish; DROPPED_OUT: mid-round
    dropout). Each downloaded the payload and uploaded nothing; ``vt_end`` is when a late
    one would have finished (NaN for a drop-out); nothing of its training is known."""
    gone = ~plan["keep"]
    if not gone.any():
        return None
    c = plan["clients"][gone]
    out = plan["out"][gone]
    n = len(c)
    return {"phase": np.zeros(n, dtype=np.int64), "client": c.astype(np.int64),
            "rank": np.full(n, -1, dtype=np.int64), "n_samples": sizes[c].astype(np.int64),
            "steps": np.zeros(n, dtype=np.int64),
            "bytes_down": np.full(n, int(plan["bytes_down"]), dtype=np.int64),
            "bytes_up": np.zeros(n, dtype=np.int64), "vt_start": np.full(n, plan["start"]),
            "vt_end": np.where(out, np.nan, plan["end"][gone]),
            "dropped": np.where(out, DROPPED_OUT, LATE)}
