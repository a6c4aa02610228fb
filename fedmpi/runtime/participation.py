"""The participation stage: who trains in a server step, on which model version.

One of three, chosen at setup by ``participation`` (the server's; a worker only trains whom
the server names, so it holds a plain ``Sync``):

- ``Sync``: S_t drawn by ``clients.sampling`` (fedmpi.runtime.plan); every client drawn
  trains on the current model;
- ``Clocked`` (``[system_model]`` on, a synchronous policy): the draw among the clients
  available in round t, then the virtual clock (fedmpi.runtime.vclock) keeps those its
  round policy lets finish; the round's clock columns and the rows of the clients that
  did not count go into the file;
- ``Async`` (``policy = "fedasync"`` or ``"fedbuff"``, fedmpi.runtime.asyncfl): a round is
  one server step: the clients that arrive for it, each trained on the model version it
  downloaded; FedAsync's mix replaces the server update, and the versions still in flight
  are part of a checkpoint.

Each declares its /rounds and /clients fields, its provenance, what it keeps in a
checkpoint (``state_dict``/``restore``) and what a resume must find unchanged (``resume``),
so the results file and the checkpoint are assembled from the stage present.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from .. import algorithms
from ..algorithms import local_sgd
from ..algorithms.base import fedavg_server_side
from ..config.coerce import field_error
from ..errors import UsageError
from . import asyncfl, vclock_inputs
from .asyncfl import AsyncServer, Versions
from .plan import sample_clients
from .system import numerics
from .vclock import (CLIENT_FIELDS, ROUND_FIELDS, VirtualClock, dropped_rows, sample_available,
                     selection_size, virtual_columns)


class Sync:
    """S_t: slots drawn by ``clients.sampling`` (size: weighted by the sample counts of the
    clients that hold the slots in round t), then the identities in those slots."""
    clock = None
    round_fields: list[str] = []
    client_fields: list[str] = []

    def __init__(self, config, split, sizes: np.ndarray):
        self.config, self.split, self.sizes = config, split, sizes
        self._training = None   # clients.holdout: the slots that may train (training_slots)

    @classmethod
    def refuse(cls, config) -> None:
        """Config time: raise a one-line UsageError, naming the field, for what this stage
        cannot run."""

    def per_round(self) -> int:
        return self.config.clients.per_round

    def training_slots(self) -> np.ndarray:
        """clients.holdout: the slots that may train (computed once)."""
        if self._training is None:
            self._training = np.setdiff1d(np.arange(self.config.clients.num), self.split.holdout)
        return self._training

    def pool(self, t: int) -> np.ndarray | None:
        """The slots that may be drawn in round t, or None: all of them."""
        return None

    def select(self, t: int, state) -> np.ndarray:
        """Server: the clients that train in step t (ascending id)."""
        cfg, c = self.config, self.config.clients
        sizes = self.sizes[self.split.active(t)] if c.sampling == "size" else None
        pool = self.pool(t)
        if self.split.holdout is not None:   # clients.holdout: never drawn for training
            pool = self.training_slots() if pool is None else \
                np.setdiff1d(pool, self.split.holdout, assume_unique=True)
        if pool is None:
            slots = sample_clients(cfg.seed, t, c.num, self.per_round(), c.sampling, sizes=sizes,
                                   empty=c.empty_rounds)
            n_available = c.num
        else:
            slots = sample_available(cfg.seed, t, pool, self.per_round(), c.sampling, sizes=sizes,
                                     empty=c.empty_rounds)
            n_available = len(pool)
        sampled = self.split.sample(slots, t)
        if not self.sizes[sampled].any():
            # every client drawn holds no training sample (partition.min_size = 0): none can
            # train, and a mean weighted by their sample counts is 0/0. The round trains
            # nobody, as an empty draw that is skipped (clients.empty_rounds = "skip").
            sampled = sampled[:0]
        return self.keep(sampled, t, n_available)

    def keep(self, sampled: np.ndarray, t: int, n_available: int) -> np.ndarray:
        """Of the clients drawn, those that train."""
        return sampled

    def versions(self, state) -> Versions | None:
        """The model versions the step's clients train on (None: the current one)."""
        return None

    def record(self, rows: list[dict]) -> tuple[dict, list[dict]]:
        """Server, after the step: its /rounds columns (and columns added to the first
        phase's client ``rows``), and extra /clients rows."""
        return {}, []

    def start_columns(self) -> dict:
        """The /rounds columns of round 0 (the initial model's evaluation)."""
        return {}

    def describe(self) -> tuple[dict, dict]:
        """(provenance attributes, /partition datasets) of a new results file."""
        return {}, {}

    def begin(self, start: int) -> None:
        """Every rank, after setup: the run goes on from ``start`` completed steps."""

    def resume(self, path, start: int, rounds: dict, attrs: dict, stored: dict) -> None:
        """Server, resuming: what the file's run fixed (checked or taken over)."""

    def state_dict(self) -> dict[str, np.ndarray]:
        """What a checkpoint keeps besides the algorithm's server state."""
        return {}

    def restore(self, saved: dict[str, np.ndarray]) -> None:
        """A checkpoint's ``state_dict`` back (``saved``: its keys that were there)."""


