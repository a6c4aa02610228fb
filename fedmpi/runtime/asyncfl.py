"""Asynchronous FL on the virtual clock: FedAsync and FedBuff.

``system_model.policy = "fedasync"`` (Xie et al., "Asynchronous Federated Optimization",
2019) or ``"fedbuff"`` (Nguyen et al., "Federated Learning with Buffered Asynchronous
Aggregation", AISTATS 2022). C clients (``system_model.concurrency``) are always in
flight. Each downloads the model version current when it starts, trains on it, and
arrives ``vclock.durations`` seconds later; a new client starts in its place. The server
applies the updates in virtual arrival order (ties by client id):

- FedBuff: arrivals wait in a buffer; the K-th (``system_model.buffer``) triggers one
  server step, x <- x + eta_g sum_i s(tau_i) n_i Delta_i / sum_i n_i: the method's own
  sample-weighted aggregation with each update scaled by its staleness weight;
- FedAsync: each arrival is one server step, x <- (1 - a) x + a (x_v + Delta) with
  a = alpha s(tau) (``system_model.mixing``): the client's model mixed into the current
  one (``torch.lerp``, exact at a = 1).

tau is the number of server steps since the client's download; s(tau) is 1
(``staleness = "constant"``) or (1 + tau)^-e (``"polynomial"``, e =
``staleness_exponent``; 0.5 is FedBuff's 1/sqrt(1 + tau)). A row of /rounds is one server
step (a model version), so ``rounds`` counts server steps.

The schedule is the server's, a pure function of (seed, profiles, sizes): it hands the
workers, each step, the clients that arrive with the model version each trained on, so
the results are the same for any number of ranks. A client that arrived waits, idle, until
its buffer is applied, so a step never holds a client twice. New clients are drawn
uniformly from the idle ones by ``plan.sample_clients`` keyed by a start counter: with
equal durations, K = C = S and nothing left in flight, start b draws exactly round b's S_t,
so FedBuff then is synchronous FedAvg, bit for bit. Clients arriving at one instant are
all taken before anyone starts: those who start after a step download its result.

A client's data stream is keyed by its start (the round key of its training), its round
lr by the model version it trains on. Clients still in flight when the run ends are not in
the ledger (their download happened, but nothing of theirs is aggregated).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..errors import UsageError
from .plan import sample_clients

from ..config.vocab import ASYNC_MODES as MODES  # noqa: F401 (re-exported)
STATE_KEYS = ("async_versions", "async_version_ids")   # what a checkpoint keeps (state_dict)
CLIENT_FIELDS = ["staleness"]


def staleness_weight(kind: str, tau: int, exponent: float) -> float:
    """s(tau): 1, or (1 + tau)^-exponent."""
    return 1.0 if kind == "constant" or tau == 0 else float((1.0 + tau) ** -exponent)


@dataclass
class Versions:
    """What ``Phases.run`` needs for a phase whose clients train on model versions of
    their own. ``states``: version -> a server state to build that version's payload
    from (server only); ``of``: client -> (version, scale of its delta's contribution,
    the round key of its data); ``update``: the server update that replaces the
    method's, or None."""
    states: dict
    of: dict
    update: Callable | None = None


@dataclass(frozen=True)
class Arrival:
    client: int
    version: int     # the model version it downloaded (server steps before its start)
    start_key: int   # which start it was: the round key of its data stream
    start: float     # virtual seconds at its download
    end: float       # ... and at its arrival


class AsyncSchedule:
    """Who is in flight, on which version, and who arrives next: the server's event
    queue. ``durations[c]``: client c's seconds per participation (fixed by its profile
    and its data)."""

    def __init__(self, seed: int, durations: np.ndarray, concurrency: int, buffer: int,
                 able: np.ndarray | None = None):
        self.seed, self.durations = seed, np.asarray(durations, dtype=np.float64)
        self.concurrency, self.buffer = concurrency, buffer
        self.busy = np.zeros(len(durations), dtype=bool)   # in flight or in the buffer
        # who can train at all: a client without training samples (partition.min_size =
        # 0) has no update to send, and its weight n_i = 0 would make a step's mean 0/0
        self.able = np.ones(len(durations), dtype=bool) if able is None else np.asarray(able)
        self.flight: list[tuple[float, int, int, int, float]] = []   # (end, c, v, key, start)
        self.version = 0    # server steps applied
        self.starts = 0     # start instants so far (the sampling key)
        self.now = 0.0      # virtual seconds at the last server step
        self.pending = 0    # freed slots no idle client could take yet

    def _start(self, t: float) -> None:
        idle = np.flatnonzero(~self.busy & self.able)
        m = min(self.pending, len(idle))
        if not m:
            return
        for c in idle[sample_clients(self.seed, self.starts, len(idle), m)].tolist():
            heapq.heappush(self.flight, (t + self.durations[c], c, self.version, self.starts, t))
            self.busy[c] = True
        self.pending -= m
        self.starts += 1

    def step(self) -> list[Arrival]:
        """The arrivals of the next server step (ascending client id), and the clients
        that start after it; ``version`` and ``now`` then describe the step."""
        if not self.starts and not self.flight:
            self.pending = self.concurrency
            self._start(0.0)
        arrivals = []
        while len(arrivals) < self.buffer:
            end, c, v, key, start = heapq.heappop(self.flight)
            arrivals.append(Arrival(c, v, key, start, end))
            self.pending += 1
            if len(arrivals) < self.buffer and (not self.flight or self.flight[0][0] > end):
                self._start(end)   # the instant is over and the buffer still waits
        self.now = arrivals[-1].end
        self.version += 1
        self.busy[[a.client for a in arrivals]] = False
        self._start(self.now)
        return sorted(arrivals, key=lambda a: a.client)

    def versions_in_flight(self) -> set[int]:
        return {v for _, _, v, _, _ in self.flight}


