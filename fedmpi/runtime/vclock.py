"""The virtual clock: how long a round would take on the simulated deployment.

With ``[system_model]`` on, every client has a device profile, drawn once from the seed
(``profiles``): a speed multiplier of the reference step time and a downlink and uplink
bandwidth (lognormal around the configured medians), plus a fixed latency. A client's
participation then takes, from the round's start,

    download = bytes_down * 8 / downlink + latency
    compute  = local steps * step_time / speed
    upload   = bytes_up * 8 / uplink + latency

with the bytes of the exact FL ledger (what the algorithm declares it sends) and the
local steps its data gives (E ceil(n_i / B)). All of it is known before anyone trains,
so the server decides who finishes in time at sampling (``schedule``), and the clients
that would not are not trained at all: their work would be wasted, and the file says
how many they were. Round policies (``system_model.policy``):

- ``wait_all``: the round ends when its last client has uploaded;
- ``deadline``: the round ends at the deadline; clients that would finish later are
  dropped (the round ends earlier when everyone is done before it);
- ``overselect`` (Bonawitz et al., "Towards Federated Learning at Scale", 2019): S (1 + e)
  clients are selected (rounded up) and the first S to finish are kept; the round ends
  with the S-th.

Ties are broken by client id. The virtual times are a pure function of (seed, round,
profiles, sizes): the same for any number of ranks. Server work (aggregation) is given
no time.
"""

from __future__ import annotations

import math

import numpy as np

from .rng import numpy_rng

PROFILES = ("off", "lognormal")
POLICIES = ("wait_all", "deadline", "overselect", "fedasync", "fedbuff")
PROFILE_FIELDS = ("speed", "down_mbps", "up_mbps", "latency")


def draw_profiles(seed: int, num_clients: int, model) -> dict[str, np.ndarray]:
    """Every client's device (``model``: the SystemModelConfig), keyed by the seed alone:
    speed ~ exp(N(0, speed_sigma)) (median 1), each bandwidth the configured median times
    exp(N(0, bandwidth_sigma)), latency the configured one."""
    rng = numpy_rng(seed, "device-profiles")
    speed = np.exp(model.speed_sigma * rng.standard_normal(num_clients))
    down = model.down_mbps * np.exp(model.bandwidth_sigma * rng.standard_normal(num_clients))
    up = model.up_mbps * np.exp(model.bandwidth_sigma * rng.standard_normal(num_clients))
    return {"speed": speed, "down_mbps": down, "up_mbps": up,
            "latency": np.full(num_clients, float(model.latency))}


def durations(clients: np.ndarray, steps: np.ndarray, bytes_down: float, bytes_up: float,
              profiles: dict[str, np.ndarray], step_time: float) -> np.ndarray:
    """Seconds of each client's participation (download + compute + upload), [len(clients)];
    ``steps`` the local steps of each of ``clients``."""
    p = {k: v[clients] for k, v in profiles.items()}
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
    """The server's virtual time: profiles, the current time, and each round's schedule."""

    def __init__(self, config, alg, d: int, wire_bytes: int, steps: np.ndarray):
        self.model = config.system_model
        # one device per client identity (a dynamic population has more than clients.num)
        self.profiles = draw_profiles(config.seed, len(steps), self.model)
        down, up = alg.traffic(d, alg.phases[0])
        self.bytes_down, self.bytes_up = down * wire_bytes, up * wire_bytes
        self.steps = np.asarray(steps) * config.train.local_epochs   # local steps per client
        self.per_round = config.clients.per_round
        self.now = 0.0   # seconds since the run's start, at the end of the last round

    def durations(self) -> np.ndarray:
        """Every client's seconds per participation (asynchronous FL's schedule)."""
        clients = np.arange(len(self.steps))
        return durations(clients, self.steps, self.bytes_down, self.bytes_up, self.profiles,
                         self.model.step_time)

    def round(self, clients: np.ndarray) -> dict:
        """Round plan for the selected ``clients``: who is kept, their start and end times,
        the dropped count and bytes, and the clock after the round."""
        times = durations(clients, self.steps[clients], self.bytes_down, self.bytes_up,
                          self.profiles, self.model.step_time)
        keep, length = schedule(clients, times, self.model.policy, self.per_round,
                                self.model.deadline)
        start = self.now
        self.now = start + length
        return {"keep": keep, "start": start, "end": start + times, "now": self.now,
                "n_dropped": int((~keep).sum()),
                "dropped_bytes_down": float((~keep).sum() * self.bytes_down)}


ROUND_FIELDS = ["virtual_time", "n_dropped", "dropped_bytes_down"]
CLIENT_FIELDS = ["vt_start", "vt_end"]


def virtual_columns(plan: dict, clients: dict) -> dict[str, float]:
    """The round's /rounds values of ``plan`` (``VirtualClock.round``); adds the kept
    clients' start and end times to ``clients``, the round's /clients columns (ascending
    client id, as the kept clients are)."""
    ends = plan["end"][plan["keep"]]
    clients["vt_start"] = np.full(len(ends), plan["start"])
    clients["vt_end"] = ends
    return {"virtual_time": plan["now"], "n_dropped": plan["n_dropped"],
            "dropped_bytes_down": plan["dropped_bytes_down"]}
