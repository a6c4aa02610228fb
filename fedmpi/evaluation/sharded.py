"""Self-supervised evaluations sharded over workers: the kNN monitor of every evaluation
round, and the probes into /eval (FedU^2's protocols; config ``eval.probes``).

Each worker computes its share over fixed chunks (``fedmpi.evaluation.ssl`` holds the
primitives), so the server's merged result does not depend on the number of workers.
"""

from __future__ import annotations

import numpy as np
import torch

from .spectrum import combine_covariance_sums, covariance_sums, spectrum_from_sums
from .ssl import (BANK_BLOCK, features, fine_tune, knn_merge, knn_partial, linear_probe,
                  merge_partials, stratified_subset)

# ---- representation learners: the kNN monitor (FedU^2 code) -----------

KNN_K, KNN_TEMPERATURE = 200, 0.1


def knn_worker(encoder, data, worker: int, num_workers: int, k: int = KNN_K):
    """This worker's share of the kNN monitor: bank chunks j = worker, worker + W, ... of
    the training set (each ``BANK_BLOCK`` rows, so the bits do not depend on the split),
    against every test sample. Returns the merged top-k of its chunks (or None).

    Images go in as every batch does (``data.prepare``: normalised, no augmentation)."""
    n_bank = len(data.train_y)
    starts = range(worker * BANK_BLOCK, n_bank, num_workers * BANK_BLOCK)
    if not len(starts):
        return None
    with torch.no_grad():
        prepare = lambda x: data.prepare(x, None)  # noqa: E731
        test = features(encoder, data.test_x, prepare, normalize=True)
        parts = []
        for start in starts:
            end = min(start + BANK_BLOCK, n_bank)
            bank = features(encoder, data.train_x[start:end], prepare, normalize=True)
            parts.append(knn_partial(test, bank, data.train_y[start:end], k, bank_offset=start))
    return merge_partials(parts, k)


def knn_accuracy(partials, test_y, num_classes: int, k: int = KNN_K,
                 temperature: float = KNN_TEMPERATURE) -> float:
    """Server: merge the workers' top-k lists exactly and vote."""
    predictions = knn_merge([p for p in partials if p is not None], k, temperature, num_classes)
    # host sync: once per evaluation, on the server
    return float((predictions.cpu() == test_y.cpu()).double().mean())


# ---- representation probes into /eval (FedU^2's protocols; config eval.probes) ------------

SPECTRUM_CHUNK = 512  # test rows per covariance chunk: fixed, so the bits do not depend on W


def probe_tasks(probes, fractions) -> list[tuple[str, float]]:
    """The sequential trainings of a probe evaluation, dealt to workers round-robin:
    the linear probe, then one fine-tuning per labelled fraction."""
    tasks = [("linear", 1.0)] if "linear" in probes else []
    return tasks + ([("finetune", f) for f in fractions] if "finetune" in probes else [])


def probe_column(task: tuple[str, float]) -> str:
    """/eval column of a task: linear_acc, finetune_1pct_acc, finetune_0.5pct_acc, ..."""
    kind, fraction = task
    return "linear_acc" if kind == "linear" else f"finetune_{100 * fraction:g}pct_acc"


def run_probe(task, encoder, data, num_classes: int, seed: int, key: int, *,
              linear_epochs: int, finetune_epochs: int, finetune_head: str = "raw",
              linear_head: str = "raw") -> float:
    """Test accuracy of one probe task on this worker (fedmpi.evaluation.ssl): ``seed`` fixes
    the labelled subset (the same at every evaluation), ``key`` the training's draws."""
    kind, fraction = task
    prepare = lambda x: data.prepare(x, None)  # noqa: E731
    generator = torch.Generator(device=data.device).manual_seed(key)
    if kind == "linear":
        train = features(encoder, data.train_x, prepare)
        test = features(encoder, data.test_x, prepare)
        return linear_probe(train, data.train_y, test, data.test_y, num_classes, generator,
                            epochs=linear_epochs, head_input=linear_head)
    idx = torch.as_tensor(stratified_subset(data.train_y, fraction, seed), device=data.device)
    result = fine_tune(encoder, data.train_x[idx], data.train_y[idx], data.test_x, data.test_y,
                       num_classes, generator, prepare=prepare, epochs=finetune_epochs,
                       head_input=finetune_head)
    return result.best


def spectrum_worker(encoder, data, worker: int, num_workers: int) -> list:
    """(chunk, CovarianceSums) of test chunks j = worker, worker + W, ...: l2-normalised
    encoder features (the kNN monitor's z), SPECTRUM_CHUNK rows each."""
    prepare = lambda x: data.prepare(x, None)  # noqa: E731
    n = len(data.test_y)
    return [(start // SPECTRUM_CHUNK, covariance_sums(features(
                encoder, data.test_x[start:start + SPECTRUM_CHUNK], prepare, normalize=True)))
            for start in range(worker * SPECTRUM_CHUNK, n, num_workers * SPECTRUM_CHUNK)]


def spectrum(parts) -> np.ndarray:
    """Server: singular values (descending) of the feature covariance, chunks in order."""
    chunks = sorted((c for part in parts for c in part), key=lambda c: c[0])
    sums = combine_covariance_sums([s for _, s in chunks])
    return spectrum_from_sums(sums).cpu().numpy()  # host sync: once per evaluation, server
