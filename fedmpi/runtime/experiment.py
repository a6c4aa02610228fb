"""One experiment, run by every rank: setup, then the round below.

The same code runs on every rank (SPMD); ``comm.is_server`` and ``comm.is_worker`` say
which half of each step a rank does. A single process is both, and its collectives are
identities, so ``fedmpi run`` without mpirun is the same program as an MPI run.

A round, numbered as in the code:

1. server samples S_t (keyed by seed and round; the same for any layout);
2. per phase: server picks participants, plans placement, broadcasts plan + payload;
3. workers train their clients and pre-aggregate contributions (or keep them per client
   in deterministic mode), server collects sums, per-client rows and client states;
4. server applies the algorithm's update;
5. on evaluation rounds: broadcast the evaluation parameters, workers score test chunks;
6. server writes the round and flushes the file.

Before the first round of a fresh run (``eval.at_start``), step 5 alone scores the initial
model: the row ``round = 0``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from .. import algorithms, signals
from ..data import load_dataset
from ..errors import UsageError
from ..evaluation import (chunks_of, combine, evaluate_chunks, knn_accuracy, knn_worker,
                          spectrum, spectrum_worker)
from ..flat import FlatModel
from ..models import build_model
from ..results import ResultsWriter, RunFile, liveness
from ..results.lock import RunLock
from ..results.writer import FileReplacedError, recover_crashed
from . import gram, probes
from .clientdata import DeviceData
from .federation import federate
from .plan import place, sample_clients
from .rng import key_seed
from .state import ClientStateStore
from .stats import STAT_SIZES_KEYS, stat_contribution, update_statistics
from .system import (autocast_dtype, choose_device, choose_threads, node_workers, numerics,
                     tune_malloc)

ROUND_FIELDS = ["round", "time_wall", "time_compute", "time_compute_min", "time_comm",
                "time_idle", "time_aggregate", "time_eval", "lr", "train_loss", "test_loss",
                "test_acc", "fl_bytes_down", "fl_bytes_up", "mpi_bytes", "n_participants",
                "update_norm", "client_update_norm_mean", "client_update_cosine_mean",
                "local_consistency"]
CLIENT_FIELDS = ["round", "phase", "client", "rank", "n_samples", "steps", "train_loss",
                 "update_norm", "seconds", "bytes_down", "bytes_up"]
RANK_FIELDS = ["round", "rank", "bytes_sent", "bytes_received", "seconds_compute",
               "seconds_idle", "seconds_comm"]
_ROW = ["client", "rank", "n_samples", "steps", "train_loss", "update_norm", "seconds"]
WIRE_BYTES = 4  # float32 on the simulated wire


EXIT_PREEMPTED = 75  # sysexits EX_TEMPFAIL: checkpointed on a signal, resume to continue
_DIVERGED, _PREEMPTED = "diverged", "preempted"


class StopRun(Exception):
    """The server told every rank to stop: divergence, or a preemption signal."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Experiment:
    def __init__(self, config, comm, *, force: bool = False, quiet: bool = False,
                 resume: bool = False):
        self.config, self.comm = config, comm
        self.force, self.quiet, self.resume = force, quiet, resume
        self.alg = algorithms.build(config.algorithm.name, config.algorithm.params)
        self.writer = None
        self.lock = None     # server: the results file's lock, held for the whole run
        self.stop = None     # why the server stops the run: _DIVERGED or _PREEMPTED
        self.start = 0       # first round to run (after a checkpoint's completed rounds)
        self.at_start = False  # evaluate the initial model first (round 0; eval.at_start)
        self.ready = False   # setup done: from here an error may be one rank's alone
        self.local_spectra = {}  # worker: client -> (spectrum of its local model, seconds)

    # ---- setup ------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, comm = self.config, self.comm
        tune_malloc()
        peers = node_workers(comm)
        self.threads = choose_threads(cfg.system.threads, cfg.system.deterministic,
                                      comm.is_worker, comm.size, local_workers=len(peers))
        torch.set_num_threads(self.threads)
        self.device, self.autocast = self._agree(lambda: self._device_and_precision(peers))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)   # before anything else touches CUDA
        dataset = load_dataset(cfg.data.dataset, cfg.data.data_dir, seed=cfg.seed,
                               **cfg.data.options)
        self.num_classes, self.test_y = dataset.num_classes, dataset.test_y
        self._partition(dataset)
        self._model(dataset)
        if comm.is_worker:
            self.data = DeviceData(dataset, self.device, augment=cfg.data.augment,
                                   crop_padding=cfg.data.crop_padding, flip=cfg.data.flip,
                                   channels_last=cfg.model.channels_last and dataset.train_x.dim() == 4)
        ranks = comm.gather_obj(self._rank_info(), count=False)
        if comm.is_server:
            self.eval_batch = eval_batch_size(cfg.eval.batch_size, [r["device"] for r in ranks])
            self.state = self.alg.init_server_state(self.flat.params.detach().cpu().clone())
            self.store = ClientStateStore(self.alg.client_state_sizes(self.d),
                                          memory_bytes=cfg.system.state_memory_mb * 2 ** 20,
                                          directory=cfg.system.state_dir)
            if self.resume:
                evaluated = self._resume_file(dataset, ranks)
            else:
                evaluated = self._create_file(dataset, ranks)
            # round 0 once per run: not after a checkpoint, nor again when a run stopped
            # before its first checkpoint already wrote it (its resume keeps the row)
            self.at_start = cfg.eval.at_start and self.start == 0 and not evaluated
            if not self.quiet:
                print(rank_table(ranks), flush=True)
        self.start, self.eval_batch, self.at_start = comm.bcast_obj(
            (self.start, self.eval_batch, self.at_start) if comm.is_server else None)

    def _device_and_precision(self, peers):
        s = self.config.system
        device = choose_device(s.device, self.comm.is_worker, self.comm.rank, peers, s.gpu_share)
        return device, autocast_dtype(device, s.precision) if self.comm.is_worker else None

    def _agree(self, step):
        """``step()`` on every rank; if it raises UsageError on any, every rank raises the
        first one, so the server reports it once (a GPU missing on some worker's node)."""
        try:
            result, problem = step(), None
        except UsageError as exc:
            result, problem = None, str(exc)
        problems = self.comm.gather_obj(problem, count=False)
        first = self.comm.bcast_obj(next((p for p in problems if p), None) if self.comm.is_server else None)
        if first:
            raise UsageError(first)
        return result

    def _partition(self, dataset) -> None:
        """Computed once on the server from the seed, broadcast (see `federate`)."""
        split = federate(self.config, dataset) if self.comm.is_server else None
        self.split = self.comm.bcast_obj(split)
        self.public = self.split.public
        self.sizes = self.split.sizes
        # Placement balances local steps, which is what training time is proportional to.
        self.steps = -(-self.sizes // self.config.train.batch_size)

    def _model(self, dataset) -> None:
        cfg = self.config
        torch.manual_seed(key_seed(cfg.seed, "init"))
        module = self.alg.build_model(build_model, cfg.model.name, dataset.in_channels,
                                      dataset.num_classes, dataset.image_size, cfg.model.options)
        self.flat = FlatModel(module, self.device, channels_last=cfg.model.channels_last)
        self.d = self.flat.size

    def _rank_info(self) -> dict:
        import socket
        return {"rank": self.comm.rank, "host": socket.gethostname(), "pid": os.getpid(),
                "device": str(self.device), "threads": self.threads}

    def _create_file(self, dataset, ranks) -> bool:
        """A new results file; returns False: its initial model is not evaluated yet."""
        cfg = self.config
        provenance = {
            "git_commit": _git_commit(), "world_size": self.comm.size,
            "num_workers": self.comm.num_workers, "ranks": ranks,
            "hostnames": sorted({r["host"] for r in ranks}),
            "seed": cfg.seed, "torch_version": torch.__version__, "python": sys.version.split()[0],
            "num_params": self.d, "dataset_source": dataset.source,
            "algorithm_paper": self.alg.paper, "command": " ".join(sys.argv),
            "writer": liveness.identity(), "eval_batch_size": self.eval_batch,
        }
        partition = self.split.file_datasets(dataset.train_y.numpy(), dataset.num_classes)
        self.lock = RunLock.acquire(cfg.output_path())
        self.writer = ResultsWriter.create(
            cfg.output_path(), config=cfg.to_dict(), provenance=provenance,
            round_fields=ROUND_FIELDS + self._diagnostic_fields(),
            client_fields=self._client_fields(), rank_fields=RANK_FIELDS,
            layout=self.flat.layout_rows(), partition=partition, force=self.force)
        return False

    def _resume_file(self, dataset, ranks) -> bool:
        """Continue the file's run: state from its checkpoint (or round 0 without one).
        Returns whether the file has the initial model's row (round 0)."""
        path = self.config.output_path()
        self.lock = RunLock.acquire(path)
        recovered = recover_crashed(path)
        if recovered:
            print(f"fedmpi: {recovered}", file=sys.stderr, flush=True)
        with RunFile(path) as run:
            stored = run.partition()
            ckpt = run.checkpoint()
            if ckpt is not None:
                self._load_checkpoint(ckpt)
            history = list(run.attrs.get("resumes", []))
            evaluated = bool(np.any(run.rounds()["round"] == 0))
        if not np.array_equal(stored["client_offsets"], self.split.offsets) or \
                not np.array_equal(stored["client_indices"], self.split.indices):
            raise UsageError(f"--resume {path}: this fedmpi computes a different client partition "
                             f"from the file's config (was the code changed?)")
        history.append({"round": self.start, "world_size": self.comm.size,
                        "git_commit": _git_commit(), "ranks": ranks,
                        "eval_batch_size": self.eval_batch})
        # the last stop's details would be stale once the run goes on
        self.writer = ResultsWriter.resume(path, self.start, resumes=history, error="",
                                           interrupted_round=None, failed_round=None,
                                           writer=liveness.identity())
        return evaluated

    def _load_checkpoint(self, ckpt) -> None:
        missing = sorted(set(self.state) - set(ckpt.server))
        if missing:
            raise UsageError(f"checkpoint lacks server state {missing} of algorithm "
                             f"{self.config.algorithm.name!r}")
        self.state = {k: torch.from_numpy(np.array(v)) for k, v in ckpt.server.items()}
        self.store.load_state_dict(ckpt.states())
        self.start = ckpt.round

    def _checkpoint(self, completed: int) -> None:
        """Server: global and client state after ``completed`` rounds, into the file."""
        server = {k: v.detach().cpu().numpy() for k, v in self.state.items()}
        self.writer.write_checkpoint(completed, server, self.store.items(),
                                     self.alg.client_state_sizes(self.d), self.split.num_identities)

    def _diagnostic_fields(self) -> list[str]:
        return list(self.alg.diagnostic_fields)

    # ---- the loop -----------------------------------------------------------------------
    def run(self) -> Path | None:
        """Set up and run every round; returns the results path on the server."""
        try:
            with _preemption_signals():
                self.setup()
                self.ready = True
                s = self.config.system
                with numerics(self.device, s.precision, s.deterministic):
                    self._stop_if_signalled_in_setup()
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

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @property
    def diverged(self) -> bool:
        return self.stop == _DIVERGED

    @property
    def preempted(self) -> bool:
        return self.stop == _PREEMPTED

    def _fail(self, exc: BaseException) -> None:
        if getattr(self, "store", None) is not None:
            self.store.close()
        if self.writer is not None:
            status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            try:
                self.writer.set_status(status, error=f"{type(exc).__name__}: {exc}")
            except FileReplacedError:
                pass   # not our file any more: leave it alone
            self.writer.close()
            self.writer = None
        if self.comm.size > 1:
            if isinstance(exc, UsageError):  # e.g. data files missing: one line, exit 2
                # in setup every rank meets the same error: the server speaks for all
                if self.comm.is_server or self.ready:
                    print(f"fedmpi: {exc}", file=sys.stderr, flush=True)
                self.comm.abort(2)
            traceback.print_exc()
            sys.stderr.flush()
            self.comm.abort(1)

    def _round(self, t: int) -> None:
        comm, cfg = self.comm, self.config
        wall = time.perf_counter()
        timers = {"compute": 0.0, "aggregate": 0.0, "eval": 0.0}
        x_before = self.state["x"].clone() if comm.is_server else None
        sampled = self.split.sample(sample_clients(cfg.seed, t, cfg.clients.num,
                                                   cfg.clients.per_round), t) \
            if comm.is_server else None
        rows, fl = [], [0, 0]
        self.diagnostics = {}
        for p, phase in enumerate(self.alg.phases):
            rows.append(self._phase(t, p, phase, sampled, timers, fl))
        evaluated = (t + 1) % cfg.eval.every == 0 or t == cfg.rounds - 1
        acc, test_loss = self._evaluate(timers) if evaluated else (math.nan, math.nan)
        if self._probe_round(t):
            self._probe(t, timers)
        stats = comm.gather_obj(self._rank_stats(timers), count=False)
        if comm.is_server:
            row = self._round_row(t, wall, timers, stats, rows, fl, acc, test_loss, x_before)
            self._write(t, row, rows, stats)

    def _evaluate_start(self) -> None:
        """Round 0 (eval.at_start): the initial global model, evaluated as an evaluation
        round does (no training, no probes), written as the row ``round = 0``. Its ledger
        take closes start-up: the start-up's collectives count here, not in round 1. A
        signal during it stops the run after the row, as one during a round does."""
        comm = self.comm
        stop = comm.bcast_obj(self.stop if comm.is_server else None)  # signalled in start-up
        if stop:
            raise StopRun(stop)
        wall = time.perf_counter()
        timers = {"compute": 0.0, "aggregate": 0.0, "eval": 0.0}
        acc, test_loss = self._evaluate(timers)
        stats = comm.gather_obj(self._rank_stats(timers), count=False)
        if comm.is_server:
            self._write_start(self._start_row(wall, timers, stats, acc, test_loss), stats)

    # ---- one phase ----------------------------------------------------------------------
    def _phase(self, t, p, phase, sampled, timers, fl) -> dict | None:
        """Steps 2-4 of a round for one phase; returns the per-client columns on the server."""
        participants, assignment, payload = self._announce(t, phase, sampled)
        ctx = self._context(t, phase, participants)
        states = self._scatter_states(assignment)
        t0 = time.perf_counter()
        if p == 0:
            self.local_spectra = {}   # taken in the first phase only (eval.local_spectra)
        folded, rows, new_states, vectors = self._train(assignment, payload, states, ctx, p)
        # evaluation inside the training loop is evaluation time, not compute time
        spectra_seconds = sum(s for _, s in self.local_spectra.values()) if p == 0 else 0.0
        timers["eval"] += spectra_seconds
        timers["compute"] += time.perf_counter() - t0 - spectra_seconds
        sums = self._collect_sums(folded, assignment, p)
        if self.alg.gram_weighted(phase):
            t0 = time.perf_counter()
            combined, _ = gram.weighted_sum(self.comm, vectors, assignment, self.d,
                                            lambda inner: self.alg.gram_coefficients(inner, ctx))
            timers["aggregate"] += time.perf_counter() - t0
            if self.comm.is_server:
                sums["delta"] = combined
        gathered = self._collect_rows(rows)
        self._gather_states(new_states)
        if not self.comm.is_server:
            return None
        if p == 0:
            stats = [sums.pop(key) for key in STAT_SIZES_KEYS if key in sums]
            self.diagnostics.update(update_statistics(gathered["update_norm"], *stats))
        t0 = time.perf_counter()
        self.alg.server_update(self.state, sums, gathered, ctx)
        timers["aggregate"] += time.perf_counter() - t0
        self.diagnostics.update(self.alg.diagnostics(self.state, sums, gathered, ctx))
        down, up = (n * WIRE_BYTES for n in self.alg.traffic(self.d, phase))
        fl[0] += down * len(participants)
        fl[1] += up * len(participants)
        n = len(participants)
        return {**gathered, "phase": np.full(n, p), "bytes_down": np.full(n, down),
                "bytes_up": np.full(n, up)}

    def _announce(self, t, phase, sampled):
        """Server -> all: participants, placement and the payload (one flat buffer)."""
        comm, head, buf = self.comm, None, None
        if comm.is_server:
            participants = np.asarray(self.alg.phase_participants(self.state, phase, sampled))
            payload = self.alg.payload(self.state, self._context(t, phase, participants))
            spec = [(k, v.numel()) for k, v in payload.items()]
            head = (self.stop, participants, place(participants, self.steps, comm.num_workers), spec)
            buf = torch.cat([v.reshape(-1).to(torch.float32) for v in payload.values()])
        stop, participants, assignment, spec = comm.bcast_obj(head)
        if stop:
            raise StopRun(stop)
        if buf is None:
            buf = torch.empty(sum(n for _, n in spec), dtype=torch.float32)
        comm.bcast(buf)
        return participants, assignment, _split(buf, spec, self.device)

    def _context(self, t, phase, participants) -> algorithms.RoundContext:
        tr = self.config.train
        lr = tr.lr * tr.lr_decay ** t
        return algorithms.RoundContext(
            round=t, phase=phase, lr=lr, lr_prev=lr / tr.lr_decay, global_lr=tr.global_lr,
            weight_decay=tr.weight_decay, clip_norm=tr.clip_norm, local_epochs=tr.local_epochs,
            batch_size=tr.batch_size, num_clients=self.config.clients.num,
            participants=tuple(int(c) for c in participants), seed=self.config.seed)

    def _sizes(self, p: int) -> dict[str, int]:
        """What is summed in phase p: the algorithm's contributions, plus the update
        statistics' two vectors in the first phase when ``eval.update_stats`` is on."""
        sizes = dict(self.alg.contribution_sizes(self.d))
        if p == 0 and self.config.eval.update_stats:
            sizes.update({key: self.d for key in STAT_SIZES_KEYS})
        return sizes

    def _train(self, assignment, payload, states, ctx, p):
        """Train this worker's clients, folding each contribution in as it comes."""
        sizes = self._sizes(p)
        folded = Contributions(sizes, self.device, keep_each=self.config.system.deterministic)
        rows, new_states, vectors = [], {}, []
        keep = self.alg.gram_weighted(ctx.phase)
        mine = assignment[self.comm.worker_index] if self.comm.is_worker else []
        for c, state in self._device_states(np.asarray(mine).tolist(), states):
            t0 = time.perf_counter()
            data = self.data.client(self.split.client(c), self.config.seed, ctx.round, c, p,
                                    skew=self.split.skew(c))
            task = algorithms.ClientTask(client=c, data=data, model=self.flat, device=self.device,
                                         public=self._public_data(ctx.round, c, p),
                                         autocast=self.autocast)
            torch.manual_seed(key_seed(self.config.seed, "client", ctx.round, c, p))  # dropout
            upload = self.alg.local_update(task, payload, state, ctx)
            if p == 0 and self.config.eval.local_spectra and self._probe_round(ctx.round):
                t1 = time.perf_counter()   # the client's local model, before it is reloaded
                values = spectrum([spectrum_worker(self.flat.module.encoder, self.data, 0, 1)])
                self.local_spectra[c] = (values, time.perf_counter() - t1)
            contribution = self.alg.contribution(upload)
            if STAT_SIZES_KEYS[0] in sizes:
                contribution = {**contribution, **stat_contribution(upload.delta)}
            folded.add(contribution)
            if keep:  # the gram path needs each client's update (host memory: K_w d)
                vectors.append(upload.delta.detach().float().cpu())
            if upload.state is not None:
                new_states[c] = {k: v.detach().cpu().numpy() for k, v in upload.state.items()}
            rows.append(self._client_row(c, upload, time.perf_counter() - t0))
        table = np.asarray(rows, dtype=np.float64).reshape(-1, self._row_width())
        return folded, table, new_states, vectors

    def _public_data(self, t, c, p):
        if not len(self.public):
            return None
        return self.data.client(self.public, self.config.seed, t, c, p,
                                split=self.config.data.public_from, stream="public")

    def _client_row(self, c, upload, seconds) -> np.ndarray:
        """The _ROW values, then the algorithm's gathered fields (NaN where a phase has none)."""
        gathered = self.alg.gather(upload)
        extras = [gathered[k].detach().reshape(-1).double().cpu().numpy() if k in gathered
                  else np.full(n, math.nan) for k, n in self.alg.gather_sizes(self.d).items()]
        head = [c, self.comm.rank, upload.num_samples, upload.steps, upload.loss,
                float(torch.linalg.vector_norm(upload.delta)), seconds]
        return np.concatenate([head] + extras)

    def _row_width(self) -> int:
        return len(_ROW) + sum(self.alg.gather_sizes(self.d).values())

    def _collect_sums(self, folded: "Contributions", assignment, p: int) -> dict | None:
        """Sum of contributions on the server: one Reduce, or in client order if deterministic."""
        comm, sizes = self.comm, self._sizes(p)
        if folded.keep_each:
            parts = comm.gatherv(folded.host().reshape(-1).numpy())
            if not comm.is_server:
                return None
            workers = parts[1:] if comm.size > 1 else parts
            total = sum_in_client_order(workers, assignment, folded.total)
        else:
            total = torch.zeros(folded.total) if comm.is_server else None
            comm.reduce_sum(folded.host(), total)
            if not comm.is_server:
                return None
        return _split(total, list(sizes.items()), torch.device("cpu"))

    def _collect_rows(self, rows) -> dict | None:
        parts = self.comm.gatherv(rows.reshape(-1))
        if not self.comm.is_server:
            return None
        table = np.concatenate(parts).reshape(-1, self._row_width())
        table = table[np.argsort(table[:, 0], kind="stable")]
        out = {name: table[:, i] for i, name in enumerate(_ROW)}
        col = len(_ROW)
        for name, size in self.alg.gather_sizes(self.d).items():
            out[name] = table[:, col:col + size].squeeze(1) if size == 1 else table[:, col:col + size]
            col += size
        return out

    # ---- client state: kept on the server's host, shipped to whoever trains the client --
    def _scatter_states(self, assignment) -> dict:
        if not self.alg.client_state_sizes(self.d):
            return {}
        parts = None
        if self.comm.is_server:
            per_worker = [{c: self.store.get(c) for c in a.tolist()} for a in assignment]
            parts = per_worker if self.comm.size == 1 else [{}] + per_worker
        return self.comm.scatter_obj(parts)   # host arrays: _device_states moves them

    def _device_states(self, clients: list[int], states: dict):
        """(client, its state on the device) in training order. Only one client's state
        is on the GPU at a time (with ResNet-18 a stateful method's state is ~45 MB a
        client): on CUDA the next client's state is copied from pinned memory on a side
        stream while the current client trains."""
        if self.device.type != "cuda":
            for c in clients:
                s = states.get(c)
                yield c, None if s is None else {k: torch.from_numpy(v) for k, v in s.items()}
            return
        stream = torch.cuda.Stream(self.device)

        def issue(c):
            s = states.get(c)
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

    def _gather_states(self, new_states) -> None:
        if not self.alg.client_state_sizes(self.d):
            return
        parts = self.comm.gather_obj(new_states)
        if self.comm.is_server:
            for part in parts:
                for c, s in part.items():
                    self.store.put(c, s)

    # ---- evaluation ---------------------------------------------------------------------
    def _load_eval_model(self) -> None:
        """Server -> workers: the parameters to evaluate, into each worker's model."""
        comm = self.comm
        buf = self.alg.eval_params(self.state).to(torch.float32).contiguous().clone() \
            if comm.is_server else torch.empty(self.d, dtype=torch.float32)
        comm.bcast(buf)
        if comm.is_worker:
            self.flat.load(buf.to(self.device))

    def _evaluate(self, timers) -> tuple[float, float]:
        t0 = time.perf_counter()
        comm, bs = self.comm, self.eval_batch
        self._load_eval_model()
        if not self.alg.supervised:
            return self._evaluate_knn(timers, t0)
        rows = np.zeros((0, 4))
        if comm.is_worker:
            chunk_ids = chunks_of(len(self.data.test_y), bs, comm.worker_index, comm.num_workers)
            rows = evaluate_chunks(self.flat.module, self.data, chunk_ids, bs)
        parts = comm.gatherv(rows.reshape(-1))
        timers["eval"] += time.perf_counter() - t0
        if not comm.is_server:
            return math.nan, math.nan
        return combine(np.concatenate(parts).reshape(-1, 4))

    def _evaluate_knn(self, timers, t0) -> tuple[float, float]:
        """A representation learner's test_acc: kNN accuracy of its encoder (k = 200,
        temperature 0.1, bank = the training set), bank chunks sharded over workers."""
        comm = self.comm
        partial = knn_worker(self.flat.module.encoder, self.data, comm.worker_index,
                             comm.num_workers) if comm.is_worker else None
        parts = comm.gather_obj(partial)
        timers["eval"] += time.perf_counter() - t0
        if not comm.is_server:
            return math.nan, math.nan
        return knn_accuracy(parts, self.test_y, self.num_classes), math.nan

    def _probe_round(self, t: int) -> bool:
        e = self.config.eval
        return bool(e.probes) and (t == self.config.rounds - 1
                                   or (e.probe_every > 0 and (t + 1) % e.probe_every == 0))

    def _probe(self, t: int, timers) -> None:
        """Probes of the global encoder (eval.probes) into /eval (fedmpi.runtime.probes)."""
        t0 = time.perf_counter()
        self._load_eval_model()
        encoder = self.flat.module.encoder if self.comm.is_worker else None
        local = {c: values for c, (values, _) in self.local_spectra.items()}
        row, values, local = probes.run(self.comm, encoder, getattr(self, "data", None),
                                        self.num_classes, self.config, t + 1, local)
        timers["eval"] += time.perf_counter() - t0
        if self.comm.is_server:
            self.writer.append_eval(row, values, local)
            if not self.quiet:
                print(probes.describe(row), flush=True)

    # ---- bookkeeping ----------------------------------------------------------------------
    def _rank_stats(self, timers) -> list[float]:
        """RANK_FIELDS[2:] of this rank, then whether it was signalled (not a column)."""
        ledger = self.comm.ledger.take()
        return [ledger.sent, ledger.received, timers["compute"], ledger.idle_seconds,
                ledger.comm_seconds, float(signals.requested())]

    def _round_row(self, t, wall, timers, stats, rows, fl, acc, test_loss, x_before) -> dict:
        stats = np.asarray(stats)
        workers = stats[1:] if self.comm.size > 1 else stats
        first = rows[0]
        weights = first["n_samples"]
        train_loss = float(np.sum(first["train_loss"] * weights) / max(weights.sum(), 1))
        return {
            "round": t + 1, "time_wall": time.perf_counter() - wall,
            "time_compute": float(workers[:, 2].max()), "time_compute_min": float(workers[:, 2].min()),
            "time_comm": float(stats[0, 4]), "time_idle": float(stats[0, 3]),
            "time_aggregate": timers["aggregate"], "time_eval": timers["eval"],
            "lr": self.config.train.lr * self.config.train.lr_decay ** t,
            "train_loss": train_loss, "test_loss": test_loss, "test_acc": acc,
            "fl_bytes_down": fl[0], "fl_bytes_up": fl[1], "mpi_bytes": float(stats[:, 0].sum()),
            "n_participants": len(first["client"]),
            "update_norm": float(torch.linalg.vector_norm(self.state["x"] - x_before)),
            **self.diagnostics,
        }

    def _start_row(self, wall, timers, stats, acc, test_loss) -> dict:
        """Round 0's row: the test metrics and what the evaluation took. Nothing trained:
        FL traffic, participants and compute are 0; lr, train_loss, update_norm and the
        diagnostics are not measured (left out: NaN)."""
        stats = np.asarray(stats)
        return {
            "round": 0, "time_wall": time.perf_counter() - wall,
            "time_compute": 0.0, "time_compute_min": 0.0,
            "time_comm": float(stats[0, 4]), "time_idle": float(stats[0, 3]),
            "time_aggregate": 0.0, "time_eval": timers["eval"],
            "test_loss": test_loss, "test_acc": acc, "fl_bytes_down": 0, "fl_bytes_up": 0,
            "mpi_bytes": float(stats[:, 0].sum()), "n_participants": 0,
        }

    def _write_start(self, row, stats) -> None:
        """Round 0 into the file (no client rows, no checkpoint: the initial state is the
        config's); a signal during it stops the run, resumable from round 0."""
        self.writer.append_round(row)
        self._append_ranks(0, stats)
        self.writer.flush()
        if np.asarray(stats)[:, -1].any():
            self._interrupt(0, "stopped after evaluating the initial model (round 0)")
        self._progress(-1, row)

    def _append_ranks(self, round_, stats) -> None:
        stats = np.asarray(stats)
        self.writer.append_ranks({"round": np.full(len(stats), round_), "rank": np.arange(len(stats)),
                                  **{f: stats[:, i] for i, f in enumerate(RANK_FIELDS[2:])}})

    def _write(self, t, row, rows, stats) -> None:
        self.writer.append_round(row)
        self._append_ranks(t + 1, stats)
        for gathered in rows:
            self.writer.append_clients({"round": np.full(len(gathered["client"]), t + 1),
                                        **self._client_columns(gathered)})
        self.writer.flush()  # one flush per round: every completed round is on disk
        # Workers learn of a stop from the next round's plan; the file keeps every round.
        if not (math.isfinite(row["train_loss"]) and bool(torch.isfinite(self.state["x"]).all())):
            # rounds count from 1 everywhere: /rounds/round, progress lines, failed_round
            self.writer.set_status("failed", error=f"diverged at round {t + 1}", failed_round=t + 1)
            self.stop = _DIVERGED
            print(f"fedmpi: training diverged at round {t + 1} (NaN/Inf loss or parameters)",
                  file=sys.stderr, flush=True)
        elif t + 1 < self.config.rounds:
            self._maybe_checkpoint(t + 1, signalled=bool(np.asarray(stats)[:, -1].any()))
        self._progress(t, row)

    def _maybe_checkpoint(self, completed: int, signalled: bool) -> None:
        every = self.config.system.checkpoint_every
        if signalled or (every and completed % every == 0):
            self._checkpoint(completed)
        if signalled:
            self._interrupt(completed, f"checkpointed after round {completed}")

    def _interrupt(self, completed: int, what: str) -> None:
        """Server: mark the file resumable after ``completed`` rounds and stop every rank."""
        self.writer.set_status("interrupted", error="stopped by a signal (SIGUSR1/SIGTERM/SIGHUP/Ctrl-C)",
                               interrupted_round=completed)
        self.stop = _PREEMPTED
        print(f"fedmpi: signal received; {what}, exiting with {EXIT_PREEMPTED} "
              f"(resume with: fedmpi run --resume {self.config.output_path()})",
              file=sys.stderr, flush=True)

    def _stop_if_signalled_in_setup(self) -> None:
        """A signal during start-up stops the run before its first round: the file exists
        and resumes from where this start began (its checkpoint, or round 0)."""
        flags = self.comm.gather_obj(signals.requested(), count=False)
        if self.comm.is_server and any(flags) and self.start < self.config.rounds:
            self._interrupt(self.start, f"stopped during start-up, at round {self.start}")

    def _client_fields(self) -> list[str]:
        fields = []
        for name, size in self.alg.gather_sizes(self.d).items():
            fields += [name] if size == 1 else [f"{name}_{i}" for i in range(size)]
        return CLIENT_FIELDS + fields

    def _client_columns(self, gathered) -> dict[str, np.ndarray]:
        """Per-client columns; a gathered vector of size k becomes columns name_0..name_k-1."""
        out = {}
        for name, values in gathered.items():
            if values.ndim == 1:
                out[name] = values
            else:
                out.update({f"{name}_{i}": values[:, i] for i in range(values.shape[1])})
        return out

    def _progress(self, t, row) -> None:
        """The line of round t + 1; t = -1 is round 0, the initial model."""
        if self.quiet:
            return
        rounds = self.config.rounds
        acc = "" if math.isnan(row["test_acc"]) else f"  test_acc {row['test_acc']:.4f}"
        if t < 0:
            print(f"round {0:>4}/{rounds}  initial model{acc}  {row['time_wall']:.2f} s",
                  flush=True)
            return
        eta = row["time_wall"] * (rounds - t - 1)
        print(f"round {t + 1:>4}/{rounds}  train_loss {row['train_loss']:.4f}{acc}"
              f"  {row['time_wall']:.2f} s/round  eta {eta:.0f} s", flush=True)


class Contributions:
    """A worker's contributions: a running sum (fast mode) or one flat vector per client
    in training order (deterministic mode, summed in client order on the server)."""

    def __init__(self, sizes: dict[str, int], device, keep_each: bool):
        self.sizes, self.device, self.keep_each = sizes, device, keep_each
        self.total = sum(sizes.values())
        self.sum = None if keep_each else torch.zeros(self.total, device=device)
        self.each: list[torch.Tensor] = []

    def add(self, contribution: dict[str, torch.Tensor]) -> None:
        target = torch.empty(self.total, device=self.device) if self.keep_each else None
        offset = 0
        for name, n in self.sizes.items():
            piece = contribution[name].reshape(-1)
            if self.keep_each:
                target[offset:offset + n] = piece
            else:
                self.sum[offset:offset + n] += piece
            offset += n
        if self.keep_each:
            self.each.append(target.cpu())

    def host(self) -> torch.Tensor:
        if not self.keep_each:
            return self.sum.cpu()
        return torch.stack(self.each) if self.each else torch.zeros(0, self.total)


def sum_in_client_order(parts, assignment, total: int) -> torch.Tensor:
    """Add per-client vectors in ascending client id, whichever worker sent them.

    ``parts[w]`` holds worker w's vectors in the order of ``assignment[w]``. The float32
    additions happen in one fixed order, so the sum is the same bits for any layout.
    """
    by_client = {}
    for clients, part in zip(assignment, parts):
        for c, vec in zip(np.asarray(clients).tolist(), part.reshape(-1, total)):
            by_client[c] = vec
    out = torch.zeros(total)
    for c in sorted(by_client):
        out += torch.from_numpy(by_client[c])
    return out


def _split(buf: torch.Tensor, spec, device) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    buf = buf.to(device)
    for name, n in spec:
        out[name] = buf[offset:offset + n]
        offset += n
    return out


EVAL_BATCH_CPU, EVAL_BATCH_GPU = 250, 1000


def eval_batch_size(configured: int, devices: list[str]) -> int:
    """eval.batch_size, or when it is 0 (auto) the size for the workers' devices: 250 test
    samples keep a CPU's activations in cache, a GPU wants larger batches. The same on
    every rank (it is also the chunk each worker scores), so the server decides."""
    if configured:
        return configured
    return EVAL_BATCH_GPU if any(d.startswith("cuda") for d in devices) else EVAL_BATCH_CPU


def rank_table(ranks: list[dict]) -> str:
    """Which rank runs where, on which device: printed at start (also in the file's
    ``ranks`` attribute)."""
    lines = [f"{'rank':>4}  {'role':<6}  {'host':<20}  {'device':<8}  threads"]
    for r in ranks:
        role = "server" if r["rank"] == 0 and len(ranks) > 1 else ("both" if len(ranks) == 1 else "worker")
        lines.append(f"{r['rank']:>4}  {role:<6}  {r['host'][:20]:<20}  {r['device']:<8}  {r['threads']}")
    return "\n".join(lines)


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


def _git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""
