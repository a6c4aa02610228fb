"""Per-client persistent state (SCAFFOLD c_i, FedDyn grad_i, MOON's previous model).

Kept by client id on the server's host, not by the rank that last trained the client:
the runtime ships a client's state to whichever worker trains it and takes the new
value back, so placement never changes results. A client that never took part has
zeros. (Spilling to disk past a memory budget and checkpointing build on this store.)
"""

from __future__ import annotations

import numpy as np


class ClientStateStore:
    def __init__(self, sizes: dict[str, int], dtype=np.float32):
        self.sizes, self.dtype = dict(sizes), dtype
        self._states: dict[int, dict[str, np.ndarray]] = {}

    def get(self, client: int) -> dict[str, np.ndarray]:
        state = self._states.get(client)
        if state is None:
            return {name: np.zeros(n, dtype=self.dtype) for name, n in self.sizes.items()}
        return state

    def put(self, client: int, state: dict[str, np.ndarray]) -> None:
        for name, n in self.sizes.items():
            if state[name].size != n:
                raise ValueError(f"client {client} state {name}: {state[name].size} values, declared {n}")
        self._states[client] = {name: np.asarray(state[name], dtype=self.dtype) for name in self.sizes}

    def __len__(self) -> int:
        return len(self._states)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for s in self._states.values() for a in s.values())
