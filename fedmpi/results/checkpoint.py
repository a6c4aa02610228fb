"""Checkpoints inside the results file: /checkpoint, two slots written in turn.

What a checkpoint holds is everything a round depends on that is not a function of the
config: the server's algorithm state (global parameters, momenta, control variates...)
and every client's persistent state, after ``round`` completed rounds. Random streams
are keyed by (seed, round, client, purpose) (fedmpi.runtime.rng), so the round number
is the whole RNG state and the sampler position; nothing else needs saving.

Two slots, written alternately, and a commit: a slot is filled in place, flushed, and
only then does ``/checkpoint.attrs["current"]`` point at it. A crash while writing leaves
the previous checkpoint current and intact. Datasets are overwritten in place rather than
deleted and recreated, because HDF5 does not give the space of a deleted dataset back to
a file that has been closed in between: the file stays at about twice the checkpoint size
however many checkpoints a run writes.

Layout::

    /checkpoint                  attrs: current (0|1), round (completed rounds)
    /checkpoint/slot<k>          attrs: round, created
    /checkpoint/slot<k>/server/<name>   one dataset per server state tensor
    /checkpoint/slot<k>/clients         attrs: count n (rows in use; the datasets only grow)
    /checkpoint/slot<k>/clients/ids     int64 (>= n,): clients that have a state, ascending
    /checkpoint/slot<k>/clients/<name>  (>= n, size) rows in the order of ids
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Iterable, Iterator

import h5py
import numpy as np

GROUP = "checkpoint"


@dataclass
class Checkpoint:
    """A checkpoint as read back: ``states()`` streams client states one at a time."""

    round: int
    server: dict[str, np.ndarray]
    clients: h5py.Group

    def states(self) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        ids = self.clients["ids"][:int(self.clients.attrs.get("count", 0))]
        names = [k for k in self.clients if k != "ids"]
        for row, client in enumerate(ids.tolist()):
            yield client, {name: self.clients[name][row] for name in names}


def write(h5file: h5py.File, completed_rounds: int, server: dict[str, np.ndarray],
          clients: Iterable[tuple[int, dict[str, np.ndarray]]], client_sizes: dict[str, int],
          num_clients: int) -> None:
    """Fill the slot that is not current, then make it current (the commit)."""
    root = h5file.require_group(GROUP)
    slot_index = 1 - int(root.attrs.get("current", 1))
    slot = root.require_group(f"slot{slot_index}")
    _write_server(slot.require_group("server"), server)
    _write_clients(slot.require_group("clients"), clients, client_sizes, num_clients)
    slot.attrs["round"] = completed_rounds
    slot.attrs["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    h5file.flush()
    root.attrs["current"] = slot_index
    root.attrs["round"] = completed_rounds
    h5file.flush()


def growth(h5file: h5py.File, server_bytes: int, clients: int, state_bytes: int) -> int:
    """Bytes the next checkpoint would add to the file: the server state its slot does
    not hold yet, and the rows of clients beyond those the slot has room for."""
    root = h5file.get(GROUP)
    slot = None if root is None else root.get(f"slot{1 - int(root.attrs.get('current', 1))}")
    if slot is None:
        return server_bytes + clients * state_bytes
    rows = slot["clients/ids"].shape[0] if "clients/ids" in slot else 0
    server = 0 if len(slot.get("server", {})) else server_bytes
    return server + max(clients - rows, 0) * state_bytes


def read(h5file: h5py.File) -> Checkpoint | None:
    """The current checkpoint, or None when the run never wrote one."""
    if GROUP not in h5file or "current" not in h5file[GROUP].attrs:
        return None
    slot = h5file[GROUP][f"slot{int(h5file[GROUP].attrs['current'])}"]
    server = {name: ds[()] for name, ds in slot["server"].items()}
    return Checkpoint(int(slot.attrs["round"]), server, slot["clients"])


def truncate(h5file: h5py.File, completed_rounds: int) -> None:
    """Cut /rounds, /clients, /ranks, /eval and /local_spectra to the rows of rounds
    0..completed_rounds: the initial model's round 0 is kept even with no round
    completed, and a resumed run does not evaluate it again.

    Rows are appended in round order, so each group is cut at one index; the shortest
    column bounds it (a crash can land between two columns' appends).
    """
    for name in ("rounds", "clients", "ranks", "eval", "local_spectra"):
        if name not in h5file or "round" not in h5file[name]:
            continue
        columns = list(h5file[name].values())
        n = min(ds.shape[0] for ds in columns)
        keep = int(np.searchsorted(h5file[name]["round"][:n], completed_rounds, side="right"))
        for ds in columns:
            ds.resize((keep,) + ds.shape[1:])   # /eval/spectrum is [rows, F]


def _write_server(group: h5py.Group, server: dict[str, np.ndarray]) -> None:
    for name in list(group):
        if name not in server:
            del group[name]
    for name, value in server.items():
        value = np.asarray(value)
        ds = group.get(name)
        if ds is not None and ds.shape == value.shape and ds.dtype == value.dtype:
            ds[()] = value  # in place: no space lost to a delete
        else:
            if ds is not None:
                del group[name]
            group.create_dataset(name, data=value)


def _write_clients(group: h5py.Group, clients, sizes: dict[str, int], num_clients: int) -> None:
    """Rows streamed from the (possibly spilled) store; datasets grow, never get recreated."""
    def column(name, shape, dtype, chunks):
        if name in group:
            return group[name]
        return group.create_dataset(name, shape=(0, *shape), maxshape=(num_clients, *shape),
                                    dtype=dtype, chunks=chunks)

    ids = column("ids", (), np.int64, (min(max(num_clients, 1), 4096),))
    columns = {name: column(name, (size,), np.float32, (1, max(min(size, 1 << 18), 1)))
               for name, size in sizes.items()}
    written = []
    for row, (client, state) in enumerate(clients):
        for name, ds in columns.items():
            if ds.shape[0] <= row:  # never shrunk: chunks freed by a shrink would be lost
                ds.resize((row + 1, ds.shape[1]))
            ds[row] = state[name]
        written.append(client)
    if ids.shape[0] < len(written):
        ids.resize((len(written),))
    ids[:len(written)] = np.asarray(written, dtype=np.int64)
    group.attrs["count"] = len(written)
