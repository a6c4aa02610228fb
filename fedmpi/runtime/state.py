"""Per-client persistent state (SCAFFOLD c_i, FedDyn grad L_i, MOON's previous model).

Kept by client id on the server's host, not by the rank that last trained the client:
the runtime ships a client's state to whichever worker trains it and takes the new
value back, so placement never changes results. A client that never took part has
zeros.

Past a memory budget (config ``system.state_memory_mb``) the least recently used
clients' states are written to one raw file each in a spill directory (config
``system.state_dir``; a private temporary directory inside it, or under the system's
temporary directory by default, removed by ``close``) and read back on ``get``. A
state lives in exactly one place, memory or disk, and comes back bit for bit. A run
killed outright cannot remove its directory, and a requeued run on shared scratch would
pile one up per kill (a state per client: gigabytes), so the directory's name holds the
host and the pid, and a store's first spill removes those of gone processes on its host.
``items()`` visits every client's state without loading the spilled ones into the
budget, which is what a checkpoint needs; ``load_state_dict`` restores them.

Between the ranks the states travel as flat buffers, never pickled (``pieces`` and
``pack`` on the way out, ``unpack`` on the way in): a method with a model-sized state per
client (SCAFFOLD, Ditto, APFL, pFedMe: 45 MB a client with ResNet-18) would otherwise be
copied into a pickle and out of it every round.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np

from ..errors import UsageError
from ..results import liveness

State = dict[str, np.ndarray]
DTYPE = np.float32   # what the stores hold, and what travels


def pieces(states: Iterable[State], sizes: Mapping[str, int]) -> list[np.ndarray]:
    """The arrays of ``states`` in ``sizes``' order, to send back to back uncopied."""
    return [state[name] for state in states for name in sizes]