class AsyncServer:
    """The server's half of asynchronous FL: the schedule, the model versions its clients
    in flight train on, and each step's ``Versions`` for the phase (fedmpi.runtime.phase).
    ``clock``: the ``VirtualClock`` whose participation times the schedule follows."""

    def __init__(self, config, clock):
        m = config.system_model
        self.mode, self.kind, self.exponent, self.mixing = \
            m.policy, m.staleness, m.staleness_exponent, m.mixing
        self.seed, self.clock, self.concurrency = config.seed, clock, concurrency(config)
        self.buffer = 1 if m.policy == "fedasync" else m.buffer or self.concurrency
        able = int(np.count_nonzero(clock.steps))
        if self.concurrency > able:
            raise UsageError(f"config field system_model.concurrency: {self.concurrency} clients "
                             f"in flight, but only {able} of the {len(clock.steps)} clients hold "
                             f"training samples (partition.min_size = 0 leaves the others empty)")
        self.schedule: AsyncSchedule | None = None   # built by ``replay``
        self.models: dict[int, torch.Tensor] = {}   # version -> x, for the clients in flight
        self.arrivals: list[Arrival] = []

    def replay(self, steps: int) -> None:
        """The schedule after ``steps`` server steps (0: a fresh run; a resume replays, as
        the schedule is a pure function of the seed and the clock's times, which a resume
        may have set from the file)."""
        self.schedule = AsyncSchedule(self.seed, self.clock.durations(), self.concurrency,
                                      self.buffer, able=self.clock.steps > 0)
        for _ in range(steps):
            self.schedule.step()

    def step(self, x: torch.Tensor) -> np.ndarray:
        """The next server step's arrivals (ascending client id) from the current model x."""
        self.models.setdefault(self.schedule.version, x.clone())
        self.arrivals = self.schedule.step()
        return np.array([a.client for a in self.arrivals], dtype=np.int64)

    def staleness(self, a: Arrival) -> int:
        return self.schedule.version - 1 - a.version

    def versions(self, state) -> Versions:
        of = {a.client: (a.version, 1.0 if self.mode == "fedasync" else
                         staleness_weight(self.kind, self.staleness(a), self.exponent),
                         a.start_key) for a in self.arrivals}
        states = {v: {**state, "x": self.models[v]} for v in {a.version for a in self.arrivals}}
        return Versions(states, of, self.mix if self.mode == "fedasync" else None)

    def mix(self, state, sums, gathered, ctx) -> None:
        """FedAsync: x <- lerp(x, x_v + Delta, alpha s(tau)), one arrival."""
        (a,) = self.arrivals
        delta = sums["delta"] / float(sums["weight"])
        weight = self.mixing * staleness_weight(self.kind, self.staleness(a), self.exponent)
        state["x"].lerp_(self.models[a.version] + delta, weight)

    def done(self) -> None:
        """After the step's update: forget the versions nobody in flight trains on."""
        keep = self.schedule.versions_in_flight()
        self.models = {v: x for v, x in self.models.items() if v in keep}

    def columns(self, clients: dict) -> dict[str, float]:
        """The step's /rounds clock values; adds the arrivals' start and end times and
        staleness to ``clients`` (its /clients columns, ascending client id)."""
        clients["vt_start"] = np.array([a.start for a in self.arrivals])
        clients["vt_end"] = np.array([a.end for a in self.arrivals])
        clients["staleness"] = np.array([self.staleness(a) for a in self.arrivals], dtype=np.float64)
        clients["dropped"] = np.zeros(len(self.arrivals), dtype=np.int64)
        return {"virtual_time": self.schedule.now, "n_dropped": 0, "dropped_bytes_down": 0.0}

    def state_dict(self) -> dict[str, np.ndarray]:
        """What a checkpoint keeps: the versions in flight (the schedule is replayed)."""
        ids = sorted(self.models)
        stacked = np.stack([self.models[v].numpy() for v in ids]) if ids else np.zeros((0, 0), np.float32)
        return dict(zip(STATE_KEYS, (stacked, np.array(ids, dtype=np.int64))))

    def load_state_dict(self, saved: dict) -> None:
        versions, ids = (saved[k] for k in STATE_KEYS)
        self.models = {int(v): torch.from_numpy(np.array(x)) for v, x in zip(ids, versions)}


def concurrency(config) -> int:
    """C: ``system_model.concurrency``, or clients.per_round where 0."""
    return config.system_model.concurrency or config.clients.per_round
