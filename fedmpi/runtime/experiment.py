"""One experiment, run by every rank: setup, then the round below.

The same code runs on every rank (SPMD); ``comm.is_server`` and ``comm.is_worker`` say
which half of each step a rank does. A single process is both, and its collectives are
identities, so ``fedmpi run`` without mpirun is the same program as an MPI run.

A round, numbered as in ``_round``:

1. sample: the server draws S_t (keyed by seed and round; the same for any layout) by
   ``clients.sampling``; a Bernoulli draw may be empty (``clients.empty_rounds = "skip"``):
   then every phase is empty, nobody trains and the server state stays as it is. With
   ``[system_model]`` on, the virtual clock (fedmpi.runtime.vclock) keeps only the
   clients its round policy lets finish; an asynchronous policy (FedAsync, FedBuff:
   fedmpi.runtime.asyncfl) makes a round one server step: the clients that arrive for
   it, each trained on the model version it downloaded;
2. per phase (fedmpi.runtime.phase): place and announce, broadcast the payload, train,
   reduce the sums and gather the client rows and states, apply the server update;
3. evaluate, on evaluation rounds: workers score test chunks;
4. record: every rank's stats to the server, which writes the round and flushes the file.

Checkpoints, divergence, preemption, progress lines, probes and local spectra are
observers (fedmpi.runtime.observers) called at named points around these steps. Before
the first round of a fresh run (``eval.at_start``), step 3 alone scores the initial model:
the row ``round = 0``.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch

from .. import algorithms, signals
from ..algorithms import group_sgd, local_sgd
from ..config.validate import group_refusal
from ..errors import (ALONE_AFTER, UsageError, ended_within, out_of_memory, out_of_memory_message,
                      storage_full, storage_full_message, warn)
from ..results.writer import FileReplacedError
from .observers import RoundRecord, default_observers
from .observers.divergence import DIVERGED
from .observers.preemption import EXIT_PREEMPTED, PREEMPTED
from .phase import Contributions, Phases, StopRun, round_context, sum_in_client_order
from .plan import GROUP_MEMORY_CPU, group_size, sample_clients
from .records import (CLIENT_FIELDS, RANK_FIELDS, ROUND_FIELDS, Timers, Traffic, client_columns,
                      gather_ranks, rank_columns, round_row, start_row, unrecorded)
from .rng import key_seed, seed_global
from .runfile import create_file, resume_file
from .scoring import evaluate
from .state import ClientStateStore
from .stats import update_statistics
from .system import kernels_warning, numerics
from .asyncfl import MODES as ASYNC_MODES, AsyncServer
from .compression import Compression
from .vclock import (VirtualClock, dropped_rows, sample_available, selection_size,
                     virtual_columns)
from .world import build_world, eval_batch_size, rank_info, rank_table, same_config, same_software

__all__ = ["CLIENT_FIELDS", "EXIT_PREEMPTED", "RANK_FIELDS", "ROUND_FIELDS", "Contributions",
           "Experiment", "StopRun", "eval_batch_size", "rank_table", "sum_in_client_order"]


def group_memory(device: torch.device) -> int:
    """Bytes a client group may take on ``device``: GROUP_MEMORY_CPU on a CPU, a quarter of
    what is free on a GPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 4
    return GROUP_MEMORY_CPU


