"""Who can take part in a round: availability (``system_model.availability``,
synchronous policies only) and mid-round dropout (``system_model.dropout``), as masks
over the client identities keyed by (seed, round, client) through fedmpi.runtime.rng.

The server samples S_t among the clients available in round t only
(``vclock.sample_available``). A client is available in round t

- ``always``: always (the default; the run is the same as without the field);
- ``bernoulli``: with probability ``availability_p``, independently per round;
- ``markov``: when its two-state on/off chain is on; the chain starts from its stationary
  distribution and steps once a round (on -> off with ``p_on_off``, off -> on with
  ``p_off_on``); the state is the clock's, replayed from round 0 on resume;
- ``diurnal``: with probability clip(base + amplitude sin(2 pi (h + phase_c) / 24), 0, 1)
  (``diurnal_base``, ``diurnal_amplitude``), h the round's start in virtual hours and
  phase_c a per-client offset, uniform in [0, 24) hours, drawn from the seed;
- ``trace``: when the round's start virtual time t0 lies in one of its intervals
  start <= t0 < end of ``availability_file`` (rows client, start, end in virtual seconds;
  a client without rows never is). A round whose start finds nobody available starts
  when the next interval opens (the server waits, idle); after the last one, rounds are
  empty.

Mid-round dropout: each selected client drops out during its participation with
probability ``dropout``; it downloaded but never uploads, so it is decided at sampling,
not trained, and counted with the dropped clients (as the deadline's late ones).
"""

from __future__ import annotations

import numpy as np

from ..config.vocab import AVAILABILITY
from .rng import numpy_rng
from .vclock_inputs import read_trace


def bernoulli_mask(seed: int, round_: int, num_clients: int, p: float) -> np.ndarray:
    """Each client available with probability ``p``, independently in every round."""
    return numpy_rng(seed, "availability", round_).random(num_clients) < p


def markov_stationary(p_on_off: float, p_off_on: float) -> float:
    """The on/off chain's long-run share of rounds on."""
    return p_off_on / (p_on_off + p_off_on)


def markov_mask(seed: int, round_: int, num_clients: int, p_on_off: float, p_off_on: float,
                state: np.ndarray | None = None, since: int = -1) -> np.ndarray:
    """Every client's on/off state in round ``round_``: drawn from the stationary
    distribution in round 0, then one step a round (round r's uniforms keyed by r). From
    ``state``, the state of round ``since`` < ``round_``, only the rounds after it are
    stepped; without it, all from round 0 (resume replays them: a pure function)."""
    if state is None or since > round_ or since < 0:
        state = numpy_rng(seed, "availability-markov", 0).random(num_clients) \
            < markov_stationary(p_on_off, p_off_on)
        since = 0
    for r in range(since + 1, round_ + 1):
        u = numpy_rng(seed, "availability-markov", r).random(num_clients)
        state = np.where(state, u >= p_on_off, u < p_off_on)
    return state


def diurnal_phases(seed: int, num_clients: int) -> np.ndarray:
    """Each client's offset of the day, hours, uniform in [0, 24)."""
    return numpy_rng(seed, "availability-phase").uniform(0.0, 24.0, num_clients)


def diurnal_probability(phases: np.ndarray, now: float, base: float,
                        amplitude: float) -> np.ndarray:
    """clip(base + amplitude sin(2 pi (now / 3600 + phase) / 24), 0, 1) for every client."""
    hours = now / 3600.0 + phases
    return np.clip(base + amplitude * np.sin(2 * np.pi * hours / 24.0), 0.0, 1.0)


def diurnal_mask(seed: int, round_: int, phases: np.ndarray, now: float, base: float,
                 amplitude: float) -> np.ndarray:
    p = diurnal_probability(phases, now, base, amplitude)
    return numpy_rng(seed, "availability", round_).random(len(phases)) < p


def trace_mask(trace, num_clients: int, now: float) -> np.ndarray:
    """The clients with an interval start <= now < end."""
    client, start, end = trace
    mask = np.zeros(num_clients, dtype=bool)
    mask[client[(start <= now) & (now < end)]] = True
    return mask


def dropout_mask(seed: int, round_: int, clients: np.ndarray, num_clients: int,
                 p: float) -> np.ndarray:
    """Which of the selected ``clients`` drop out in round ``round_`` (probability ``p``
    each; client c's draw is the c-th of the round's stream, whoever else is selected)."""
    return numpy_rng(seed, "dropout", round_).random(num_clients)[np.asarray(clients)] < p


class Availability:
    """Who can be sampled: round t's mask over the client identities (``model``: the
    SystemModelConfig; ``availability`` other than "always"; ``trace``: (client, start,
    end) arrays instead of ``availability_file``'s). Keeps the Markov chain's state of the
    last round asked for (any other round is replayed from round 0)."""

    def __init__(self, model, seed: int, num_clients: int, trace=None):
        self.model, self.seed, self.num_clients = model, seed, num_clients
        self.kind = model.availability
        self.phases = diurnal_phases(seed, num_clients) if self.kind == "diurnal" else None
        if self.kind == "trace" and trace is None:
            trace = read_trace(model.availability_file, num_clients)
        self.trace = trace
        self._markov = (None, -1)   # (state, round)

    def mask(self, round_: int, now: float) -> np.ndarray:
        """Round ``round_``'s available clients; ``now``: its start, virtual seconds."""
        m, n = self.model, self.num_clients
        if self.kind == "bernoulli":
            return bernoulli_mask(self.seed, round_, n, m.availability_p)
        if self.kind == "markov":
            state, since = self._markov
            state = markov_mask(self.seed, round_, n, m.p_on_off, m.p_off_on, state, since)
            self._markov = (state, round_)
            return state
        if self.kind == "diurnal":
            return diurnal_mask(self.seed, round_, self.phases, now, m.diurnal_base,
                                m.diurnal_amplitude)
        if self.kind == "trace":
            return trace_mask(self.trace, n, now)
        raise ValueError(f"availability {self.kind!r}: choose from {AVAILABILITY}")

    def next_opening(self, now: float) -> float | None:
        """trace: the first interval start after ``now`` (None: there is none)."""
        start = self.trace[1]
        later = start[start > now]
        return float(later.min()) if len(later) else None
