"""One phase of a round over any comm: the protocol every algorithm runs through.

The runtime runs it over MPI or in one process; the test harness runs the same code over
``LocalComm`` with closed-form clients, so algorithm tests check the runtime's ordering.

1. announce: server picks the participants, places them, broadcasts plan + payload;
2. train: workers train their clients; each upload goes through the client stages
   (fedmpi.runtime.stages: codec, staleness, update statistics) into the phase's
   aggregator (fedmpi.runtime.aggregate) as it comes;
3. reduce: the aggregator's sums on the server, the per-client rows (client order) and
   the new client states;
4. update: the server takes the stages' extra sums out, applies the algorithm's update
   (or the participation's: FedAsync's mix), and makes the round's diagnostics.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from .. import algorithms
from ..algorithms import schedule
from ..flat import WIRE_BYTES, host_vector
from .aggregate import aggregator_for, split
from .asyncfl import Versions
from .compression import Compression
from .plan import groups, place
from .records import Timers, Traffic
from .stages import ClientStage, Encode, state_sizes
from .state import pack, pieces, unpack

# the payload's names for what server stages send the client stages (``receive``)
STAGE = "stage/"

ROW = ["client", "rank", "n_samples", "steps", "train_loss", "update_norm", "seconds"]


class StopRun(Exception):
    """The server told every rank to stop: divergence, or a preemption signal."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class PhaseResult:
    """Server side of a phase: what server_update received, and the rows for /clients."""
    sums: dict
    gathered: dict
    diagnostics: dict
    rows: dict           # gathered + phase, bytes_down, bytes_up