class Experiment:
    def __init__(self, config, comm, *, force: bool = False, quiet: bool = False,
                 resume: bool = False, observers=None):
        self.config, self.comm = config, comm
        self.force, self.quiet, self.resume = force, quiet, resume
        self.alg = algorithms.build(config.algorithm.name, config.algorithm.params)
        self.observers = default_observers(quiet) if observers is None else observers
        self.writer = None
        self.lock = None     # server: the results file's lock, held for the whole run
        self.stop = None     # why the server stops the run: DIVERGED or PREEMPTED
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
        # Placement balances local steps, which is what training time is proportional to.
        self.steps = -(-self.sizes // cfg.train.batch_size)
        self.group = self._client_group()
        if self.group > 1 and comm.is_worker:
            group_sgd.warm_up(self.flat, self.autocast)
        self.ranks = comm.gather_obj(rank_info(comm, world), count=False)
        warning = kernels_warning(self.ranks) if comm.is_server and cfg.system.deterministic else None
        if warning:   # said with or without --quiet: it is about the results, not progress
            warn(warning)
        self.codecs = Compression(cfg, self.alg, self.d)
        measured = self._measure_step_time() if cfg.system_model.profiles != "off" and \
            cfg.system_model.measure_step_time and not self.resume else None   # a resume: the file's
        self.clock = VirtualClock(cfg, self.codecs.message_bytes(self.d, self.alg.phases[0]),
                                  self.sizes if cfg.system_model.step_unit == "sample" else self.steps) \
            if comm.is_server and cfg.system_model.profiles != "off" else None
        if measured is not None and self.clock is not None:
            self.clock.step_time = measured
        self.vplan = None   # the server's virtual-clock plan of the current round
        self.asynchronous = None   # the server's FedAsync/FedBuff schedule and versions
        if self.clock is not None and cfg.system_model.policy in ASYNC_MODES:
            self.asynchronous = AsyncServer(cfg, self.clock)
        if comm.is_server:
            self.eval_batch = eval_batch_size(cfg.eval.batch_size, [r["device"] for r in self.ranks])
            self.state = self.alg.init_server_state(self.flat.params.detach().cpu().clone())
            self.store = ClientStateStore(self.state_sizes(),
                                          memory_bytes=cfg.system.state_memory_mb * 2 ** 20,
                                          directory=cfg.system.state_dir)
            evaluated = resume_file(self, world.dataset, self.ranks) if self.resume else \
                create_file(self, world.dataset, self.ranks)
            # round 0 once per run: not after a checkpoint, nor again when a run stopped
            # before its first checkpoint already wrote it (its resume keeps the row)
            self.at_start = cfg.eval.at_start and self.start == 0 and not evaluated
        self.start, self.eval_batch, self.at_start = comm.bcast_obj(
            (self.start, self.eval_batch, self.at_start) if comm.is_server else None)
        if self.asynchronous is not None:
            self.asynchronous.replay(self.start)
        self.phases = Phases(comm, self.alg, self.d, self.device, self.steps,
                             context=partial(round_context, cfg), make_task=self._task,
                             store=self.store, deterministic=cfg.system.deterministic,
                             update_stats=cfg.eval.update_stats, group=self.group,
                             codecs=self.codecs)

    def state_sizes(self) -> dict[str, int]:
        """Each client's persistent state: the algorithm's and the codecs' error feedback."""
        return {**self.alg.client_state_sizes(self.d), **self.codecs.state_sizes()}

    def _measure_step_time(self) -> float | None:
        """``system_model.measure_step_time``: seconds a local step (or a sample, by
        ``step_unit``) of this model and batch size takes on the first worker's device,
        from the client of median size: one local update to warm up, then one timed. The
        server's value, None elsewhere."""
        cfg, comm = self.config, self.comm
        seconds = None
        if comm.is_worker and comm.worker_index == 0:
            c = int(np.argsort(self.steps, kind="stable")[len(self.steps) // 2])
            ctx = round_context(cfg, 0, self.alg.phases[0], [c])
            x = self.flat.params.detach().clone()
            with numerics(self.device, cfg.system.precision, cfg.system.deterministic):
                for _ in range(2):   # the first warms up; the second's time is kept
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    t0 = time.perf_counter()
                    upload = local_sgd.local_update(self._task(c, ctx, 0), x, ctx)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    units = upload.steps if cfg.system_model.step_unit == "step" else \
                        upload.num_samples * cfg.train.local_epochs
                    seconds = (time.perf_counter() - t0) / max(units, 1)
            self.flat.load(x)
        measured = [s for s in comm.gather_obj(seconds, count=False) or [] if s is not None]
        return measured[0] if comm.is_server else None

    def _client_group(self) -> int:
        """``system.client_group`` resolved, the same on every rank ("auto": 1 where groups
        are refused or slower, else by the smallest memory budget of the workers' devices)."""
        cfg, comm, flat = self.config, self.comm, self.flat
        setting = cfg.system.client_group
        buffers = flat.size != flat.num_params
        if setting == "auto" and (buffers or group_refusal(cfg)):
            return 1
        if setting != 1 and buffers:
            raise UsageError("config field system.client_group: the model has float buffers "
                             "(BatchNorm statistics), which a client group cannot carry per "
                             "client; set 1 (one client after another)")
        if setting != "auto":
            return setting
        mine = None
        if comm.is_worker:
            # convolutions that torch.func.vmap differentiates (the model is no chain of
            # plain layers, or the step is bf16), whose grouped kernels lose on a CPU
            vmapped = any(isinstance(m, torch.nn.Conv2d) for m in flat.module.modules()) \
                and not group_sgd.group_model(flat).by_hand(self.autocast)
            mine = (group_memory(self.device), self.device.type == "cpu",
                    torch.get_num_threads(), vmapped)
        workers = [w for w in comm.gather_obj(mine, count=False) or [] if w is not None]
        size = None
        if comm.is_server:
            on_cpu = all(cpu for _, cpu, _, _ in workers)
            one_thread = any(threads == 1 for _, _, threads, _ in workers)
            convolutions = any(v for _, _, _, v in workers)
            size = group_size("auto", self.d, cfg.clients.per_round, comm.num_workers,
                              min(free for free, _, _, _ in workers),
                              sequential_faster=on_cpu and (convolutions or one_thread))
        return comm.bcast_obj(size)

    def _task(self, c, ctx, p) -> algorithms.ClientTask:
        """Client c's data (its stream keyed by seed, round, client, phase) on the model."""
        cfg, t = self.config, ctx.round
        data = self.data.client(self.split.client(c), cfg.seed, t, c, p, skew=self.split.skew(c))
        public = self.data.client(self.public, cfg.seed, t, c, p, split=cfg.data.public_from,
                                  stream="public") if len(self.public) else None
        task = algorithms.ClientTask(client=c, data=data, model=self.flat, device=self.device,
                                     public=public, autocast=self.autocast)
        seed_global(key_seed(cfg.seed, "client", t, c, p), self.device)  # dropout
        return task

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
            self._fail(exc)
            self._release()
            raise
        if not self.comm.is_server:
            return None
        try:
            if self.stop is None:
                self.writer.write_model(self.flat.canonical(self.state["x"]).numpy())
                self.writer.set_status("completed")
            self.writer.close()
        finally:
            self._release()
        return self.config.output_path()

    def _round(self, t: int) -> None:
        comm, cfg = self.comm, self.config
        wall, timers, traffic = time.perf_counter(), Timers(), Traffic()
        x_before = self.state["x"].clone() if comm.is_server else None
        self.diagnostics = {}
        self._notify("before_round", t)
        sampled = self._sample(t)                                                     # 1
        phases = [self._phase(t, p, phase, sampled, timers, traffic)                  # 2
                  for p, phase in enumerate(self.alg.phases)]
        evaluated = (t + 1) % cfg.eval.every == 0 or t == cfg.rounds - 1
        acc, test_loss = evaluate(self, timers) if evaluated else (math.nan, math.nan)  # 3
        self._notify("after_evaluate", t, timers)
        ranks = gather_ranks(comm, timers)                                            # 4
        if comm.is_server:
            rows = [result.rows for result in phases]
            if self.asynchronous is not None:
                self.diagnostics.update(self.asynchronous.columns(rows[0]))
                self.asynchronous.done()
            elif self.clock is not None:
                later = [(r, *self.codecs.message_bytes(self.d, phase))
                         for r, phase in zip(rows[1:], self.alg.phases[1:])]
                self.diagnostics.update(virtual_columns(self.vplan, rows[0], self.clock, later))
            row = round_row(cfg, t, wall, timers, ranks, rows, traffic, acc, test_loss,
                            self.state["x"], x_before, self.diagnostics, comm.size > 1)
            dropped = dropped_rows(self.vplan, self.sizes) \
                if self.clock is not None and self.asynchronous is None else None
            self._record(t + 1, row, ranks, rows + [dropped] * (dropped is not None))

    def _sample(self, t: int):
        """S_t: slots drawn by ``clients.sampling`` (size: weighted by the sample counts of
        the clients that hold the slots in round t), then the identities in those slots.
        With ``system_model.availability``, the draw is among the slots whose identity is
        available in round t (all of them when fewer than needed are)."""
        cfg, c = self.config, self.config.clients
        if not self.comm.is_server:
            return None
        if self.asynchronous is not None:   # the clients that arrive for this server step
            return self.asynchronous.step(self.state["x"])
        sizes = self.sizes[self.split.active(t)] if c.sampling == "size" else None
        per_round = c.per_round if self.clock is None else selection_size(
            cfg.system_model.policy, c.per_round, cfg.system_model.overselect, c.num)
        available = None if self.clock is None else self.clock.available(t)
        if available is None:
            slots = sample_clients(cfg.seed, t, c.num, per_round, c.sampling, sizes=sizes,
                                   empty=c.empty_rounds)
            n_available = c.num
        else:
            pool = np.flatnonzero(available[self.split.active(t)])   # available slots
            slots = sample_available(cfg.seed, t, pool, per_round, c.sampling, sizes=sizes,
                                     empty=c.empty_rounds)
            n_available = len(pool)
        sampled = self.split.sample(slots, t)
        if not self.sizes[sampled].any():
            # every client drawn holds no training sample (partition.min_size = 0): none can
            # train, and a mean weighted by their sample counts is 0/0. The round trains
            # nobody, as an empty draw that is skipped (clients.empty_rounds = "skip").
            sampled = sampled[:0]
        if self.clock is None:
            return sampled
        # who finishes in time (and does not drop out): only they train
        self.vplan = self.clock.round(sampled, t, n_available)
        return sampled[self.vplan["keep"]]

    def _phase(self, t, p, phase, sampled, timers, traffic):
        """One phase over the comm (fedmpi.runtime.phase); the server keeps its diagnostics."""
        hook = next(filter(None, (o.client_hook(self, t, p) for o in self.observers)), None)
        versions = self.asynchronous.versions(self.state) \
            if self.asynchronous is not None else None
        result = self.phases.run(self.state, t, p, phase, sampled, timers, traffic,
                                 stop=self.stop, after_client=hook, versions=versions)
        if result is not None:
            if p == 0:
                self.diagnostics.update(update_statistics(result.gathered["update_norm"], *result.stats))
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
        acc, test_loss = evaluate(self, timers)
        ranks = gather_ranks(comm, timers)
        if comm.is_server:
            row = start_row(wall, timers, ranks, acc, test_loss)
            if self.clock is not None:   # the clock starts with the run
                row.update(virtual_time=0.0, n_dropped=0, dropped_bytes_down=0.0,
                           n_available=math.nan)   # nobody is sampled in round 0
            self._record(0, row, ranks, [])

    def _record(self, round_: int, row: dict, ranks: np.ndarray, rows: list[dict]) -> None:
        """Server: the round into the file, flushed (every completed round is on disk),
        then the observers' after_round (divergence, checkpoint, preemption, progress)."""
        self.writer.append_round(row)
        self.writer.append_ranks(rank_columns(round_, ranks))
        for gathered in rows:
            self.writer.append_clients({"round": np.full(len(gathered["client"]), round_),
                                        **client_columns(gathered, unrecorded(self.alg, self.d))})
        self.writer.flush()
        self._notify("after_round", RoundRecord(round_, row, ranks))

    def _notify(self, hook: str, *args) -> None:
        for observer in self.observers:
            getattr(observer, hook)(self, *args)

    # ---- the end ------------------------------------------------------------------------
    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @property
    def diverged(self) -> bool:
        return self.stop == DIVERGED

    @property
    def preempted(self) -> bool:
        return self.stop == PREEMPTED

    def _fail(self, exc: BaseException) -> None:
        if self.store is not None:
            self.store.close()
        full = storage_full(exc)
        if self.writer is not None:
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            try:
                try:
                    self.writer.set_status(status, error=f"{type(exc).__name__}: {exc}")
                except FileReplacedError:
                    pass   # not our file any more: leave it alone
                self.writer.close()
            except (OSError, RuntimeError):
                if full is None:
                    raise
                # the disk is full: the status cannot be written either; the file, left
                # open, is recovered by --resume like a killed run's
            self.writer = None
        if self.comm.size > 1:
            self._release()   # before the abort, which ends this process: no lock file left
            oom = None if full else out_of_memory(exc)
            if isinstance(exc, UsageError) or full or oom:  # one line: exit 2 (bad input) or 1
                # in setup every rank meets the same error: the server speaks for all; memory
                # runs out on a rank of its own (a GPU worker), which says which
                if oom:
                    warn(f"fedmpi: rank {self.comm.rank}: {out_of_memory_message(oom)}")
                elif self.comm.is_server or self.ready:
                    message = storage_full_message(full) if full else exc
                    warn(f"fedmpi: {message}")
                elif not ended_within(ALONE_AFTER):
                    # the server's abort ends the job: aborting first could take the server
                    # before it spoke; an error still unsaid by then was this rank's alone
                    warn(f"fedmpi: rank {self.comm.rank}: {exc}")
                self.comm.abort(2 if isinstance(exc, UsageError) else 1)
            traceback.print_exc()
            sys.stderr.flush()
            self.comm.abort(1)


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
