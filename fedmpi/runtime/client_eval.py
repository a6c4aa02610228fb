"""Per-client evaluation (``eval.clients``): an evaluator stage that scores every client
(or a keyed sample of N) on its local test split (``partition.local_test``) on every
evaluation round, not only the clients that just trained (which would bias the scores
toward them), and, with ``eval.client_finetune_epochs``, again after each has fine-tuned
the global model on its local training data (FedAvg-FT, the baseline personalised
methods must beat; every method gets the same budget).

The clients evaluated at round t are the population's identities (the sampled slots for
N) that hold at least one local test sample, ascending. The global model's scores are
one pass over the union of their test samples in fixed chunks of ``eval_batch`` samples,
chunk j on worker j mod W (a sample's loss does not depend on which worker scores its
chunk), summed per client on the server in sample order: the same bits for any number of
ranks. Fine-tuning is per client (client k of the list on worker k mod W), from the
stream keyed by (seed, round, client, "finetune"), plain SGD at ``train.lr`` and
``train.batch_size``; each worker's model is restored afterwards.

Into the file: /client_eval rows (round, client, n_test, accuracy, loss, and with
fine-tuning personal_accuracy, personal_loss) and per-round summaries in /rounds
(``summary``): the mean over clients, the sample-weighted mean, the std, the 10th, 50th
and 90th percentiles, the mean of the worst 10% of clients and the sample-weighted loss.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from ..results.schema import CLIENT_EVAL_FIELDS, PERSONAL_EVAL_FIELDS
from .rng import numpy_rng

STATS = ("mean", "weighted", "std", "p10", "p50", "p90", "worst10")


def summary_fields(prefix: str) -> list[str]:
    return [f"{prefix}_acc_{s}" for s in STATS] + [f"{prefix}_loss"]


def summary(prefix: str, correct: np.ndarray, loss: np.ndarray, n: np.ndarray) -> dict:
    """The /rounds columns of one set of per-client scores (NaN without clients)."""
    if not len(n):
        return {name: math.nan for name in summary_fields(prefix)}
    acc = correct / n
    p10, p50, p90 = np.percentile(acc, [10, 50, 90])
    worst = np.sort(acc, kind="stable")[:max(1, math.ceil(0.1 * len(acc)))]
    values = (acc.mean(), correct.sum() / n.sum(), acc.std(), p10, p50, p90, worst.mean())
    return {**{f"{prefix}_acc_{s}": float(v) for s, v in zip(STATS, values)},
            f"{prefix}_loss": float(loss.sum() / n.sum())}


class ClientTest:
    """The ``eval.clients`` evaluator stage (``scoring.Evaluation`` runs it after the
    global test)."""

    table = "client_eval"

    def __init__(self, config, split):
        self.config, self.split = config, split
        self.finetune = config.eval.client_finetune_epochs
        self.slots = None
        if config.eval.clients != "all":   # the same N slots every evaluation
            rng = numpy_rng(config.seed, "eval-clients")
            self.slots = np.sort(rng.choice(config.clients.num, int(config.eval.clients),
                                            replace=False))
        self.round_fields = ["clients_evaluated"] + summary_fields("client") + \
            (summary_fields("personal") if self.finetune else [])
        self.table_fields = list(CLIENT_EVAL_FIELDS) + \
            (list(PERSONAL_EVAL_FIELDS) if self.finetune else [])

    def clients(self, round_: int) -> np.ndarray:
        """The identities evaluated after ``round_`` rounds (round 0: the initial model)."""
        active = self.split.active(max(round_ - 1, 0))
        ids = np.sort(active if self.slots is None else active[self.slots])
        return ids[self.split.test_sizes[ids] > 0]

    def evaluate(self, exp, timers, round_: int):
        """(the /rounds columns, the /client_eval rows) on the server; ({}, None) elsewhere."""
        t0 = time.perf_counter()
        comm, ids = exp.comm, self.clients(round_)
        sizes = self.split.test_sizes[ids]
        union = np.concatenate([self.split.test_client(c) for c in ids]) if len(ids) else \
            np.zeros(0, dtype=np.int64)
        rows = np.zeros((0, 3))
        personal = np.zeros((0, 4))
        if comm.is_worker:
            rows = _score_samples(exp, union, comm.worker_index, comm.num_workers)
            if self.finetune:
                personal = self._finetune(exp, ids, round_, comm.worker_index, comm.num_workers)
        parts = comm.gatherv(rows.reshape(-1))
        fine = comm.gatherv(personal.reshape(-1)) if self.finetune else None
        timers.eval += time.perf_counter() - t0
        if not comm.is_server:
            return {}, None
        scored = np.zeros((len(union), 2))
        samples = np.concatenate(parts).reshape(-1, 3)
        scored[samples[:, 0].astype(np.int64)] = samples[:, 1:]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        correct, loss = _per_client(scored[:, 0], starts), _per_client(scored[:, 1], starts)
        n = sizes.astype(np.float64)
        columns = {"clients_evaluated": float(len(ids)), **summary("client", correct, loss, n)}
        table = {"round": np.full(len(ids), round_, dtype=np.int64), "client": ids,
                 "n_test": sizes, "accuracy": correct / np.maximum(n, 1),
                 "loss": loss / np.maximum(n, 1)}
        if self.finetune:
            tuned = np.concatenate(fine).reshape(-1, 4)
            tuned = tuned[np.argsort(tuned[:, 0], kind="stable")]
            columns.update(summary("personal", tuned[:, 1], tuned[:, 2], n))
            table.update(personal_accuracy=tuned[:, 1] / np.maximum(n, 1),
                         personal_loss=tuned[:, 2] / np.maximum(n, 1))
        return columns, table

    def _finetune(self, exp, ids, round_: int, worker: int, workers: int) -> np.ndarray:
        """Rows (position, correct, loss sum, n) of this worker's clients after each has
        fine-tuned the loaded global model (restored afterwards)."""
        cfg, flat, data = self.config, exp.flat, exp.data
        start = flat.params.detach().clone()
        out = []
        for k in range(worker, len(ids), workers):
            c = int(ids[k])
            flat.load(start)
            train = data.client(self.split.client(c), cfg.seed, round_, c, 0, stream="finetune")
            _sgd(flat, train.batches(self.finetune, cfg.train.batch_size), cfg.train.lr,
                 exp.autocast)
            tests = self.split.test_client(c)
            scored = _score_samples(exp, tests, 0, 1)
            out.append((k, scored[:, 1].sum(), scored[:, 2].sum(), len(tests)))
        flat.load(start)
        return np.asarray(out, dtype=np.float64).reshape(-1, 4)


def _per_client(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Sums of consecutive runs of ``values`` (each client's samples), in sample order."""
    if not len(starts):
        return np.zeros(0)
    return np.add.reduceat(values, starts) if len(values) else np.zeros(len(starts))


