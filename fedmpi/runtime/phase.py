"""One phase of a round over any comm: the protocol every algorithm runs through.

The runtime runs it over MPI or in one process; the test harness runs the same code over
``LocalComm`` with closed-form clients, so algorithm tests check the runtime's ordering.

1. announce: server picks the participants, places them, broadcasts plan + payload;
2. train: workers train their clients and fold contributions in as they come;
3. reduce: the server gets the sum (one Reduce, or in client order if deterministic),
   the per-client rows (client order) and the new client states;
4. update: the server applies the algorithm's update.
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
from ..flat import host_vector
from . import gram
from .asyncfl import Versions
from .compression import Compression
from .plan import groups, place
from .records import Timers, Traffic
from .stats import STAT_SIZES_KEYS, stat_contribution

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
    stats: list          # the update statistics' two sums (first phase, eval.update_stats)
    diagnostics: dict
    rows: dict           # gathered + phase, bytes_down, bytes_up


@dataclass
class Phases:
    """What a phase needs from the world. ``make_task(c, ctx, p)``: client c's ClientTask;
    ``store``: the server's client states (get/put); ``steps``: placement weights."""
    comm: object
    alg: object
    d: int
    device: torch.device
    steps: np.ndarray
    context: Callable       # (t, phase, participants) -> RoundContext
    make_task: Callable
    store: object = None
    deterministic: bool = False
    update_stats: bool = False
    group: int = 1          # system.client_group, resolved: clients trained in lock-step
    codecs: Compression | None = None   # the run's codecs; None: no compression
    gram_space: gram.Workspace = field(default_factory=gram.Workspace)   # kept across rounds

    def __post_init__(self):
        if self.codecs is None:
            self.codecs = Compression(None, self.alg, self.d)
        # the client states: the algorithm's, then the codecs' error feedback
        self.alg_states = self.alg.client_state_sizes(self.d)
        self.state_sizes = {**self.alg_states, **self.codecs.state_sizes()}

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
        folded, rows, new_states, vectors, aside = self.train(                          # 2
            assignment, payload, states, ctx, p, after_client, of)
        timers.eval += aside
        timers.compute += time.perf_counter() - t0 - aside
        sums = self.collect_sums(folded, assignment, p)                                 # 3
        if alg.gram_weighted(phase):
            t0 = time.perf_counter()
            combined, _ = gram.weighted_sum(comm, vectors, assignment, self.d,
                                            lambda inner: alg.gram_coefficients(inner, ctx),
                                            workspace=self.gram_space)
            timers.aggregate += time.perf_counter() - t0
            if comm.is_server:
                sums["delta"] = combined
        gathered = self.collect_rows(rows, phase)
        self.gather_states(new_states)
        if not comm.is_server:
            return None
        stats = [sums.pop(key) for key in STAT_SIZES_KEYS if key in sums] if p == 0 else []
        t0 = time.perf_counter()
        update = versions.update if versions is not None and versions.update else alg.server_update
        update(state, sums, gathered, ctx)                                              # 4
        timers.aggregate += time.perf_counter() - t0
        diagnostics = alg.diagnostics(state, sums, gathered, ctx)
        down, up = self.codecs.message_bytes(self.d, phase)
        n = len(participants)
        traffic.add(down, up, n)
        rows = {**self.unused_columns(phase, n), **gathered, "phase": np.full(n, p),
                "bytes_down": np.full(n, down), "bytes_up": np.full(n, up)}
        return PhaseResult(sums, gathered, stats, diagnostics, rows)

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
                    payload = self.codecs.download(
                        self.alg.payload(state, self.context(t, phase, participants)))
                else:
                    payload = {f"{v}/{k}": tensor for v, s in sorted(versions.states.items())
                               for k, tensor in self.codecs.download(self.alg.payload(
                                   s, self.context(v, phase, participants))).items()}
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

    def sizes(self, p: int) -> dict[str, int]:
        """What is summed in phase p: the algorithm's contributions, plus the update
        statistics' two vectors in the first phase when ``eval.update_stats`` is on."""
        sizes = dict(self.alg.contribution_sizes(self.d, self.alg.phases[p]))
        if p == 0 and self.update_stats:
            sizes.update({key: self.d for key in STAT_SIZES_KEYS})
        return sizes

    def train(self, assignment, payload, states, ctx, p, after_client=None, of=None):
        """Train this worker's clients, folding each contribution in as it comes (client
        groups: a group's at the end of the group). ``of`` (asynchronous FL): client ->
        (model version, the scale of its contribution's delta, the round key of its data):
        each trains on its version's payload with that version's round lr."""
        sizes = self.sizes(p)
        folded = Contributions(sizes, self.device, keep_each=self.deterministic)
        rows, new_states, vectors, aside = [], {}, {}, 0.0
        keep = self.alg.gram_weighted(ctx.phase)
        mine = np.asarray(assignment[self.comm.worker_index] if self.comm.is_worker else [])

        def fold(c, upload, seconds, scale=1.0):
            upload, feedback = self.codecs.upload(upload, states.get(c), (ctx.round, c, p))
            contribution = self.alg.contribution(upload)
            if scale != 1.0:   # a stale update's weight (FedBuff)
                contribution = {**contribution, "delta": contribution["delta"] * scale}
            if STAT_SIZES_KEYS[0] in sizes:
                contribution = {**contribution, **stat_contribution(upload.delta)}
            folded.add(contribution, c)
            if keep:  # the gram path needs each client's update (host memory: K_w d)
                vectors[c] = upload.delta.detach().float().cpu()
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
                task = self.make_task(c, mine_ctx, p)
                upload = self.alg.local_update(task, mine_payload, state, mine_ctx)
                if after_client is not None:   # sees the client's local model before it is reloaded
                    aside += after_client(c, upload)
                fold(c, upload, time.perf_counter() - t0, scale)
        table = np.asarray(rows, dtype=np.float64).reshape(-1, self.row_width(ctx.phase))
        return folded, table, new_states, [vectors[c] for c in sorted(vectors)], aside

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
            uploads = self.alg.local_update_group(tasks, payload, client_states, ctx)
            seconds = (time.perf_counter() - t0) / len(clients)
            for c, upload in zip(clients, uploads):
                fold(c, upload, seconds)

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

    def collect_sums(self, folded: "Contributions", assignment, p: int) -> dict | None:
        """Sum of contributions on the server: one Reduce, or in client order if deterministic."""
        comm, sizes = self.comm, self.sizes(p)
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
        return split(total, list(sizes.items()), torch.device("cpu"))

    def empty(self, p: int, phase: str) -> PhaseResult:
        """The server's result of a phase nobody took part in: no sums, no rows, no
        server_update (the global model and the server state stay as they are)."""
        gathered = self.columns(np.zeros((0, self.row_width(phase))), phase)
        rows = {**self.unused_columns(phase, 0), **gathered, "phase": np.full(0, p),
                "bytes_down": np.full(0, 0), "bytes_up": np.full(0, 0)}
        return PhaseResult({}, gathered, [], {}, rows)

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
        if not self.state_sizes:
            return {}
        parts = None
        if self.comm.is_server:
            per_worker = [{c: self.store.get(c) for c in a.tolist()} for a in assignment]
            parts = per_worker if self.comm.size == 1 else [{}] + per_worker
        return self.comm.scatter_obj(parts)   # host arrays: device_states moves them

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
        if not self.state_sizes:
            return
        parts = self.comm.gather_obj(new_states)
        if self.comm.is_server:
            for part in parts:
                for c, s in part.items():
                    self.store.put(c, s)


def round_context(config, t, phase, participants) -> algorithms.RoundContext:
    tr = config.train
    lr = schedule.round_lr(tr, t, config.rounds)
    return algorithms.RoundContext(
        round=t, phase=phase, lr=lr, lr_prev=schedule.previous_lr(tr, t, config.rounds, lr),
        global_lr=tr.global_lr,
        weight_decay=tr.weight_decay, clip_norm=tr.clip_norm, local_epochs=tr.local_epochs,
        batch_size=tr.batch_size, num_clients=config.clients.num,
        participants=tuple(int(c) for c in participants), seed=config.seed,
        momentum=tr.momentum, nesterov=tr.nesterov, local_schedule=tr.local_schedule,
        local_decay=tr.local_decay, local_warmup=tr.local_warmup, optimizer=tr.optimizer,
        adam_betas=(float(tr.adam_betas[0]), float(tr.adam_betas[1])), adam_eps=tr.adam_eps)


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
