"""What a round measures: its timers, its FL traffic, each rank's stats, and the rows
that go into the results file (/rounds, /ranks, /clients)."""

from __future__ import annotations

import math
import time
from dataclasses import astuple, dataclass

import numpy as np
import torch

from .. import signals
from ..algorithms import schedule

ROUND_FIELDS = ["round", "time_wall", "time_compute", "time_compute_min", "time_comm",
                "time_idle", "time_aggregate", "time_eval", "lr", "train_loss", "test_loss",
                "test_acc", "fl_bytes_down", "fl_bytes_up", "mpi_bytes", "n_participants",
                "update_norm", "client_update_norm_mean", "client_update_cosine_mean",
                "local_consistency"]
CLIENT_FIELDS = ["round", "phase", "client", "rank", "n_samples", "steps", "train_loss",
                 "update_norm", "seconds", "bytes_down", "bytes_up"]
RANK_FIELDS = ["round", "rank", "bytes_sent", "bytes_received", "seconds_compute",
               "seconds_idle", "seconds_comm"]


@dataclass
class Timers:
    """Seconds this rank spent in a round, by kind (evaluation inside training is eval)."""
    compute: float = 0.0
    aggregate: float = 0.0
    eval: float = 0.0


@dataclass
class Traffic:
    """The round's FL bytes (what the algorithm would send), summed over phases."""
    down: int = 0
    up: int = 0

    def add(self, down: int, up: int, clients: int) -> None:
        self.down += down * clients
        self.up += up * clients


@dataclass
class RankStats:
    """One rank's RANK_FIELDS[2:] for a round, and whether it was signalled (not a column)."""
    bytes_sent: float
    bytes_received: float
    seconds_compute: float
    seconds_idle: float
    seconds_comm: float
    signalled: float

    @classmethod
    def take(cls, comm, timers: Timers) -> "RankStats":
        ledger = comm.ledger.take()
        return cls(ledger.sent, ledger.received, timers.compute, ledger.idle_seconds,
                   ledger.comm_seconds, float(signals.requested()))


RANK_DTYPE = np.dtype([(f, np.float64) for f in RankStats.__dataclass_fields__])


def gather_ranks(comm, timers: Timers) -> np.ndarray | None:
    """Every rank's stats on the server, one record per rank (fields: RankStats)."""
    stats = comm.gather_obj(RankStats.take(comm, timers), count=False)
    if not comm.is_server:
        return None
    return np.array([astuple(s) for s in stats], dtype=RANK_DTYPE)


def rank_columns(round_: int, ranks: np.ndarray) -> dict[str, np.ndarray]:
    return {"round": np.full(len(ranks), round_), "rank": np.arange(len(ranks)),
            **{f: ranks[f] for f in RANK_FIELDS[2:]}}


def round_row(config, t, wall, timers: Timers, ranks, rows, traffic: Traffic, acc, test_loss,
              x_after, x_before, diagnostics, multi_rank: bool) -> dict:
    """Round t's /rounds row on the server; ``rows``: each phase's client columns. A round
    nobody took part in (``clients.empty_rounds = "skip"``) has n_participants 0, FL bytes
    0, update_norm 0 and train_loss NaN."""
    workers = ranks[1:] if multi_rank else ranks
    first = rows[0]
    weights = first["n_samples"]
    train_loss = float(np.sum(first["train_loss"] * weights) / max(weights.sum(), 1)) \
        if len(weights) else math.nan
    return {
        "round": t + 1, "time_wall": time.perf_counter() - wall,
        "time_compute": float(workers["seconds_compute"].max()),
        "time_compute_min": float(workers["seconds_compute"].min()),
        "time_comm": float(ranks["seconds_comm"][0]), "time_idle": float(ranks["seconds_idle"][0]),
        "time_aggregate": timers.aggregate, "time_eval": timers.eval,
        "lr": schedule.round_lr(config.train, t, config.rounds),
        "train_loss": train_loss, "test_loss": test_loss, "test_acc": acc,
        "fl_bytes_down": traffic.down, "fl_bytes_up": traffic.up,
        "mpi_bytes": float(ranks["bytes_sent"].sum()),
        "n_participants": len(first["client"]),
        "update_norm": float(torch.linalg.vector_norm(x_after - x_before)),
        **diagnostics,
    }


def start_row(wall, timers: Timers, ranks, acc, test_loss) -> dict:
    """Round 0's row: the test metrics and what the evaluation took. Nothing trained:
    FL traffic, participants and compute are 0; lr, train_loss, update_norm and the
    diagnostics are not measured (left out: NaN)."""
    return {
        "round": 0, "time_wall": time.perf_counter() - wall,
        "time_compute": 0.0, "time_compute_min": 0.0,
        "time_comm": float(ranks["seconds_comm"][0]), "time_idle": float(ranks["seconds_idle"][0]),
        "time_aggregate": 0.0, "time_eval": timers.eval,
        "test_loss": test_loss, "test_acc": acc, "fl_bytes_down": 0, "fl_bytes_up": 0,
        "mpi_bytes": float(ranks["bytes_sent"].sum()), "n_participants": 0,
    }


def client_fields(alg, d: int) -> list[str]:
    fields = []
    for name, size in alg.recorded_gather(d).items():
        fields += [name] if size == 1 else [f"{name}_{i}" for i in range(size)]
    return CLIENT_FIELDS + fields


def unrecorded(alg, d: int) -> frozenset[str]:
    """The algorithm's gathered values left out of /clients (``Algorithm.recorded_gather``)."""
    return frozenset(alg.gather_sizes(d)) - frozenset(alg.recorded_gather(d))


def client_columns(gathered, skip=()) -> dict[str, np.ndarray]:
    """Per-client columns; a gathered vector of size k becomes columns name_0..name_k-1.
    ``skip``: gathered names the file does not keep (``unrecorded``)."""
    out = {}
    for name, values in gathered.items():
        if name in skip:
            continue
        if values.ndim == 1:
            out[name] = values
        else:
            out.update({f"{name}_{i}": values[:, i] for i in range(values.shape[1])})
    return out