@torch.no_grad()
def _score_samples(exp, samples: np.ndarray, worker: int, workers: int) -> np.ndarray:
    """Rows (position, correct, loss) of this worker's chunks of ``samples`` (training set
    ids), each chunk ``exp.eval_batch`` samples, chunk j on worker j mod ``workers``."""
    module, data, size = exp.flat.module, exp.data, exp.eval_batch
    module.eval()
    chunks = range(worker, -(-len(samples) // size), workers)
    index = torch.as_tensor(samples, dtype=torch.int64, device=data.train_x.device)
    scores = []
    for j in chunks:
        part = index[j * size:(j + 1) * size]
        logits = module(data.prepare(data.train_x[part], None)).float()
        y = data.train_y[part]
        scores.append(torch.stack([(logits.argmax(1) == y).double(),
                                   F.cross_entropy(logits, y, reduction="none").double()], 1))
    if not scores:
        return np.zeros((0, 3))
    positions = np.concatenate([np.arange(j * size, min((j + 1) * size, len(samples)))
                                for j in chunks])
    return np.column_stack([positions, torch.cat(scores).cpu().numpy()])


def _sgd(flat, batches, lr: float, autocast=None) -> None:
    """Plain SGD on the flat model's parameters over ``batches`` (fine-tuning)."""
    module = flat.module
    module.train()
    params = flat.params[:flat.num_params]
    for x, y in batches:
        flat.zero_grad()
        with torch.autocast(x.device.type, dtype=autocast, enabled=autocast is not None):
            loss = F.cross_entropy(module(x).float(), y)
        loss.backward()
        with torch.no_grad():
            params.sub_(flat.grads, alpha=lr)
