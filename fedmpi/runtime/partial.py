"""Private layers: the parameters of a model that never travel (FedPer's head, LG-FedAvg's
body, FedBN's normalisation layers, FedBABU's frozen head), as one client stage of the
update pipeline.

A method names its private layers (``Algorithm.private_layers``); ``SharedMask`` turns the
names into the flat buffer's shared coordinates. Private parameters are whole slots of the
flat buffer (a parameter tensor or a float buffer), and a slot occupies the same run of
coordinates in the storage order (channels-last 4-D weights) as in the standard order
that files hold (fedmpi.flat): a permutation acts inside a slot only. So the mask is a
list of runs of whole slots, (offset, length), ascending, the same in both orders, and
the shared vector is the runs concatenated: d_shared values, which is the ``d`` the
runtime's wire sees (the payload, the codecs, the sums, the Gram path, the ledger, the
virtual clock).

``PrivateLayers``, the stage (first of the client stages, so a clip or a codec sees what
travels):

- server, before the payload is encoded (``compact``): x -> x[shared];
- worker, per client before its local update (``prepare``): the global shared values
  merged with the client's private ones (its state, or the initial model's at its first
  participation: the state store's zeros are never a model), so the method trains the
  whole model from x_c;
- worker, after it (``upload``): the client's new private values x_c[private] +
  Delta[private] kept as its state, and Delta[shared] uploaded;
- server, before the method's update (``restore``): the summed shared delta put back
  at full width, zeros at the private coordinates (FedAvg's update keeps the global
  model's private part at its initial values);
- evaluation (``personal``): the global model with the client's private values.

A method whose private layers stay at their initial values (``Algorithm.private_state =
False``: FedBABU's head, frozen during training) keeps no state: every client's private
part is the initial model's.
"""

from __future__ import annotations

import torch

from ..errors import UsageError
from .stages import ClientStage

STARTED = "private_started"


class SharedMask:
    """The shared and private coordinates of a flat model whose slots named by ``names``
    (module names: a slot is private when its name is one of them or starts with one
    followed by a dot) are private."""

    def __init__(self, flat, names: list[str], field: str = "algorithm.private"):
        modules = dict(flat.module.named_modules())
        unknown = [n for n in names if n not in modules and
                   n not in {s.name for s in flat.layout}]
        if unknown:
            layers = ", ".join(name for name, _ in flat.module.named_children())
            raise UsageError(f"config field {field}: the model has no layer {unknown[0]!r}; "
                             f"its layers are {layers}")
        self.d = flat.size
        private = [s.within(names) for s in flat.layout]
        self.shared_runs = _runs([(s.offset, s.numel) for s, p in zip(flat.layout, private)
                                  if not p])
        self.private_runs = _runs([(s.offset, s.numel) for s, p in zip(flat.layout, private)
                                   if p])
        self.private_names = [s.name for s, p in zip(flat.layout, private) if p]
        self.d_shared = sum(n for _, n in self.shared_runs)
        self.d_private = self.d - self.d_shared
        if not self.d_shared:
            raise UsageError(f"config field {field}: every parameter would be private and "
                             f"nothing would travel; keep at least one layer shared")

    @property
    def active(self) -> bool:
        return self.d_private > 0

    def shared(self, v: torch.Tensor) -> torch.Tensor:
        return _take(v, self.shared_runs)

    def private(self, v: torch.Tensor) -> torch.Tensor:
        return _take(v, self.private_runs)

    def put_shared(self, full: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return _put(full, shared, self.shared_runs)

    def put_private(self, full: torch.Tensor, private: torch.Tensor) -> torch.Tensor:
        return _put(full, private, self.private_runs)

    def expand(self, shared: torch.Tensor) -> torch.Tensor:
        """A full-width vector: ``shared`` at the shared coordinates, zeros elsewhere."""
        return self.put_shared(shared.new_zeros(self.d), shared)


def _runs(pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent (offset, length) pieces merged, in ascending offset."""
    runs: list[tuple[int, int]] = []
    for offset, n in sorted(pieces):
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + n)
        else:
            runs.append((offset, n))
    return runs


def _take(v: torch.Tensor, runs) -> torch.Tensor:
    if len(runs) == 1:
        offset, n = runs[0]
        return v[offset:offset + n]
    return torch.cat([v[offset:offset + n] for offset, n in runs])


def _put(full: torch.Tensor, values: torch.Tensor, runs) -> torch.Tensor:
    at = 0
    for offset, n in runs:
        full[offset:offset + n] = values[at:at + n]
        at += n
    return full


class PrivateLayers(ClientStage):
    """The stage (module docstring). ``x0``: the initial model (every rank builds the same
    one), whose private values a client starts from; ``stateful``: whether each client
    keeps its own private values (False: they stay the initial ones)."""

    def __init__(self, mask: SharedMask, x0: torch.Tensor, stateful: bool = True):
        self.mask, self.x0, self.stateful = mask, x0.detach().clone(), stateful
        self.personalised = stateful   # a model of its own per client: its private values
        self.received = None   # the round's shared payload, and the full x made from it
        self.full = None
        self.current = None    # the last client's x_c, which its upload started from

    def state_sizes(self):
        return {"private": self.mask.d_private, STARTED: 1} if self.stateful else {}

    def compact(self, payload: dict) -> dict:
        return {**payload, "x": self.mask.shared(payload["x"])}

    def prepare(self, payload: dict, state: dict | None) -> dict:
        x = payload["x"]
        if self.received is not x:   # a new round's payload: the full x, once a round
            self.received = x
            self.full = self.mask.put_shared(self.x0.to(x.device, copy=True), x)
        self.current = self._merge(self.full, state)
        return {**payload, "x": self.current}

    def _merge(self, x: torch.Tensor, state: dict | None) -> torch.Tensor:
        if not self.stateful or not started(state):
            return x
        private = torch.as_tensor(state["private"]).to(x.device)
        return self.mask.put_private(x.clone(), private)

    def upload(self, upload, state, key):
        kept = {}
        if self.stateful:
            kept = {"private": self.mask.private(self.current) + self.mask.private(upload.delta),
                    STARTED: torch.ones(1)}
        upload.delta = self.mask.shared(upload.delta)
        return upload, kept

    def restore(self, sums: dict) -> None:
        sums["delta"] = self.mask.expand(sums["delta"])

    def personal(self, state: dict | None, x: torch.Tensor) -> torch.Tensor:
        return self._merge(x, state)


def private_stage(alg, flat) -> PrivateLayers | None:
    """The run's PrivateLayers stage, or None for a method without private layers (or one
    whose private set is empty: FedAvg's bits)."""
    names = alg.private_layers(flat.module)
    if not names:
        return None
    mask = SharedMask(flat, list(names))
    return PrivateLayers(mask, flat.params, alg.private_state) if mask.active else None


def started(state: dict | None) -> bool:
    """Whether a client's state holds its private values (it has trained)."""
    return state is not None and STARTED in state and bool(state[STARTED][0])  # host sync: once a client