@dataclass
class Phases:
    """What a phase needs from the world. ``make_task(c, ctx, p)``: client c's ClientTask;
    ``store``: the server's client states (get/put); ``steps``: placement weights;
    ``stages``: the client stages in order (None: the codecs' alone)."""
    comm: object
    alg: object
    d: int
    device: torch.device
    steps: np.ndarray
    context: Callable       # (t, phase, participants) -> RoundContext
    make_task: Callable
    store: object = None
    deterministic: bool = False
    group: int = 1          # system.client_group, resolved: clients trained in lock-step
    codecs: Compression | None = None   # the run's codecs; None: no compression
    stages: list[ClientStage] | None = None
    server_stages: list = field(default_factory=list)   # after the reduce (fedmpi.runtime.dp)
    config: object = None   # the run's config: its [robust] rule picks the aggregator
    make_root: Callable | None = None   # (ctx, p) -> the server's root set's ClientTask (FLTrust)
    aggregators: list = field(init=False)   # one a phase, kept across rounds

    def __post_init__(self):
        if self.codecs is None:
            self.codecs = Compression(None, self.alg, self.d)
        if self.stages is None:
            self.stages = [Encode(self.codecs)]
        self.alg_states = self.alg.client_state_sizes(self.d)
        self.state_sizes = state_sizes(self.alg, self.d, self.stages)
        # per-client evaluation: whether clients have models of their own, and the state
        # entries those are made from (the method's, the private layers')
        self.personalised = self.alg.personalised or any(s.personalised for s in self.stages)
        self.personal_keys = set(self.alg_states) | {
            k for s in self.stages if s.personalised for k in s.state_sizes()}
        self.aggregators = [aggregator_for(self.alg, phase, self.comm, self.device,
                                           self.deterministic, self.d, self.config)
                            for phase in self.alg.phases]

    def run(self, state, t: int, p: int, phase: str, sampled, timers: Timers,
            traffic: Traffic, stop=None, after_client=None, versions: Versions | None = None
            ) -> PhaseResult | None:
        """Steps 1-4 for one phase; returns the result on the server, None elsewhere.
        ``after_client(c, upload)``: called after each local update; returns seconds
        to count as evaluation rather than compute (FedU^2's local spectra).
        ``versions`` (server; asynchronous FL): each client's own model version, and the
        server update that replaces the method's, if any."""
        comm, alg = self.comm, self.alg
        participants, assignment, payload, of = self.announce(state, t, phase, sampled, stop,  # 1
                                                              versions)
        if payload is None:   # an empty round: nobody trains, nothing to sum or update
            return self.empty(p, phase) if comm.is_server else None
        ctx = self.context(t, phase, participants)
        states = self.scatter_states(assignment)
        t0 = time.perf_counter()
        rows, new_states, aside = self.train(assignment, payload, states, ctx, p,        # 2
                                             after_client, of)
        timers.eval += aside
        timers.compute += time.perf_counter() - t0 - aside
        sums = self.aggregators[p].reduce(assignment, ctx, timers, state)                # 3
        gathered = self.collect_rows(rows, phase)
        self.gather_states(new_states)
        if not comm.is_server:
            return None
        t0 = time.perf_counter()
        for stage in self.server_stages:   # they see the stages' extra sums (privacy's count)
            stage.before(state, sums, gathered, ctx, p)
        extra = {k: sums.pop(k) for stage in self.stages for k in stage.sums(p, self.d)}
        for stage in self.stages:   # the private layers' zeros back in
            stage.restore(sums)
        update = versions.update if versions is not None and versions.update else alg.server_update
        update(state, sums, gathered, ctx)                                              # 4
        after = {}
        for stage in self.server_stages:
            after.update(stage.after(state, sums, gathered, ctx, p))
        timers.aggregate += time.perf_counter() - t0
        diagnostics = {**self.summarize(p, extra, gathered), **after,
                       **alg.diagnostics(state, sums, gathered, ctx)}
        down, up = self.codecs.message_bytes(self.d, phase)
        for stage in self.stages:
            values_down, values_up = stage.traffic(p)
            down, up = down + WIRE_BYTES * values_down, up + WIRE_BYTES * values_up
        n = len(participants)
        traffic.add(down, up, n)
        rows = {**self.unused_columns(phase, n), **gathered, "phase": np.full(n, p),
                "bytes_down": np.full(n, down), "bytes_up": np.full(n, up),
                **self.aggregators[p].columns()}
        for stage in self.stages:   # the attackers' mark
            rows.update(stage.columns(gathered["client"]))
        return PhaseResult(sums, gathered, diagnostics, rows)

    def summarize(self, p: int, extra: dict, gathered: dict) -> dict:
        diagnostics = {}
        for stage in self.stages:
            diagnostics.update(stage.summarize(p, extra, gathered))
        return diagnostics

    def announce(self, state, t, phase, sampled, stop, versions=None):
        """Server -> all: participants, placement and the payload (one flat buffer).

        An empty S_t (``clients.empty_rounds = "skip"``) empties every phase of the round,
        whatever ``phase_participants`` would pick: the plan says so (no payload spec,
        payload None on every rank) and nothing else is sent. With ``versions`` the
        buffer holds the payload of every model version the clients train on (its names
        prefixed "v/"), and the head says whose is whose (``Versions.of``)."""
        comm, head, buf = self.comm, None, None
        if comm.is_server:
            of = None if versions is None else versions.of
            if len(sampled):
                participants = np.asarray(self.alg.phase_participants(state, phase, sampled))
                if versions is None:
                    payload = self.codecs.download(self.compact(
                        self.alg.payload(state, self.context(t, phase, participants))))
                else:
                    payload = {f"{v}/{k}": tensor for v, s in sorted(versions.states.items())
                               for k, tensor in self.codecs.download(self.compact(self.alg.payload(
                                   s, self.context(v, phase, participants)))).items()}
                for stage in self.server_stages:   # privacy's adaptive clip
                    payload.update({f"{STAGE}{k}": v for k, v in stage.download(state).items()})
                spec = [(k, v.numel()) for k, v in payload.items()]
                buf = torch.cat([v.reshape(-1).to(torch.float32) for v in payload.values()])
            else:
                participants, spec = np.zeros(0, dtype=np.int64), None
            head = (stop, participants, place(participants, self.steps, comm.num_workers, self.group),
                    spec, of)
        stop, participants, assignment, spec, of = comm.bcast_obj(head)
        if stop:
            raise StopRun(stop)
        if spec is None:
            return participants, assignment, None, of
        if buf is None:
            buf = host_vector(sum(n for _, n in spec), zeros=False)
        comm.bcast(buf)
        return participants, assignment, split(buf, spec, self.device), of

    def compact(self, payload: dict) -> dict:
        """What of the method's payload travels (the stages' ``compact``)."""
        for stage in self.stages:
            payload = stage.compact(payload)
        return payload

    def personal(self, state: dict, x: torch.Tensor) -> torch.Tensor:
        """A client's own model from its state (``personal_keys``, on the device) and the
        global model x: the method's (``personal_params``), then the stages'."""
        if self.alg.personalised:
            x = self.alg.personal_params({k: v for k, v in state.items()
                                          if k in self.alg_states}, x)
        for stage in self.stages:
            x = stage.personal(state, x)
        return x

    def sizes(self, p: int) -> dict[str, int]:
        """What is summed in phase p: the algorithm's contributions, then the stages'
        extra sums (the update statistics' two vectors in the first phase)."""
        sizes = dict(self.alg.contribution_sizes(self.d, self.alg.phases[p]))
        for stage in self.stages:
            sizes.update(stage.sums(p, self.d))
        return sizes

    def train(self, assignment, payload, states, ctx, p, after_client=None, of=None):
        """Train this worker's clients, folding each contribution in as it comes (client
        groups: a group's at the end of the group). ``of`` (asynchronous FL): client ->
        (model version, the scale of its contribution's delta, the round key of its data):
        each trains on its version's payload with that version's round lr."""
        received = {k[len(STAGE):]: payload.pop(k) for k in list(payload) if k.startswith(STAGE)}
        for stage in self.stages:
            stage.receive(received)
        aggregator = self.aggregators[p]
        aggregator.begin(self.sizes(p))
        rows, new_states, aside = [], {}, 0.0
        mine = np.asarray(assignment[self.comm.worker_index] if self.comm.is_worker else [])

        def fold(c, upload, seconds, scale=1.0):
            feedback = {}
            for stage in self.stages:
                upload, kept = stage.upload(upload, states.get(c), (ctx.round, c, p))
                feedback.update(kept)
            contribution = self.alg.contribution(upload)
            meta = {"phase": p, "scale": scale}
            for stage in self.stages:
                contribution = stage.contribute(contribution, upload, meta)
            aggregator.fold(c, contribution, upload.delta)
            if upload.state is not None or feedback:
                new_states[c] = {**states.get(c, {}), **{k: v.detach().cpu().numpy() for k, v in
                                                         {**(upload.state or {}), **feedback}.items()}}
            rows.append(self.client_row(c, upload, seconds, ctx.phase))

        if self.group > 1:
            if after_client is not None:   # FedU^2's local spectra: refused at config time
                raise ValueError("a client group has no per-client local model to show after_client")
            self.train_groups(mine, payload, states, ctx, p, fold)
        else:
            for c, state in self.device_states(mine.tolist(), states):
                t0 = time.perf_counter()
                mine_ctx, mine_payload, scale = ctx, payload, 1.0
                if of is not None:
                    version, scale, key = of[c]
                    mine_ctx = replace(self.context(version, ctx.phase, ctx.participants), round=key)
                    mine_payload = {k.split("/", 1)[1]: v for k, v in payload.items()
                                    if k.startswith(f"{version}/")}
                mine_payload = self.prepare(mine_payload, states.get(c))   # private layers
                task = self.make_task(c, mine_ctx, p)
                upload = self.alg.local_update(task, mine_payload, state, mine_ctx)
                if after_client is not None:   # sees the client's local model before it is reloaded
                    aside += after_client(c, upload)
                fold(c, upload, time.perf_counter() - t0, scale)
        if self.make_root is not None:   # the rule's own update on the server's root set
            aggregator.train_reference(
                lambda: self.alg.local_update(self.make_root(ctx, p), payload, None, ctx))
        table = np.asarray(rows, dtype=np.float64).reshape(-1, self.row_width(ctx.phase))
        return table, new_states, aside

    def train_groups(self, mine, payload, states, ctx, p, fold) -> None:
        """This worker's client groups (plan.groups of the phase's participants: the
        units ``place`` gave it), each in one ``local_update_group``; a group's seconds
        are shared equally by its clients' rows."""
        own = set(mine.tolist())
        for unit in groups(np.asarray(ctx.participants, dtype=np.int64), self.steps, self.group):
            clients = unit.tolist()
            if clients[0] not in own:
                continue
            t0 = time.perf_counter()
            tasks = [self.make_task(c, ctx, p) for c in clients]
            client_states = [None if states.get(c) is None else
                             {k: torch.from_numpy(v).to(self.device) for k, v in states[c].items()
                              if k in self.alg_states}
                             for c in clients]
            # each client's start through the stages (private layers: its merged model;
            # one shared x where every client starts from the same)
            starts = [self.prepare(payload, states.get(c))["x"] for c in clients]
            x = starts[0] if all(v is starts[0] for v in starts) else torch.stack(starts)
            group_payload = payload if x is payload["x"] else {**payload, "x": x}
            uploads = self.alg.local_update_group(tasks, group_payload, client_states, ctx)
            seconds = (time.perf_counter() - t0) / len(clients)
            for c, upload in zip(clients, uploads):
                self.prepare(payload, states.get(c))   # the stages split what c trained from
                fold(c, upload, seconds)

    def prepare(self, payload: dict, state) -> dict:
        """``payload`` through every stage's prepare for a client of ``state`` (the
        private layers' merge)."""
        for stage in self.stages:
            payload = stage.prepare(payload, state)
        return payload

    def client_row(self, c, upload, seconds, phase: str) -> np.ndarray:
        """The ROW values, then the fields the algorithm gathers in this phase."""
        gathered = self.alg.gather(upload)
        extras = [gathered[k].detach().reshape(-1).double().cpu().numpy()
                  for k in self.alg.gather_sizes(self.d, phase)]
        head = [c, self.comm.rank, upload.num_samples, upload.steps, upload.loss,
                float(torch.linalg.vector_norm(upload.delta)), seconds]
        return np.concatenate([head] + extras)

    def row_width(self, phase: str) -> int:
        return len(ROW) + sum(self.alg.gather_sizes(self.d, phase).values())

    def unused_columns(self, phase: str, n: int) -> dict:
        """NaN for the /clients fields other phases gather: every phase's rows have every
        column of the file."""
        used = self.alg.gather_sizes(self.d, phase)
        return {name: np.full((n, size) if size > 1 else n, math.nan)
                for name, size in self.alg.gather_sizes(self.d).items() if name not in used}

    def empty(self, p: int, phase: str) -> PhaseResult:
        """The server's result of a phase nobody took part in: no sums, no rows, no
        server_update (the global model and the server state stay as they are)."""
        gathered = self.columns(np.zeros((0, self.row_width(phase))), phase)
        rows = {**self.unused_columns(phase, 0), **gathered, "phase": np.full(0, p),
                "bytes_down": np.full(0, 0), "bytes_up": np.full(0, 0)}
        return PhaseResult({}, gathered, self.summarize(p, {}, gathered), rows)

    def collect_rows(self, rows, phase: str) -> dict | None:
        parts = self.comm.gatherv(rows.reshape(-1))
        if not self.comm.is_server:
            return None
        return self.columns(np.concatenate(parts).reshape(-1, self.row_width(phase)), phase)

    def columns(self, table: np.ndarray, phase: str) -> dict:
        """A gathered table (one ROW + gathered fields per client) as named columns, in
        client order."""
        table = table[np.argsort(table[:, 0], kind="stable")]
        out = {name: table[:, i] for i, name in enumerate(ROW)}
        col = len(ROW)
        for name, size in self.alg.gather_sizes(self.d, phase).items():
            out[name] = table[:, col:col + size].squeeze(1) if size == 1 else table[:, col:col + size]
            col += size
        return out

    # ---- client state: kept on the server's host, shipped to whoever trains the client --
    def scatter_states(self, assignment) -> dict:
        """Each worker's clients' states from the server's store, as flat buffers (the
        store's arrays sent as they are, received into one array a worker)."""
        if not self.state_sizes:
            return {}
        if self.comm.size == 1:
            return {c: self.store.get(c) for c in assignment[0].tolist()}
        parts = [[] for _ in range(self.comm.size)]
        if self.comm.is_server:
            for w, a in enumerate(assignment):
                parts[w + 1] = pieces((self.store.get(c) for c in a.tolist()), self.state_sizes)
        got = self.comm.alltoallv(parts)[0]   # host arrays: device_states moves them
        return unpack(got, assignment[self.comm.worker_index].tolist(), self.state_sizes) \
            if self.comm.is_worker else {}

    def device_states(self, clients: list[int], states: dict):
        """(client, its state on the device) in training order. Only one client's state
        is on the GPU at a time (with ResNet-18 a stateful method's state is ~45 MB a
        client): on CUDA the next client's state is copied from pinned memory on a side
        stream while the current client trains."""
        def own(c):   # the algorithm's state (the codecs' error feedback is the runtime's)
            s = states.get(c)
            return None if s is None or not self.alg_states else \
                {k: v for k, v in s.items() if k in self.alg_states}

        if self.device.type != "cuda":
            for c in clients:
                s = own(c)
                yield c, None if s is None else {k: torch.from_numpy(v) for k, v in s.items()}
            return
        stream = torch.cuda.Stream(self.device)

        def issue(c):
            s = own(c)
            if s is None:
                return None
            with torch.cuda.stream(stream):
                return {k: torch.from_numpy(v).pin_memory().to(self.device, non_blocking=True)
                        for k, v in s.items()}

        pending = issue(clients[0]) if clients else None
        for i, c in enumerate(clients):
            current, compute = pending, torch.cuda.current_stream(self.device)
            compute.wait_stream(stream)
            for tensor in (current or {}).values():
                tensor.record_stream(compute)   # freed only after the training that uses it
            pending = issue(clients[i + 1]) if i + 1 < len(clients) else None
            yield c, current

    def gather_states(self, new_states) -> None:
        """The workers' new states into the store, in rank then training order, as flat
        buffers (ids, then the states back to back)."""
        if not self.state_sizes:
            return
        if self.comm.size == 1:
            parts = [new_states]
        else:
            ids, flat = pack(new_states, self.state_sizes)
            clients, values = self.comm.gatherv(ids), self.comm.gatherv(flat)
            parts = [] if not self.comm.is_server else \
                [unpack(v, c, self.state_sizes) for c, v in zip(clients, values)]
        for part in parts:
            for c, s in part.items():
                self.store.put(c, s)


def round_context(config, t, phase, participants) -> algorithms.RoundContext:
    tr = config.train
    lr = schedule.round_lr(tr, t, config.rounds)
    return algorithms.RoundContext(
        round=t, phase=phase, lr=lr, lr_prev=schedule.previous_lr(tr, t, config.rounds, lr),
        global_lr=tr.global_lr,
        weight_decay=tr.weight_decay, local_epochs=tr.local_epochs,
        # DP-SGD clips each sample's gradient; the noised step is not clipped again
        grad_clip=0.0 if config.privacy.mechanism == "sample" else tr.grad_clip,
        batch_size=tr.batch_size, num_clients=config.clients.num,
        participants=tuple(int(c) for c in participants), seed=config.seed,
        momentum=tr.momentum, nesterov=tr.nesterov, local_schedule=tr.local_schedule,
        local_decay=tr.local_decay, local_warmup=tr.local_warmup, optimizer=tr.optimizer,
        adam_betas=(float(tr.adam_betas[0]), float(tr.adam_betas[1])), adam_eps=tr.adam_eps)