class Clocked(Sync):
    """A synchronous round on the virtual clock: the draw among the available clients
    (``system_model.availability``; all of them when fewer than needed are), of the size
    the round policy selects, then who finishes in time (and does not drop out)."""
    round_fields = ROUND_FIELDS
    client_fields = CLIENT_FIELDS

    def __init__(self, config, split, sizes, clock: VirtualClock, message_bytes, phases):
        super().__init__(config, split, sizes)
        self.clock, self.message_bytes, self.phases = clock, message_bytes, phases
        self.plan = None   # the clock's plan of the current round

    def per_round(self) -> int:
        m, c = self.config.system_model, self.config.clients
        return selection_size(m.policy, c.per_round, m.overselect, c.num)

    def pool(self, t):
        available = self.clock.available(t)
        return None if available is None else np.flatnonzero(available[self.split.active(t)])

    def keep(self, sampled, t, n_available):
        self.plan = self.clock.round(sampled, t, n_available)
        return sampled[self.plan["keep"]]

    def record(self, rows):
        later = [(r, *self.message_bytes(phase)) for r, phase in zip(rows[1:], self.phases[1:])]
        columns = virtual_columns(self.plan, rows[0], self.clock, later)
        dropped = dropped_rows(self.plan, self.sizes)
        return columns, [] if dropped is None else [dropped]

    def start_columns(self):   # the clock starts with the run; nobody is sampled in round 0
        return dict(virtual_time=0.0, n_dropped=0, dropped_bytes_down=0.0, n_available=math.nan)

    def describe(self):
        provenance = dict(step_time=self.clock.step_time,
                          step_time_measured=bool(self.config.system_model.measure_step_time),
                          **vclock_inputs.input_digests(self.config, self.clock))
        return provenance, {f"device_{k}": v for k, v in self.clock.profiles.items()}

    def resume(self, path, start, rounds, attrs, stored):
        if start:   # the virtual time the checkpoint's round ended at
            self.clock.now = float(rounds["virtual_time"][rounds["round"] == start][-1])
        if "step_time" in attrs:   # a measured one is the file's
            self.clock.step_time = float(attrs["step_time"])
        # the devices and the trace a resume reads must be the run's
        changed = vclock_inputs.input_changes(self.config, self.clock, stored, attrs)
        if changed:
            raise UsageError(f"--resume {path}: the virtual clock's inputs differ from the run's "
                             f"({'; '.join(changed)})")


