"""One experiment, run by every rank: setup, then the round below.

The same code runs on every rank (SPMD); ``comm.is_server`` and ``comm.is_worker`` say
which half of each step a rank does. A single process is both, and its collectives are
identities, so ``fedmpi run`` without mpirun is the same program as an MPI run.

A round, numbered as in ``_round``:

1. select: the participation stage (fedmpi.runtime.participation: Sync, Clocked or
   Async) names the clients of this server step, keyed by seed and round (the same for
   any layout); an empty selection (``clients.empty_rounds = "skip"``) empties every
   phase: nobody trains and the server state stays as it is;
2. per phase (fedmpi.runtime.phase): place and announce, broadcast the payload, train,
   each upload through the client stages (fedmpi.runtime.stages) into the phase's
   aggregator (fedmpi.runtime.aggregate), reduce, apply the server update;
3. evaluate, on evaluation rounds: workers score test chunks;
4. record: every rank's stats to the server, the participation's columns and rows,
   written and flushed.

Checkpoints, divergence, preemption, progress lines, probes and local spectra are
observers (fedmpi.runtime.observers) called at named points around these steps. Before
the first round of a fresh run (``eval.at_start``), step 3 alone scores the initial model:
the row ``round = 0``.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np

from .. import algorithms, signals
from ..algorithms import group_sgd
from ..errors import warn
from . import robust
from .compression import Compression
from .failure import fail
from .grouping import client_group
from .observers import RoundRecord, default_observers
from .observers.divergence import DIVERGED
from .observers.preemption import EXIT_PREEMPTED, PREEMPTED
from .partial import private_stage
from .participation import measure_step_time, participation
from .phase import Phases, StopRun, round_context
from .poison import poisoning
from .records import (CLIENT_FIELDS, RANK_FIELDS, ROUND_FIELDS, Timers, Traffic, client_columns,
                      gather_ranks, rank_columns, round_row, start_row, unrecorded)
from .rng import key_seed, seed_global
from .runfile import create_file, recorded_group, resume_file
from .scoring import evaluator
from .dp import calibrate_sample, private_steps, server_stages
from .stages import client_stages
from .state import ClientStateStore
from .system import kernels_warning, numerics
from .world import build_world, eval_batch_size, rank_info, rank_table, same_config, same_software

__all__ = ["CLIENT_FIELDS", "EXIT_PREEMPTED", "RANK_FIELDS", "ROUND_FIELDS", "Experiment",
           "StopRun", "eval_batch_size", "rank_table"]


class Experiment:
    def __init__(self, config, comm, *, force: bool = False, quiet: bool = False,
                 resume: bool = False, observers=None):
        self.config, self.comm = config, comm
        self.force, self.quiet, self.resume = force, quiet, resume
        self.alg = algorithms.build(config.algorithm.name, config.algorithm.params)
        self.evaluator = evaluator(self.alg)
        self.observers = default_observers(quiet) if observers is None else observers
        self.writer = None
        self.lock = None     # server: the results file's lock, held for the whole run
        self.stop = None     # why the server stops the run: DIVERGED, PREEMPTED, PRUNED;
                             # "failed" once an error ended it (for on_end)
        self.start = 0       # first round to run (after a checkpoint's completed rounds)
        self.at_start = False  # evaluate the initial model first (round 0; eval.at_start)
        self.ready = False   # setup done: from here an error may be one rank's alone
        self.state = self.store = self.eval_batch = None   # server state; workers have none

    # ---- setup ------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, comm = self.config, self.comm
        same_software(comm)
        same_config(comm, cfg)
        world = build_world(cfg, comm, self.alg)
        self.threads, self.device, self.autocast = world.threads, world.device, world.autocast
        self.flat, self.d, self.data, self.split = world.flat, world.d, world.data, world.split
        self.num_classes, self.test_y = world.dataset.num_classes, world.dataset.test_y
        self.public, self.sizes = self.split.public, self.split.sizes
        calibrate_sample(cfg, self.sizes)
        self.evaluator = evaluator(self.alg, cfg, self.split)
        self.poisoning = poisoning(cfg, world.dataset, self.device, self.alg.supervised)
        self.root = robust.root_set(cfg, world.dataset.train_y.numpy()) \
            if cfg.robust.aggregator == "fltrust" else np.zeros(0, dtype=np.int64)
        # Placement balances local steps, which is what training time is proportional to.
        self.steps = -(-self.sizes // cfg.train.batch_size)
        self.group, self.group_probe = client_group(
            cfg, comm, self.flat, self.d, self.device, self.autocast,
            sample=(tuple(world.dataset.train_x.shape[1:]), world.dataset.num_classes),
            recorded=recorded_group(cfg.output_path()) if self.resume and comm.is_server else None)
        if self.group > 1 and comm.is_worker:
            group_sgd.warm_up(self.flat, self.autocast)
        self.ranks = comm.gather_obj(rank_info(comm, world), count=False)
        warning = kernels_warning(self.ranks) if comm.is_server and cfg.system.deterministic else None
        if warning:   # said with or without --quiet: it is about the results, not progress
            warn(warning)
        # what travels: the shared coordinates (fedmpi.runtime.partial), d of them
        # without private layers
        private = private_stage(self.alg, self.flat)
        self.wire = private.mask.d_shared if private else self.d
        self.codecs = Compression(cfg, self.alg, self.wire)
        self.phases = Phases(comm, self.alg, self.wire, self.device, self.steps,
                             context=partial(round_context, cfg), make_task=self.task,
                             deterministic=cfg.system.deterministic, group=self.group,
                             codecs=self.codecs, stages=client_stages(cfg, self.codecs, private),
                             server_stages=server_stages(cfg, self.wire, self.flat.params,
                                                         self.sizes, private and private.mask.shared),
                             config=cfg,
                             make_root=self.root_task if len(self.root) else None)
        measured = measure_step_time(self, partial(round_context, cfg)) \
            if cfg.system_model.profiles != "off" and cfg.system_model.measure_step_time \
            and not self.resume else None   # a resume: the file's
        self.participation = participation(self, measured)
        if comm.is_server:
            self.eval_batch = eval_batch_size(cfg.eval.batch_size, [r["device"] for r in self.ranks])
            self.state = self.alg.init_server_state(self.flat.params.detach().cpu().clone())
            self.store = self.phases.store = ClientStateStore(
                self.state_sizes(), memory_bytes=cfg.system.state_memory_mb * 2 ** 20,
                directory=cfg.system.state_dir)
            evaluated = resume_file(self, world.dataset, self.ranks) if self.resume else \
                create_file(self, world.dataset, self.ranks)
            # round 0 once per run: not after a checkpoint, nor again when a run stopped
            # before its first checkpoint already wrote it (its resume keeps the row)
            self.at_start = cfg.eval.at_start and self.start == 0 and not evaluated
        self.start, self.eval_batch, self.at_start = comm.bcast_obj(
            (self.start, self.eval_batch, self.at_start) if comm.is_server else None)
        self.participation.begin(self.start)

    @property
    def clock(self):
        """The server's virtual clock (``[system_model]``), or None."""
        return self.participation.clock

    def state_sizes(self) -> dict[str, int]:
        """Each client's persistent state: the algorithm's and the client stages'."""
        return self.phases.state_sizes

    def task(self, c, ctx, p) -> algorithms.ClientTask:
        """Client c's data (its stream keyed by seed, round, client, phase) on the model."""
        cfg, t = self.config, ctx.round
        indices = self.split.client(c)
        data = self.data.client(indices, cfg.seed, t, c, p, skew=self.split.skew(c),
                                poison=self.poisoning and self.poisoning.client(c, indices))
        public = self.data.client(self.public, cfg.seed, t, c, p, split=cfg.data.public_from,
                                  stream="public") if len(self.public) else None
        task = algorithms.ClientTask(client=c, data=data, model=self.flat, device=self.device,
                                     public=public, autocast=self.autocast,
                                     private=private_steps(cfg, (t, c, p)))
        seed_global(key_seed(cfg.seed, "client", t, c, p), self.device)  # dropout
        return task

    def root_task(self, ctx, p) -> algorithms.ClientTask:
        """FLTrust's root update: the method's local update on the server's root set
        (fedmpi.runtime.robust.root_set), its own keyed stream, no client state."""
        cfg, t = self.config, ctx.round
        data = self.data.client(self.root, cfg.seed, t, robust.ROOT_CLIENT, p, stream="root")
        seed_global(key_seed(cfg.seed, "client", t, robust.ROOT_CLIENT, p), self.device)
        return algorithms.ClientTask(client=robust.ROOT_CLIENT, data=data, model=self.flat,
                                     device=self.device, public=None, autocast=self.autocast)

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> Path | None:
        """Set up and run every round; returns the results path on the server."""
        try:
            with _preemption_signals():
                self.setup()
                self.ready = True
                s = self.config.system
                with numerics(self.device, s.precision, s.deterministic):
                    self._notify("on_setup")
                    if self.at_start:
                        self._evaluate_start()
                    for t in range(self.start, self.config.rounds):
                        self._round(t)
        except StopRun as stop:
            self.stop = stop.reason
        except BaseException as exc:
            fail(self, exc)
            self.release()
            if self.comm.is_server:
                self.stop = self.stop or "failed"
                self._notify("on_end")
            raise
        if not self.comm.is_server:
            return None
        try:
            if self.stop is None:
                self.writer.write_model(self.flat.canonical(self.state["x"]).numpy())
                self.writer.set_status("completed")
            self.writer.close()
        finally:
            self.release()
        self._notify("on_end")
        return self.config.output_path()

    def _round(self, t: int) -> None:
        comm, cfg = self.comm, self.config
        wall, timers, traffic = time.perf_counter(), Timers(), Traffic()
        x_before = self.state["x"].clone() if comm.is_server else None
        self.diagnostics = {}
        self._notify("before_round", t)
        sampled = self.participation.select(t, self.state) if comm.is_server else None  # 1
        phases = [self._phase(t, p, phase, sampled, timers, traffic)                  # 2
                  for p, phase in enumerate(self.alg.phases)]
        evaluated = (t + 1) % cfg.eval.every == 0 or t == cfg.rounds - 1
        acc, test_loss = self.evaluator.evaluate(self, timers, t + 1) if evaluated \
            else (math.nan, math.nan)                                                 # 3
        columns, tables = self.evaluator.take()
        self.diagnostics.update(columns)
        self._notify("after_evaluate", t, timers)
        ranks = gather_ranks(comm, timers)                                            # 4
        if comm.is_server:
            rows = [result.rows for result in phases]
            columns, more = self.participation.record(rows)
            self.diagnostics.update(columns)
            row = round_row(cfg, t, wall, timers, ranks, rows, traffic, acc, test_loss,
                            self.state["x"], x_before, self.diagnostics, comm.size > 1)
            self._record(t + 1, row, ranks, rows + more, tables)

    def _phase(self, t, p, phase, sampled, timers, traffic):
        """One phase over the comm (fedmpi.runtime.phase); the server keeps its diagnostics."""
        hook = next(filter(None, (o.client_hook(self, t, p) for o in self.observers)), None)
        versions = self.participation.versions(self.state) if self.comm.is_server else None
        result = self.phases.run(self.state, t, p, phase, sampled, timers, traffic,
                                 stop=self.stop, after_client=hook, versions=versions)
        if result is not None:
            self.diagnostics.update(result.diagnostics)
        return result

    def _evaluate_start(self) -> None:
        """Round 0 (eval.at_start): the initial global model, evaluated as an evaluation
        round does (no training, no probes), written as the row ``round = 0``. Its ledger
        take closes start-up: the start-up's collectives count here, not in round 1. A
        signal during it stops the run after the row, as one during a round does."""
        comm = self.comm
        stop = comm.bcast_obj(self.stop if comm.is_server else None)  # signalled in start-up
        if stop:
            raise StopRun(stop)
        wall, timers = time.perf_counter(), Timers()
        acc, test_loss = self.evaluator.evaluate(self, timers, 0)
        columns, tables = self.evaluator.take()
        ranks = gather_ranks(comm, timers)
        if comm.is_server:
            row = {**start_row(wall, timers, ranks, acc, test_loss),
                   **self.participation.start_columns(), **columns}
            self._record(0, row, ranks, [], tables)

    def _record(self, round_: int, row: dict, ranks: np.ndarray, rows: list[dict],
                tables: dict) -> None:
        """Server: the round into the file, flushed (every completed round is on disk),
        then the observers' after_round (divergence, checkpoint, preemption, progress)."""
        self.writer.append_round(row)
        self.writer.append_ranks(rank_columns(round_, ranks))
        for gathered in rows:
            self.writer.append_clients({"round": np.full(len(gathered["client"]), round_),
                                        **client_columns(gathered, unrecorded(self.alg, self.wire))})
        for name, table in tables.items():   # the evaluator stages' rows (/client_eval)
            self.writer.append_table(name, table)
        self.writer.flush()
        self._notify("after_round", RoundRecord(round_, row, ranks))

    def _notify(self, hook: str, *args) -> None:
        for observer in self.observers:
            getattr(observer, hook)(self, *args)

    # ---- the end ------------------------------------------------------------------------
    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @property
    def diverged(self) -> bool:
        return self.stop == DIVERGED

    @property
    def preempted(self) -> bool:
        return self.stop == PREEMPTED


@contextmanager
def _preemption_signals():
    """Listen for preemption while the experiment runs (``fedmpi run`` already does from
    its start, so a signal during start-up counts); the request is cleared when the
    experiment ends, so it never carries over to the next one in this process."""
    previous = signals.install()
    try:
        yield
    finally:
        signals.restore(previous)
        signals.clear()
