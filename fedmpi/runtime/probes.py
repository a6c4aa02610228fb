"""Probes of a self-supervised run's global encoder into /eval (config ``eval.probes``).

FedU^2's protocols (Liao et al., CVPR 2024; fedmpi.evaluation.ssl): the linear probe on frozen
features, fine-tuning on 1% / 10% stratified labels, and the singular values of the
feature covariance (FedU^2 Figure 3). The linear probe and each fine-tuning are whole
sequential trainings, dealt to workers round-robin; the spectrum's test chunks are sharded
like the kNN bank. Every task's draws are keyed by (seed, round, task), the labelled subset
by the fraction only (the same at every evaluation), and chunks are fixed, so a probe gives
the same bits for any number of workers. Used by the runtime on probe rounds and by
``fedmpi evaluate`` on a finished run's final model.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from .. import algorithms
from ..comm import LocalComm
from ..config import apply_overrides, from_dict, parse_override
from ..errors import UsageError
from ..evaluation import (effective_rank, probe_column, probe_tasks, run_probe, spectrum,
                          spectrum_worker)
from ..results import RunFile
from ..results.reader import not_a_file
from ..results.writer import append_eval, reopen
from .rng import key_seed
from .runfile import take_over
from .world import build_world


def run(comm, encoder, data, num_classes: int, config, round_: int, local=None):
    """Every rank calls this with the evaluated model loaded on the workers; returns
    (/eval row, spectrum or None, {client: local spectrum}) on the server, Nones elsewhere.
    ``local``: this worker's spectra of its clients' local models (eval.local_spectra)."""
    t0 = time.perf_counter()
    e, seed = config.eval, config.seed
    results, chunks = {}, []
    if comm.is_worker:
        for i, task in enumerate(probe_tasks(e.probes, e.finetune_fractions)):
            if i % comm.num_workers != comm.worker_index:
                continue
            subset_seed = key_seed(seed, "labelled", round(task[1] * 1e6))
            results[probe_column(task)] = run_probe(
                task, encoder, data, num_classes, subset_seed, key_seed(seed, "probe", round_, i),
                linear_epochs=e.linear_epochs, finetune_epochs=e.finetune_epochs,
                finetune_head=e.finetune_head, linear_head=e.linear_head)
        if "spectrum" in e.probes:
            chunks = spectrum_worker(encoder, data, comm.worker_index, comm.num_workers)
    parts = comm.gather_obj((results, chunks, local or {}))
    if not comm.is_server:
        return None, None, None
    row, values, spectra = {"round": round_}, None, {}
    for part, _, clients in parts:
        row.update(part)
        spectra.update(clients)
    if "spectrum" in e.probes:
        values = spectrum([c for _, c, _ in parts])
        row["effective_rank"] = effective_rank(torch.from_numpy(values))
    row["seconds"] = time.perf_counter() - t0
    return row, values, dict(sorted(spectra.items()))


def describe(row: dict) -> str:
    shown = "  ".join(f"{k} {v:.4f}" for k, v in row.items() if k not in ("round", "seconds", "posthoc"))
    return f"probes after round {row['round']}: {shown}  ({row['seconds']:.0f} s)"


DEFAULT_POSTHOC = ("linear", "spectrum")


def evaluate_file(path, probe_names=(), overrides=(), quiet: bool = False) -> dict:
    """``fedmpi evaluate``: probe the final model of a finished self-supervised run (one
    process) and append the row to the file's /eval. ``probe_names`` default to the
    run's eval.probes, else linear + spectrum; ``overrides`` are eval.<field>=<value>."""
    for text in overrides:
        if parse_override(text)[0][0] != "eval":
            raise UsageError(f"--set {text!r}: evaluate takes eval.<field> only")
    if not Path(path).is_file():   # before the lock, which would make its directory
        raise UsageError(not_a_file(path))
    # the file's writer for as long as this takes: a `fedmpi run --force` onto it meanwhile
    # would replace it, and this run's probe row would go into the new run's file. An
    # evaluate killed while it wrote its row left the file open: repaired before the probe.
    path, lock = take_over(path)
    try:
        return _evaluate_locked(path, probe_names, overrides, quiet)
    finally:
        lock.release()


def _evaluate_locked(path, probe_names, overrides, quiet: bool) -> dict:
    with RunFile(path) as done:
        values, status, names = done.config, done.status, done.model_names()
        start = done.start_dir
        if "final" not in names:
            raise UsageError(f"{path}: no final model (status {status!r}); evaluate a completed run")
        vector = done.model("final")
        completed = int(done.rounds()["round"][-1])
    values = apply_overrides(values, list(overrides))
    values.setdefault("eval", {})["probes"] = list(
        probe_names or values["eval"].get("probes") or DEFAULT_POSTHOC)
    # the clients' local models are not in the file: their spectra were taken during the
    # run, and the run's setting must not refuse `--probe linear` (it needs "spectrum")
    values["eval"]["local_spectra"] = False
    comm = LocalComm()
    with contextlib.chdir(start or "."):   # the run's relative data paths, as it read them
        config = from_dict(values)
        alg = algorithms.build(config.algorithm.name, config.algorithm.params)
        if alg.supervised:
            raise UsageError(f"{path}: algorithm {config.algorithm.name!r} is supervised; "
                             f"probes are for self-supervised encoders")
        world = build_world(config, comm, alg, run=False)   # standard layout: the file's order
    world.flat.load(torch.from_numpy(vector).to(world.device))
    row, values, _ = run(comm, world.flat.module.encoder, world.data, world.dataset.num_classes,
                         config, completed)
    row["posthoc"] = 1.0
    h5file = reopen(path)
    try:
        append_eval(h5file, row, values, None, overrides=list(overrides))
    finally:
        h5file.close()
    if not quiet:
        print(describe(row), flush=True)
    return row