class Async(Clocked):
    """FedAsync and FedBuff: a step's clients are those that arrive for it
    (fedmpi.runtime.asyncfl), each on the model version it downloaded."""
    client_fields = CLIENT_FIELDS + asyncfl.CLIENT_FIELDS
    @classmethod
    def serves(cls, name: str) -> bool:
        """Whether algorithm ``name``'s server side is FedAvg's, which the asynchronous step
        replaces (the method's local update stays its own; private layers stay on the
        clients, and each version's payload is compacted to the shared coordinates)."""
        return fedavg_server_side(algorithms.REGISTRY[name])

    @classmethod
    def refuse(cls, c) -> None:
        """Config time: C in-flight clients of the population, K <= C, alpha in (0, 1],
        uniform sampling of a static population, every client always available and none
        dropping out, and a method it can serve; else a one-line error naming the field."""
        m, policy = c.system_model, f"system_model.policy {c.system_model.policy!r}"
        if m.availability != "always":
            raise field_error("system_model.availability", f"{policy} draws from the whole idle "
                                                           f"population; availability is for the "
                                                           f"synchronous policies: set \"always\"")
        if m.dropout:
            raise field_error("system_model.dropout", f"{policy} has no mid-round dropout (a "
                                                      f"synchronous policies' setting); set 0")
        C = asyncfl.concurrency(c)
        if C > c.clients.num:
            raise field_error("system_model.concurrency", f"{C} clients in flight, but "
                                                          f"clients.num is {c.clients.num}")
        if m.buffer > C:
            raise field_error("system_model.buffer", f"must be <= system_model.concurrency (the "
                                                     f"{C} clients in flight), got {m.buffer}")
        if not 0 < m.mixing <= 1:
            raise field_error("system_model.mixing", f"must be in (0, 1], got {m.mixing}")
        if c.clients.sampling != "uniform":
            raise field_error("clients.sampling", f"{policy} draws each new client uniformly "
                                                  f"from the idle ones; set \"uniform\"")
        if c.clients.replace_prob:
            raise field_error("clients.replace_prob", f"{policy} runs on a static population; "
                                                      f"set 0")
        if not cls.serves(c.algorithm.name):
            able = sorted(n for n in algorithms.REGISTRY if cls.serves(n))
            raise field_error("system_model.policy", f"asynchronous FL serves methods with "
                                                     f"FedAvg's server side; {c.algorithm.name!r} "
                                                     f"has its own; use one of {', '.join(able)}")

    def __init__(self, config, split, sizes, clock, message_bytes, phases):
        super().__init__(config, split, sizes, clock, message_bytes, phases)
        self.server = AsyncServer(config, clock)

    def select(self, t, state):
        return self.server.step(state["x"])

    def versions(self, state):
        return self.server.versions(state)

    def record(self, rows):
        columns = self.server.columns(rows[0])
        self.server.done()
        return columns, []

    def begin(self, start):
        self.server.replay(start)

    def state_dict(self):   # the model versions its clients in flight train on
        return self.server.state_dict()

    def restore(self, saved):
        if len(saved) < len(asyncfl.STATE_KEYS):
            raise UsageError(f"checkpoint lacks the model versions of the clients in flight "
                             f"(system_model.policy {self.config.system_model.policy!r})")
        self.server.load_state_dict(saved)


STATE_KEYS = asyncfl.STATE_KEYS   # a checkpoint's server entries that are participation state


def stage(config) -> type[Sync]:
    """The participation stage ``config`` asks for."""
    m = config.system_model
    if m.profiles == "off":
        return Sync
    return Async if m.policy in asyncfl.MODES else Clocked


def refuse(config) -> None:
    """Config time: a one-line UsageError for what the config's participation stage cannot
    run (``Sync`` and ``Clocked`` refuse nothing of their own; the clock's settings are
    checked with [system_model], fedmpi.config.validate_system)."""
    stage(config).refuse(config)


def participation(exp, measured: float | None) -> Sync:
    """The run's participation stage on this rank. ``measured``: the seconds of a local
    step ``measure_step_time`` found (server), or None."""
    cfg, m, kind = exp.config, exp.config.system_model, stage(exp.config)
    if not exp.comm.is_server or kind is Sync:
        return Sync(cfg, exp.split, exp.sizes)
    codecs, d = exp.codecs, exp.wire
    clock = VirtualClock(cfg, codecs.message_bytes(d, exp.alg.phases[0]),
                         exp.sizes if m.step_unit == "sample" else exp.steps)
    if measured is not None:
        clock.step_time = measured
    return kind(cfg, exp.split, exp.sizes, clock, lambda phase: codecs.message_bytes(d, phase),
                exp.alg.phases)


def measure_step_time(exp, context) -> float | None:
    """``system_model.measure_step_time``: seconds a local step (or a sample, by
    ``step_unit``) of this model and batch size takes on the first worker's device, from
    the client of median size: one local update to warm up, then one timed. The server's
    value, None elsewhere. ``context(t, phase, participants)``: a round's context."""
    cfg, comm = exp.config, exp.comm
    seconds = None
    if comm.is_worker and comm.worker_index == 0:
        c = int(np.argsort(exp.steps, kind="stable")[len(exp.steps) // 2])
        ctx = context(0, exp.alg.phases[0], [c])
        x = exp.flat.params.detach().clone()
        with numerics(exp.device, cfg.system.precision, cfg.system.deterministic):
            for _ in range(2):   # the first warms up; the second's time is kept
                if exp.device.type == "cuda":
                    torch.cuda.synchronize(exp.device)
                t0 = time.perf_counter()
                upload = local_sgd.local_update(exp.task(c, ctx, 0), x, ctx)
                if exp.device.type == "cuda":
                    torch.cuda.synchronize(exp.device)
                units = upload.steps if cfg.system_model.step_unit == "step" else \
                    upload.num_samples * cfg.train.local_epochs
                seconds = (time.perf_counter() - t0) / max(units, 1)
        exp.flat.load(x)
    measured = [s for s in comm.gather_obj(seconds, count=False) or [] if s is not None]
    return measured[0] if comm.is_server else None
