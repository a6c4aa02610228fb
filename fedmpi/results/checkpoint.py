"""Checkpoints inside the results file: /checkpoint, two slots written in turn.

What a checkpoint holds is everything a round depends on that is not a function of the
config: the server's algorithm state (global parameters, momenta, control variates...)
and every client's persistent state, after ``round`` completed rounds. Random streams
are keyed by (seed, round, client, purpose) (fedmpi.runtime.rng), so the round number
is the whole RNG state and the sampler position; nothing else needs saving.

Two slots, written alternately, and a commit: a slot is filled in place, flushed and
synced to the disk (fsync), and only then does ``/checkpoint.attrs["current"]`` point at
it. A crash while writing leaves the previous checkpoint current and intact. Datasets
are overwritten in place rather than deleted and recreated, because HDF5 does not give
the space of a deleted dataset back to a file that has been closed in between: the file
stays at about twice the checkpoint size however many checkpoints a run writes.

HDF5 keeps no checksum of raw data, so each slot records a CRC-32 of what it holds
(``crc32``: server arrays, client ids and rows; 7 GB/s, a third of SHA-256's time).
``read`` checks it: a slot that does not match (a node that died before its writes
reached the disk, a flipped bit) is skipped for the other one, and when neither is
intact ``read`` raises ``Damaged`` (a resume then starts again from round 0).

Layout::

    /checkpoint                  attrs: current (0|1), round (completed rounds)
    /checkpoint/slot<k>          attrs: round, created, crc32 (absent in older files)
    /checkpoint/slot<k>/server/<name>   one dataset per server state tensor
    /checkpoint/slot<k>/clients         attrs: count n (rows in use; the datasets only grow)
    /checkpoint/slot<k>/clients/ids     int64 (>= n,): clients that have a state, ascending
    /checkpoint/slot<k>/clients/<name>  (>= n, size) rows in the order of ids
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Iterable, Iterator

import h5py
import numpy as np

GROUP = "checkpoint"


class Damaged(ValueError):
    """No checkpoint slot is intact; the message says what is wrong with each."""


@dataclass
class Checkpoint:
    """A checkpoint as read back: ``states()`` streams client states one at a time.
    ``skipped``: the newer slots that were damaged, one line each."""

    round: int
    server: dict[str, np.ndarray]
    clients: h5py.Group
    skipped: list[str] = field(default_factory=list)
    slot: int = 0

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
    digest = _Digest()
    _write_server(slot.require_group("server"), server, digest)
    _write_clients(slot.require_group("clients"), clients, client_sizes, num_clients, digest)
    # modify: rewritten in place (a deleted and recreated attribute may leave its space)
    slot.attrs.modify("round", completed_rounds)
    slot.attrs.modify("created", datetime.now(timezone.utc).isoformat(timespec="seconds"))
    slot.attrs.modify("crc32", np.uint32(digest.value))
    _sync(h5file)
    root.attrs["current"] = slot_index
    root.attrs["round"] = completed_rounds
    _sync(h5file)


def point_at(h5file: h5py.File, ckpt: "Checkpoint | None") -> None:
    """Make ``ckpt`` current (None: no checkpoint at all), after ``read`` skipped a damaged
    slot: the next checkpoint then goes over the damaged one, not the intact one."""
    root = h5file.get(GROUP)
    if root is None:
        return
    if ckpt is None:
        root.attrs.pop("current", None)
        root.attrs.pop("round", None)
    else:
        root.attrs.modify("current", ckpt.slot)
        root.attrs.modify("round", ckpt.round)


def _sync(h5file: h5py.File) -> None:
    """Flush HDF5's buffers and have the kernel put the file on the disk: the commit must
    not reach the disk before the slot it points at."""
    h5file.flush()
    try:
        os.fsync(h5file.id.get_vfd_handle())
    except (OSError, ValueError, TypeError):   # a driver without a descriptor
        pass


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
    """The current checkpoint, else the other slot's if the current one is damaged, or None
    when the run never wrote one; ``Damaged`` when no slot is intact."""
    root = h5file.get(GROUP)
    if root is None or "current" not in root.attrs:
        return None
    current, skipped = int(root.attrs["current"]), []
    for index in (current, 1 - current):
        slot = root.get(f"slot{index}")
        if slot is None or "round" not in slot.attrs:
            continue
        server, problem = _check(slot)
        if problem is None:
            return Checkpoint(int(slot.attrs["round"]), server, slot["clients"], skipped, index)
        skipped.append(f"the checkpoint after round {int(slot.attrs['round'])} is damaged "
                       f"({problem})")
    raise Damaged("; ".join(skipped))


def _check(slot: h5py.Group) -> tuple[dict[str, np.ndarray], str | None]:
    """The slot's server arrays, read once, and what is wrong with the slot's content, or
    None (also for a slot without a digest)."""
    recorded = slot.attrs.get("crc32")
    if recorded is None:   # written before the digest: read as before, nothing to check
        return {name: ds[()] for name, ds in slot["server"].items()}, None
    server, digest = {}, _Digest()
    try:
        for name in sorted(slot["server"]):
            server[name] = slot["server"][name][()]
            digest.array(name, server[name])
        group = slot["clients"]
        count = int(group.attrs.get("count", 0))
        names = sorted(k for k in group if k != "ids")
        ids = group["ids"][:count]
        row_bytes = sum(group[n].shape[1] * group[n].dtype.itemsize for n in names) or 1
        step = max(1, (64 << 20) // row_bytes)   # rows per read: at most ~64 MB at once
        for start in range(0, count, step):
            block = {n: group[n][start:start + step] for n in names}
            for i, client in enumerate(ids[start:start + step].tolist()):
                digest.client(client, {n: block[n][i] for n in names})
    except (OSError, KeyError, ValueError) as exc:
        return server, f"unreadable: {exc}"
    if digest.value != int(recorded):
        return server, "its CRC-32 does not match what was written"
    return server, None


class _Digest:
    """CRC-32 of a slot in a fixed order: server arrays by name (dtype, shape, bytes),
    then each client's id and its rows by name, in the order the rows are stored."""

    def __init__(self):
        self.value = 0

    def _add(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def array(self, name: str, value: np.ndarray) -> None:
        value = np.ascontiguousarray(value)
        self._add(f"{name} {value.dtype.str} {value.shape}\n".encode())
        self._add(memoryview(value.reshape(-1)).cast("B"))

    def client(self, client: int, rows: dict[str, np.ndarray]) -> None:
        self._add(np.int64(client).tobytes())
        for name in sorted(rows):
            self._add(memoryview(np.ascontiguousarray(rows[name]).reshape(-1)).cast("B"))


def truncate(h5file: h5py.File, completed_rounds: int) -> None:
    """Cut /rounds, /clients, /ranks, /eval, /local_spectra and /client_eval to the rows of rounds
    0..completed_rounds: the initial model's round 0 is kept even with no round
    completed, and a resumed run does not evaluate it again.

    Rows are appended in round order, so each group is cut at one index; the shortest
    column bounds it (a crash can land between two columns' appends).
    """
    for name in ("rounds", "clients", "ranks", "eval", "local_spectra", "client_eval"):
        if name not in h5file or "round" not in h5file[name]:
            continue
        columns = list(h5file[name].values())
        n = min(ds.shape[0] for ds in columns)
        keep = int(np.searchsorted(h5file[name]["round"][:n], completed_rounds, side="right"))
        for ds in columns:
            ds.resize((keep,) + ds.shape[1:])   # /eval/spectrum is [rows, F]


def _write_server(group: h5py.Group, server: dict[str, np.ndarray], digest: _Digest) -> None:
    for name in list(group):
        if name not in server:
            del group[name]
    for name in sorted(server):
        value = np.asarray(server[name])
        digest.array(name, value)
        ds = group.get(name)
        if ds is not None and ds.shape == value.shape and ds.dtype == value.dtype:
            ds[()] = value  # in place: no space lost to a delete
        else:
            if ds is not None:
                del group[name]
            group.create_dataset(name, data=value)


def _write_clients(group: h5py.Group, clients, sizes: dict[str, int], num_clients: int,
                   digest: _Digest) -> None:
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
        stored = {name: np.asarray(state[name], dtype=ds.dtype) for name, ds in columns.items()}
        for name, ds in columns.items():
            if ds.shape[0] <= row:  # never shrunk: chunks freed by a shrink would be lost
                ds.resize((row + 1, ds.shape[1]))
            ds[row] = stored[name]
        digest.client(client, stored)
        written.append(client)
    if ids.shape[0] < len(written):
        ids.resize((len(written),))
    ids[:len(written)] = np.asarray(written, dtype=np.int64)
    group.attrs["count"] = len(written)
