"""The aggregator stage: how the workers' folded contributions become the server's sums.

Each phase has one aggregator (``aggregator_for``), chosen by what the algorithm declares
for the phase:

- ``WeightedMean``: every contribution is added as it comes, on the worker that trained
  the client, and the workers' sums meet on the server in one Reduce (fast mode); in
  deterministic mode each client's contribution is kept and the server adds them in
  ascending client id (``sum_in_client_order``), so the sum is the same bits for any
  layout. The algorithm's ``server_update`` turns the sums into its means.
- ``Sharded``: the sums as above, and each client's update kept on its worker; a shared
  transpose then gives each worker a run of coordinates of every kept vector
  (fedmpi.runtime.gram), where a rule computes the combination: the algorithm's Gram
  rule (``gram_coefficients``: FedU^2's EUA), whose weighted sum replaces the summed
  ``delta``;
- ``Robust`` (``[robust]``), a ``Sharded`` whose rule is a Byzantine-robust one
  (fedmpi.runtime.robust): Gram coefficients or a coordinate-wise rule, as a mean.

An aggregator's life in a phase: ``begin(sizes)`` on every rank, ``fold(c, contribution,
delta)`` per client on the worker, then ``reduce(...)`` on every rank, which returns the
sums (named as ``sizes``) on the server and None elsewhere.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from ..flat import host_vector
from . import gram

CENTRE = "robust_centre"   # centred clipping's centre in the server's state


class Contributions:
    """A worker's contributions: a running sum (fast mode) or one flat vector per client
    in training order (deterministic mode, summed in client order on the server)."""

    def __init__(self, sizes: dict[str, int], device, keep_each: bool):
        self.sizes, self.device, self.keep_each = sizes, device, keep_each
        self.total = sum(sizes.values())
        self.sum = None if keep_each else self._new(zeros=True)
        self.each: dict[int, torch.Tensor] = {}

    def _new(self, zeros: bool) -> torch.Tensor:
        if self.device.type == "cpu":
            return host_vector(self.total, zeros)
        return (torch.zeros if zeros else torch.empty)(self.total, device=self.device)

    def add(self, contribution: dict[str, torch.Tensor], client: int) -> None:
        target = self._new(zeros=False) if self.keep_each else None
        offset = 0
        for name, n in self.sizes.items():
            piece = contribution[name].reshape(-1)
            if self.keep_each:
                target[offset:offset + n] = piece
            else:
                self.sum[offset:offset + n] += piece
            offset += n
        if self.keep_each:
            self.each[client] = target.cpu()

    def host(self) -> torch.Tensor:
        """The running sum, or the per-client vectors in ascending client id (the order
        of the worker's assignment, which the server's in-order sum expects)."""
        if not self.keep_each:
            return self.sum.cpu()
        each = [self.each[c] for c in sorted(self.each)]
        return torch.stack(each) if each else torch.zeros(0, self.total)


class WeightedMean:
    """The contributions summed: one Reduce, or in client order if deterministic."""

    client_fields: list[str] = []   # /clients columns of its own (``columns``)

    def __init__(self, comm, device, deterministic: bool):
        self.comm, self.device, self.deterministic = comm, device, deterministic
        self.folded: Contributions | None = None

    def begin(self, sizes: dict[str, int]) -> None:
        self.folded = Contributions(sizes, self.device, keep_each=self.deterministic)

    def fold(self, c: int, contribution: dict, delta: torch.Tensor) -> None:
        self.folded.add(contribution, c)

    def reduce(self, assignment, ctx, timers, state=None) -> dict | None:
        """The sums on the server (None elsewhere), split by name. ``state``: the server's
        (None elsewhere), where an aggregator keeps what it carries between rounds."""
        comm, folded = self.comm, self.folded
        if folded.keep_each:
            parts = comm.gatherv(folded.host().reshape(-1).numpy())
            if not comm.is_server:
                return None
            workers = parts[1:] if comm.size > 1 else parts
            total = sum_in_client_order(workers, assignment, folded.total)
        else:
            total = host_vector(folded.total) if comm.is_server else None
            comm.reduce_sum(folded.host(), total)
            if not comm.is_server:
                return None
        return split(total, list(folded.sizes.items()), torch.device("cpu"))

    def columns(self) -> dict:
        """The server's /clients values of the last reduce, participants in ascending id."""
        return {}


