"""The evaluation step: the server's evaluation parameters, scored by the workers on
test chunks (supervised) or by kNN on the encoder's features (self-supervised)."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from ..evaluation import chunks_of, combine, evaluate_chunks, knn_accuracy, knn_worker
from ..flat import host_vector


def load_eval_model(exp) -> None:
    """Server -> workers: the parameters to evaluate, into each worker's model."""
    comm = exp.comm
    buf = exp.alg.eval_params(exp.state).to(torch.float32).contiguous().clone() \
        if comm.is_server else host_vector(exp.d, zeros=False)
    comm.bcast(buf)
    if comm.is_worker:
        exp.flat.load(buf.to(exp.device))


class GlobalTest:
    """A supervised model's test_acc and test_loss on the whole test set, its chunks
    sharded over the workers and combined on the server in chunk order."""

    def evaluate(self, exp, timers) -> tuple[float, float]:
        """(test_acc, test_loss) on the server, NaNs elsewhere; the time goes to timers.eval."""
        t0 = time.perf_counter()
        comm, bs = exp.comm, exp.eval_batch
        load_eval_model(exp)
        rows = np.zeros((0, 4))
        if comm.is_worker:
            chunk_ids = chunks_of(len(exp.data.test_y), bs, comm.worker_index, comm.num_workers)
            rows = evaluate_chunks(exp.flat.module, exp.data, chunk_ids, bs)
        parts = comm.gatherv(rows.reshape(-1))
        timers.eval += time.perf_counter() - t0
        if not comm.is_server:
            return math.nan, math.nan
        return combine(np.concatenate(parts).reshape(-1, 4))


class KNN:
    """A representation learner's test_acc: kNN accuracy of its encoder (k = 200,
    temperature 0.1, bank = the training set), bank chunks sharded over workers; no
    test_loss."""

    def evaluate(self, exp, timers) -> tuple[float, float]:
        t0 = time.perf_counter()
        comm = exp.comm
        load_eval_model(exp)
        partial = knn_worker(exp.flat.module.encoder, exp.data, comm.worker_index,
                             comm.num_workers) if comm.is_worker else None
        parts = comm.gather_obj(partial)
        timers.eval += time.perf_counter() - t0
        if not comm.is_server:
            return math.nan, math.nan
        return knn_accuracy(parts, exp.test_y, exp.num_classes), math.nan


class Evaluation:
    """The run's evaluator stages: the global model's score (``GlobalTest`` or ``KNN``:
    test_acc, test_loss), then the others in order (``client_eval.ClientTest``), each
    with the /rounds columns it adds (``round_fields``) and a table of rows of its own
    (``table``, ``table_fields``); ``take`` hands the last evaluation's to the round."""

    def __init__(self, main, stages=()):
        self.main, self.stages = main, list(stages)
        self.round_fields = [f for stage in self.stages for f in stage.round_fields]
        self.tables = {stage.table: stage.table_fields for stage in self.stages if stage.table}
        self._columns, self._rows = {}, {}

    def evaluate(self, exp, timers, round_: int) -> tuple[float, float]:
        """(test_acc, test_loss) on the server, NaNs elsewhere; the stages' columns and
        rows wait for ``take``. ``round_``: the row's round (0: the initial model)."""
        acc, loss = self.main.evaluate(exp, timers)
        for stage in self.stages:
            columns, rows = stage.evaluate(exp, timers, round_)
            self._columns.update(columns)
            if rows is not None:
                self._rows[stage.table] = rows
        return acc, loss

    def take(self) -> tuple[dict, dict]:
        """The columns and table rows of the evaluation since the last take."""
        out = self._columns, self._rows
        self._columns, self._rows = {}, {}
        return out


def evaluator(alg, config=None, split=None) -> Evaluation:
    """The run's evaluator stages: the global one by what the method learns, then the
    per-client one where ``eval.clients`` asks for it, then a data attack's success."""
    from .client_eval import ClientTest   # deferred: it imports the results schema
    from .poison import KINDS, AttackSuccess   # deferred: only a data attack needs it
    stages = [ClientTest(config, split, alg)] if config is not None and \
        config.eval.clients != "none" else []
    if config is not None and config.attack.kind in KINDS:
        stages.append(AttackSuccess(config))
    return Evaluation(GlobalTest() if alg.supervised else KNN(), stages)
