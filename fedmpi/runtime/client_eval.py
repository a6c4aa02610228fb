"""Per-client evaluation (``eval.clients``): an evaluator stage that scores every client
(or a keyed sample of N) on its local test split (``partition.local_test``) on every
evaluation round, not only the clients that just trained (which would bias the scores
toward them), and again on its personal model: a personalised method's own
(``Algorithm.personal_params``; Ditto's v_i) or the global one, fine-tuned first for
``eval.client_finetune_epochs`` on its local training data (with the global model:
FedAvg-FT, the baseline personalised methods must beat; every method gets the same
budget).

The clients evaluated at round t are the population's identities (the sampled slots for
N) that hold at least one local test sample, ascending. The global model's scores are
one pass over the union of their test samples in fixed chunks of ``eval_batch`` samples,
chunk j on worker j mod W (a sample's loss does not depend on which worker scores its
chunk), summed per client on the server in sample order: the same bits for any number of
ranks. Fine-tuning is per client (client k of the list on worker k mod W), from the
stream keyed by (seed, round, client, "finetune"), plain SGD at ``train.lr`` and
``train.batch_size``, one client after another or, with ``eval.client_finetune_group``
= G > 1, in groups of G cut from all evaluated clients and placed whole (the same bits on
any number of ranks; up to float rounding against one after another); each worker's
model is restored afterwards.

Held-out clients (``clients.holdout``: slots never sampled for training) are scored the
same way, apart: holdout_* summaries (and holdout_personal_* after fine-tuning), the
participation gap (the training clients' mean local test accuracy minus the held-out
clients') and the out-of-sample gap (the training clients' mean accuracy on their own
training data minus that on their local test data), as Yuan et al. 2022 ("What do we
mean by generalization in federated learning?") define them.

Into the file: /client_eval rows (round, client, n_test, accuracy, loss; with
fine-tuning personal_accuracy, personal_loss; with held-out clients held_out) and
per-round summaries in /rounds (``summary``): the mean over clients, the sample-weighted
mean, the std, the 10th, 50th and 90th percentiles, the mean of the worst 10% of clients
and the sample-weighted loss.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from ..algorithms import ClientTask, group_sgd
from ..algorithms.local_sgd import sgd_step
from ..results.schema import CLIENT_EVAL_FIELDS, PERSONAL_EVAL_FIELDS
from .phase import round_context
from .rng import numpy_rng, torch_generator

STATS = ("mean", "weighted", "std", "p10", "p50", "p90", "worst10")
GAP_FIELDS = ("client_train_acc_mean", "participation_gap", "out_of_sample_gap")


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

    def __init__(self, config, split, alg):
        self.config, self.split, self.alg = config, split, alg
        self.finetune = config.eval.client_finetune_epochs
        # the personal scores: each client's own model (a personalised method's) or the
        # global one, then fine-tuned for eval.client_finetune_epochs
        self.personal = bool(self.finetune) or alg.personalised
        self.holdout = bool(config.clients.holdout)
        # feature skew: each client's sets scored as it sees them (``SkewedSets``)
        p = config.partition
        self.skewed = SkewedSets(split, config.seed) \
            if any(getattr(p, n) for n in ("noise", "brightness", "saturation")) else None
        self.slots = None
        if config.eval.clients != "all":   # the same N slots every evaluation
            rng = numpy_rng(config.seed, "eval-clients")
            self.slots = np.sort(rng.choice(config.clients.num, int(config.eval.clients),
                                            replace=False))
        prefixes = ["client"] + (["personal"] if self.personal else [])
        if self.holdout:
            prefixes += ["holdout"] + (["holdout_personal"] if self.personal else [])
        self.round_fields = ["clients_evaluated"] + \
            [f for prefix in prefixes for f in summary_fields(prefix)] + \
            (list(GAP_FIELDS) if self.holdout else [])
        self.table_fields = list(CLIENT_EVAL_FIELDS) + \
            (list(PERSONAL_EVAL_FIELDS) if self.personal else []) + \
            (["held_out"] if self.holdout else [])

    def clients(self, round_: int) -> np.ndarray:
        """The identities evaluated after ``round_`` rounds (round 0: the initial model)."""
        active = self.split.active(max(round_ - 1, 0))
        ids = np.sort(active if self.slots is None else active[self.slots])
        return ids[self.split.test_sizes[ids] > 0]

    def evaluate(self, exp, timers, round_: int):
        """(the /rounds columns, the /client_eval rows) on the server; ({}, None) elsewhere."""
        t0 = time.perf_counter()
        split, ids = self.split, self.clients(round_)
        held = split.held_out(ids)
        skewed = self.skewed
        test = _scores(exp, [split.test_client(c) for c in ids],
                       skewed and (skewed, "test", ids))
        # clients.holdout: the training clients' accuracy on their own training data, for
        # the out-of-sample gap (Yuan et al. 2022)
        train = _scores(exp, [split.client(c) for c in ids[~held]],
                        skewed and (skewed, "train", ids[~held])) if self.holdout else None
        tuned = self._personal(exp, ids, round_) if self.personal else None
        timers.eval += time.perf_counter() - t0
        if not exp.comm.is_server:
            return {}, None
        n = split.test_sizes[ids].astype(np.float64)
        sets = [("client", test, ~held)] + ([("personal", tuned, ~held)] if self.personal else [])
        if self.holdout:
            sets += [("holdout", test, held)] + \
                ([("holdout_personal", tuned, held)] if self.personal else [])
        columns = {"clients_evaluated": float(len(ids))}
        for prefix, (correct, loss), which in sets:
            columns.update(summary(prefix, correct[which], loss[which], n[which]))
        if self.holdout:
            sizes = split.sizes[ids[~held]].astype(np.float64)
            fit = train[0] / np.maximum(sizes, 1)
            columns["client_train_acc_mean"] = float(fit.mean()) if len(fit) else math.nan
            columns["participation_gap"] = columns["client_acc_mean"] - columns["holdout_acc_mean"]
            columns["out_of_sample_gap"] = columns["client_train_acc_mean"] - \
                columns["client_acc_mean"]
        table = {"round": np.full(len(ids), round_, dtype=np.int64), "client": ids,
                 "n_test": split.test_sizes[ids], "accuracy": test[0] / np.maximum(n, 1),
                 "loss": test[1] / np.maximum(n, 1)}
        if self.personal:
            table.update(personal_accuracy=tuned[0] / np.maximum(n, 1),
                         personal_loss=tuned[1] / np.maximum(n, 1))
        if self.holdout:
            table["held_out"] = held.astype(np.int64)
        return columns, table

    def _personal(self, exp, ids, round_: int):
        """Server: each client's (correct, loss sum) on its test split under its personal
        model: its own (``Phases.personal`` of its state, which the server's store sends
        to the worker scoring it: the method's personal model, its private layers) or
        the loaded global one, fine-tuned for ``eval.client_finetune_epochs`` (client k
        of ``ids`` on worker k mod W; each worker's model restored afterwards); None
        elsewhere."""
        cfg, comm, flat, data = self.config, exp.comm, exp.flat, exp.data
        states = self._states(exp, ids) if exp.phases.personalised else {}
        rows = []
        if comm.is_worker:
            start = flat.params.detach().clone()
            group = cfg.eval.client_finetune_group if self.finetune else 1
            units = [[k] for k in range(len(ids))] if group == 1 else \
                _finetune_units([len(self.split.client(int(c))) for c in ids], group)
            mine = units[comm.worker_index::comm.num_workers]

            def personal(k):
                c = int(ids[k])
                return start if c not in states else exp.phases.personal(
                    {n: torch.from_numpy(v).to(start.device) for n, v in states[c].items()},
                    start)

            def finetuning(k):
                c = int(ids[k])
                return data.client(self.split.client(c), cfg.seed, round_, c, 0, stream="finetune")

            def score(k):
                c = int(ids[k])
                tests = self.split.test_client(c)
                scored = _score_samples(exp, tests, 0, 1, self.skewed and self.skewed.union(
                    exp, "test", [c], [tests]))
                rows.append((k, scored[:, 1].sum(), scored[:, 2].sum()))

            if group > 1:
                _finetune_groups(exp, mine, personal, finetuning, score, self.finetune, round_)
            for [k] in mine if group == 1 else ():
                flat.load(personal(k))
                if self.finetune:
                    _sgd(flat, finetuning(k).batches(self.finetune, cfg.train.batch_size),
                         cfg.train.lr, exp.autocast)
                score(k)
            flat.load(start)
        parts = comm.gatherv(np.asarray(rows, dtype=np.float64).reshape(-1))
        if not comm.is_server:
            return None
        tuned = np.concatenate(parts).reshape(-1, 3)
        tuned = tuned[np.argsort(tuned[:, 0], kind="stable")]
        return tuned[:, 1], tuned[:, 2]

    def _states(self, exp, ids) -> dict:
        """Worker: the personal state of each client it scores (the method's and the
        private layers'; client k of ``ids`` on worker k mod W), from the server's store
        (zeros for a client never trained)."""
        workers, own = exp.comm.num_workers, exp.phases.personal_keys
        states = exp.phases.scatter_states([ids[w::workers] for w in range(workers)])
        return {int(c): {n: v for n, v in state.items() if n in own} for c, state in states.items()}


def _scores(exp, sets: list[np.ndarray], skewed=None):
    """Server: each set's (correct, loss sum) under the loaded model, from one pass over
    their union in fixed chunks sharded over the workers (``_score_samples``), summed per
    set in sample order; None elsewhere. ``skewed``: (the run's ``SkewedSets``, the
    purpose, each set's client) where clients have feature skew."""
    comm = exp.comm
    sizes = np.asarray([len(s) for s in sets], dtype=np.int64)
    union = np.concatenate(sets) if sets else np.zeros(0, dtype=np.int64)
    inputs = None
    if skewed is not None:
        store, purpose, clients = skewed
        inputs = store.union(exp, purpose, clients, sets)
    rows = _score_samples(exp, union, comm.worker_index, comm.num_workers, inputs) \
        if comm.is_worker else np.zeros((0, 3))
    parts = comm.gatherv(rows.reshape(-1))
    if not comm.is_server:
        return None
    scored = np.zeros((len(union), 2))
    samples = np.concatenate(parts).reshape(-1, 3)
    scored[samples[:, 0].astype(np.int64)] = samples[:, 1:]
    return _per_client(scored[:, 0], sizes), _per_client(scored[:, 1], sizes)


class SkewedSets:
    """Clients' evaluation sets as their feature skew leaves them (fedmpi.data.augment.
    ClientSkew, ``partition.noise``/``brightness``/``saturation``): a set is prepared once
    per worker, its noise from the stream keyed by (seed, "eval-skew-" + purpose,
    client), so the same images are scored at every evaluation, on any worker; kept
    (float32, the prepared size of the sets this worker scores)."""

    def __init__(self, split, seed: int):
        self.split, self.seed = split, seed
        self.kept: dict[tuple[str, int], torch.Tensor] = {}

    def of(self, exp, purpose: str, c: int, samples: np.ndarray) -> torch.Tensor:
        key = (purpose, int(c))
        if key not in self.kept:
            data = exp.data
            x = data.train_x[torch.as_tensor(samples, dtype=torch.int64,
                                             device=data.train_x.device)]
            skew = self.split.skew(int(c))
            draw = None if skew is None else torch_generator(
                self.seed, "eval-skew-" + purpose, int(c),
                device=data.device if data.device.type == "cuda" else "cpu")
            self.kept[key] = data.prepare(x, draw, skew, augment=False)
        return self.kept[key]

    def union(self, exp, purpose: str, clients, sets):
        """``inputs(lo, hi)`` over the union of ``sets`` (client ``clients[i]``'s)."""
        starts = np.concatenate([[0], np.cumsum([len(s) for s in sets])]).astype(np.int64)

        def inputs(lo: int, hi: int) -> torch.Tensor:
            first = int(np.searchsorted(starts, lo, side="right")) - 1
            parts = []
            for i in range(max(first, 0), len(sets)):
                if starts[i] >= hi:
                    break
                a, b = max(lo, starts[i]) - starts[i], min(hi, starts[i + 1]) - starts[i]
                if b > a:
                    parts.append(self.of(exp, purpose, clients[i], sets[i])[a:b])
            return torch.cat(parts)
        return inputs


def _per_client(values: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Sums of consecutive runs of ``values``, of lengths ``sizes`` (a run may be empty),
    each in sample order."""
    owner = np.repeat(np.arange(len(sizes)), sizes)
    return np.bincount(owner, weights=values, minlength=len(sizes)).astype(np.float64)


@torch.no_grad()
def _score_samples(exp, samples: np.ndarray, worker: int, workers: int,
                   inputs=None) -> np.ndarray:
    """Rows (position, correct, loss) of this worker's chunks of ``samples`` (training set
    ids), each chunk ``exp.eval_batch`` samples, chunk j on worker j mod ``workers``.
    ``inputs(lo, hi)``: the model's input for positions lo..hi-1 (None: the samples as
    the test set is read, unskewed)."""
    module, data, size = exp.flat.module, exp.data, exp.eval_batch
    module.eval()
    chunks = range(worker, -(-len(samples) // size), workers)
    index = torch.as_tensor(samples, dtype=torch.int64, device=data.train_x.device)
    scores = []
    for j in chunks:
        part = index[j * size:(j + 1) * size]
        x = data.prepare(data.train_x[part], None) if inputs is None else \
            inputs(j * size, j * size + len(part))
        logits = module(x).float()
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
        sgd_step(params, flat.grads, lr, 0.0, 0.0)


def _finetune_units(sizes: list[int], group: int) -> list[list[int]]:
    """The fine-tuning groups of ``eval.client_finetune_group``: positions of the evaluated
    clients by non-increasing local training size (so non-increasing steps; ties by
    position), cut into runs of ``group``. Group j is worker j mod W's: cut from all
    evaluated clients and placed whole, a group computes the same bits on any layout."""
    order = sorted(range(len(sizes)), key=lambda k: (-sizes[k], k))
    return [order[g:g + group] for g in range(0, len(order), group)]


def _finetune_groups(exp, units: list[list[int]], personal, finetuning, score, epochs: int,
                     round_: int) -> None:
    """Fine-tuning in client groups: each row from its client's own start
    (``personal``), plain SGD at ``train.lr`` for ``epochs`` over the same batches as one
    client after another (fedmpi.algorithms.group_sgd), each row then loaded and scored;
    the same scores as one client after another up to float rounding."""
    cfg, flat = exp.config, exp.flat
    ctx = replace(round_context(cfg, round_, "train", ()), lr=cfg.train.lr, weight_decay=0.0,
                  grad_clip=0.0, momentum=0.0, nesterov=False, local_epochs=epochs,
                  local_schedule="constant", local_warmup=0, optimizer="sgd")
    for unit in units:
        tasks = [ClientTask(int(k), finetuning(k), flat, exp.device, autocast=exp.autocast)
                 for k in unit]
        rows, _, _ = group_sgd.train(tasks, torch.stack([personal(k) for k in unit]), ctx)
        for i, k in enumerate(unit):
            flat.load(rows[i])
            score(k)