class Sharded(WeightedMean):
    """The sums, then a rule over every participant's kept update, computed where the
    updates are (fedmpi.runtime.gram): ``rule(inner_products, ctx)`` gives one coefficient
    per participant (ascending id) and the summed ``delta`` becomes sum_k c_k Delta_k.
    The workspace (the transpose's buffers) is kept from round to round."""

    per_block = None   # a coordinate-wise rule (``Robust``): instead of, or after, ``rule``
    blocks_on_device = False   # the rule's blocks on the worker's GPU, where it has one
    cohort = None      # colluding attackers' rows (fedmpi.runtime.omniscient)

    def __init__(self, comm, device, deterministic: bool, d: int, rule: Callable | None):
        super().__init__(comm, device, deterministic)
        self.d, self.rule, self.space = d, rule, gram.Workspace()
        self.vectors: dict[int, torch.Tensor] = {}
        self.weights = None   # the server's: each participant's weight in the last reduce

    def fold(self, c: int, contribution: dict, delta: torch.Tensor) -> None:
        super().fold(c, contribution, delta)
        self.vectors[c] = delta.detach().float().cpu()   # host memory: K_w d a worker

    def reference(self, state) -> torch.Tensor | None:
        """A vector every worker holds, to join the updates as one more row (None: none)."""
        return None

    def train_reference(self, update: Callable) -> None:
        """Worker, after its clients: ``update()`` is the method's local update on the
        server's root set (FLTrust's g_0), should the rule want one."""

    def reduce(self, assignment, ctx, timers, state=None) -> dict | None:
        sums = super().reduce(assignment, ctx, timers)
        t0 = time.perf_counter()
        vectors = [self.vectors[c] for c in sorted(self.vectors)]
        self.vectors = {}
        rule = None if self.rule is None else (lambda inner: self.rule(inner, ctx))
        combined, self.weights = gram.weighted_sum(
            self.comm, vectors, assignment, self.d, rule, workspace=self.space,
            per_block=self.per_block, cohort=self.cohort, extra=self.reference(state),
            device=self.device if self.blocks_on_device and self.device.type != "cpu" else None)
        timers.aggregate += time.perf_counter() - t0
        if sums is not None:
            sums["delta"] = combined
        return sums


class Robust(Sharded):
    """``[robust]`` (fedmpi.runtime.robust): the sums, then a robust rule over the raw
    updates Delta_k in the summed ``delta``'s place, as a mean (``weight`` 1): a Gram rule's
    coefficients, a coordinate rule on each worker's run of coordinates, or both
    (Bulyan). Each participant's weight goes to /clients (``robust_weight``); the
    omniscient attacks rewrite the malicious rows first."""

    client_fields = ["robust_weight"]
    blocks_on_device = True   # the blocks' sorts and Gram products on a worker's GPU

    def __init__(self, comm, device, deterministic: bool, d: int, config):
        from . import omniscient, robust   # deferred: only a robust run needs the rules
        from .attacks import malicious   # deferred: likewise
        rule = config.robust.aggregator
        gram_rule = None
        if rule not in robust.COORDINATE:
            coefficients = robust.coefficients(rule, config)
            gram_rule = (lambda inner, ctx: coefficients(inner))
        super().__init__(comm, device, deterministic, d, gram_rule)
        if rule in robust.COORDINATE or rule == "bulyan":
            self.per_block = robust.coordinate_rule(rule, config.robust.f)
        if config.attack.kind in omniscient.KINDS:
            self.cohort = omniscient.CohortAttack(config, malicious(config))
        self.centred, self.rooted = rule == "centered_clip", rule == "fltrust"
        self.root = None

    def train_reference(self, update: Callable) -> None:
        if self.rooted and self.comm.is_worker:
            self.root = update().delta.detach().float().cpu()

    def reference(self, state) -> torch.Tensor | None:
        """FLTrust's g_0 (a server rank without blocks: a placeholder), or centred
        clipping's centre: the last aggregate (zero at first), kept in the server's state
        (so a checkpoint keeps it) and sent to every worker (d values)."""
        if self.rooted:
            return self.root if self.comm.is_worker else torch.zeros(0)
        if not self.centred:
            return None
        centre = host_vector(self.d)
        if self.comm.is_server and CENTRE in state:
            centre.copy_(state[CENTRE].reshape(-1))
        self.comm.bcast(centre)
        return centre

    def reduce(self, assignment, ctx, timers, state=None) -> dict | None:
        sums = super().reduce(assignment, ctx, timers, state)
        if sums is not None:
            sums["weight"] = torch.ones(1)
            if self.centred:
                state[CENTRE] = sums["delta"].clone()
        return sums

    def columns(self) -> dict:
        return {"robust_weight": self.weights}


def aggregator_for(alg, phase: str, comm, device, deterministic: bool, d: int,
                   config=None) -> WeightedMean:
    """The phase's aggregator, by the algorithm's declaration (``gram_weighted``) or the
    config's ``[robust]`` rule."""
    if alg.gram_weighted(phase):
        return Sharded(comm, device, deterministic, d, alg.gram_coefficients)
    if config is not None and config.robust.aggregator != "none":
        return Robust(comm, device, deterministic, d, config)
    return WeightedMean(comm, device, deterministic)


def sum_in_client_order(parts, assignment, total: int) -> torch.Tensor:
    """Add per-client vectors in ascending client id, whichever worker sent them.

    ``parts[w]`` holds worker w's vectors in the order of ``assignment[w]``. The float32
    additions happen in one fixed order, so the sum is the same bits for any layout.
    """
    by_client = {}
    for clients, part in zip(assignment, parts):
        for c, vec in zip(np.asarray(clients).tolist(), part.reshape(-1, total)):
            by_client[c] = vec
    out = host_vector(total)
    for c in sorted(by_client):
        out += torch.from_numpy(by_client[c])
    return out


def split(buf: torch.Tensor, spec, device) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    buf = buf.to(device)
    for name, n in spec:
        out[name] = buf[offset:offset + n]
        offset += n
    return out