def pack(states: Mapping[int, State], sizes: Mapping[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """(the clients' ids, their states back to back in one flat DTYPE array). A state of
    another size than declared is an error here, as in ``ClientStateStore.put``."""
    for client, state in states.items():
        for name, n in sizes.items():
            if np.size(state[name]) != n:
                raise ValueError(f"client {client} state {name}: {np.size(state[name])} "
                                 f"values, declared {n}")
    ids = np.fromiter(states, dtype=np.int64, count=len(states))
    flat = [np.asarray(a, dtype=DTYPE).reshape(-1) for a in pieces(states.values(), sizes)]
    return ids, np.concatenate(flat) if flat else np.zeros(0, DTYPE)


def unpack(flat: np.ndarray, clients: Iterable[int], sizes: Mapping[str, int]) -> dict[int, State]:
    """``pack``'s (or ``pieces``') buffer as client -> state of views into ``flat``."""
    out, offset = {}, 0
    for client in clients:
        out[int(client)] = state = {}
        for name, n in sizes.items():
            state[name] = flat[offset:offset + n]
            offset += n
    if offset != flat.size:
        raise ValueError(f"client states: {flat.size} values received, {offset} expected")
    return out


class ClientStateStore:
    """Client id -> named flat arrays of the declared ``sizes``, LRU-spilled past
    ``memory_bytes`` (None: no budget) into ``directory``."""

    def __init__(self, sizes: dict[str, int], dtype=DTYPE, memory_bytes: int | None = None,
                 directory: str | Path | None = None):
        self.sizes, self.dtype = dict(sizes), np.dtype(dtype)
        self.memory_bytes = memory_bytes
        self.directory = None if directory is None else Path(directory).expanduser()
        self._memory: OrderedDict[int, State] = OrderedDict()   # least recently used first
        self._on_disk: set[int] = set()
        self._spill_dir: Path | None = None
        self._cleanup = None
        if directory is not None and memory_bytes is not None and self.state_bytes:
            _check_writable(self.directory)

    @property
    def state_bytes(self) -> int:
        """Bytes of one client's state."""
        return sum(self.sizes.values()) * self.dtype.itemsize

    # ---- the runtime's API ---------------------------------------------------------
    def get(self, client: int) -> State:
        """The client's state (zeros if it has none); marks it most recently used."""
        if client in self._memory:
            self._memory.move_to_end(client)
            return self._memory[client]
        if client in self._on_disk:
            state = self._read(client)
            self._forget_file(client)
            self._admit(client, state)
            return state
        return {name: np.zeros(n, dtype=self.dtype) for name, n in self.sizes.items()}

    def put(self, client: int, state: Mapping[str, np.ndarray]) -> None:
        """Store a copy of ``state`` as the client's state (most recently used)."""
        for name, n in self.sizes.items():
            if np.size(state[name]) != n:
                raise ValueError(f"client {client} state {name}: {np.size(state[name])} values, "
                                 f"declared {n}")
        copied = {name: np.array(state[name], dtype=self.dtype).reshape(-1) for name in self.sizes}
        self._memory.pop(client, None)
        if client in self._on_disk:
            self._forget_file(client)
        self._admit(client, copied)

    def __len__(self) -> int:
        return len(self._memory) + len(self._on_disk)

    @property
    def nbytes(self) -> int:
        """Bytes of state held in memory (at most ``memory_bytes``)."""
        return len(self._memory) * self.state_bytes

    @property
    def disk_bytes(self) -> int:
        return len(self._on_disk) * self.state_bytes

    # ---- checkpoints ---------------------------------------------------------------
    def clients(self) -> list[int]:
        """Ids of the clients that have a state, ascending."""
        return sorted([*self._memory, *self._on_disk])

    def items(self) -> Iterator[tuple[int, State]]:
        """(client, state) in ascending client id; spilled states are read one at a time
        and neither change the LRU order nor count against the budget."""
        for client in self.clients():
            yield client, self._memory[client] if client in self._memory else self._read(client)

    def state_dict(self) -> dict[int, State]:
        """Every client's state (all of it in memory: prefer ``items`` for large stores)."""
        return dict(self.items())

    def load_state_dict(self, states: Mapping[int, Mapping[str, np.ndarray]]
                        | Iterable[tuple[int, Mapping[str, np.ndarray]]]) -> None:
        """Replace the contents with ``states`` (a mapping or (client, state) pairs)."""
        self.clear()
        pairs = states.items() if isinstance(states, Mapping) else states
        for client, state in pairs:
            self.put(int(client), state)

    def clear(self) -> None:
        self._memory.clear()
        for client in list(self._on_disk):
            self._forget_file(client)

    def close(self) -> None:
        """Drop every state and remove the spill directory."""
        self._memory.clear()
        self._on_disk.clear()
        if self._cleanup is not None:
            self._cleanup()
            self._spill_dir = self._cleanup = None

    def __enter__(self) -> "ClientStateStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- spilling ------------------------------------------------------------------
    def _admit(self, client: int, state: State) -> None:
        """Hold ``state`` in memory as most recently used, then spill the least recently
        used states until the budget holds (the newcomer too, if it alone exceeds it)."""
        self._memory[client] = state
        while self.memory_bytes is not None and self._memory and self.nbytes > self.memory_bytes:
            victim, victim_state = self._memory.popitem(last=False)
            try:
                self._write(victim, victim_state)
            except OSError:   # the spill disk is full: the state stays where it was
                self._memory[victim] = victim_state
                self._memory.move_to_end(victim, last=False)
                raise

    def _path(self, client: int) -> Path:
        if self._spill_dir is None:
            # Created on first spill: runs that stay within the budget touch no disk.
            parent = self.directory
            if parent is not None:
                parent.mkdir(parents=True, exist_ok=True)
            prefix = f"fedmpi-state-{socket.gethostname()}.{os.getpid()}-"
            parent = Path(tempfile.gettempdir()) if parent is None else parent
            _remove_dead(parent)
            self._spill_dir = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self._spill_dir),
                                             ignore_errors=True)
        return self._spill_dir / f"{client}.bin"

    def _write(self, client: int, state: State) -> None:
        """Raises OSError with the errno and the file's name (numpy's ``tofile`` said only
        "5786 requested and 2048 written" on a full disk); leaves no partial file."""
        path = self._path(client)
        try:
            with open(path, "wb") as f:
                for name in self.sizes:
                    f.write(np.ascontiguousarray(state[name]).data)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
        self._on_disk.add(client)

    def _read(self, client: int) -> State:
        flat = np.fromfile(self._path(client), dtype=self.dtype)
        out, offset = {}, 0
        for name, n in self.sizes.items():
            out[name] = flat[offset:offset + n]
            offset += n
        return out

    def _forget_file(self, client: int) -> None:
        self._on_disk.discard(client)
        self._path(client).unlink(missing_ok=True)


def _remove_dead(parent: Path) -> None:
    """Remove the spill directories in ``parent`` left by processes on this host that
    are gone (killed outright: no ``close``)."""
    for old in liveness.left_by_the_dead(parent, "fedmpi-state-", "-*"):
        shutil.rmtree(old, ignore_errors=True)


def _check_writable(directory: Path) -> None:
    """A spill directory that cannot be made or written in fails at the start, not at the
    first spill, hours into the run: a directory is made in it and removed again."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix="fedmpi-probe-", dir=directory))
    except OSError as exc:
        raise UsageError(f"config field system.state_dir: cannot write in {directory} "
                         f"({exc.strerror or exc}); client states past "
                         f"system.state_memory_mb spill there") from None
