"""Fingerprints of every preset's results: a refactor of the runtime must not change a bit.

    python tools/preset_fingerprints.py --write tests/data/preset_fingerprints.json
    python tools/preset_fingerprints.py            # compare with the stored ones

Each preset, and every algorithm without a preset of its own on the `default` preset
(self-supervised ones on `fussl_fmnist_silo`), runs single-process (two cases at a time, in
two worker processes, one thread each) for 2 rounds in deterministic mode on a small
synthetic stand-in for its data (the preset's model, algorithm, partition and training
rules; fewer clients, samples and local steps; presets that come out equal once shrunk
run once), and its results file is reduced to a SHA-256 of the
round metrics (every /rounds column but the timings and the MPI byte count, which
measure the machine and the transport, not the method), of the per-client rows, and of
the final model. `tests/test_preset_fingerprints.py` does the comparison.

Bitwise equality needs the same kernels, and MKL, oneDNN and PyTorch's own vectorised
kernels each pick theirs by the CPU's instruction set, as does the OpenBLAS inside numpy's
wheel (the server's float64 algebra: FedU^2's EUA weights differ in their last bits, and
so do the round metrics that report them): on AVX-512 and on AVX2 machines the same run
differs in its last bits. The worker processes therefore run with all four pinned to
their AVX2 code paths (``PINNED``), which any x86-64 CPU of the last decade has, so the
stored set does not depend on whether a CI machine has AVX-512 (same torch version and
CPU build; on an AVX2 machine the pinned bits are the native ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from fedmpi import config as cfgmod
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

# MKL's conditional numerical reproducibility branch, ATen's dispatch, oneDNN's JIT
PINNED = {"MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
          "OPENBLAS_CORETYPE": "Haswell"}   # numpy's OpenBLAS: its AVX2 kernels
MACHINE_COLUMNS = ("time_", "mpi_bytes")    # measure the machine and transport, not the method
CLIENT_MACHINE_COLUMNS = ("seconds", "rank")


SSL_BASE = "fussl_fmnist_silo"


def small(preset: str) -> list[str]:
    """Overrides that shrink a preset to seconds while keeping what makes it that preset."""
    values = cfgmod.load_preset(preset)
    image = values.get("model", {}).get("name", "cnn") != "lstm"
    # on the CPU wherever it runs: the stored bits are the CPU's (a GPU has its own)
    overrides = ['system.device="cpu"', "rounds=2", "system.deterministic=true", "system.threads=1",
                 "clients.num=6", "clients.per_round=3", "train.local_epochs=1",
                 "train.batch_size=16", "eval.every=1", "eval.probes=[]",
                 "eval.batch_size=64", "system.checkpoint_every=1"]
    if image:
        # the CIFAR presets train a ResNet-18: fewer, smaller images (a batch or two a client)
        colour = "cifar" in preset
        overrides += ['data.dataset="synthetic"', "data.data_dir=''",
                      f"data.num_train={96 if colour else 240}", f"data.num_test={32 if colour else 48}",
                      f"data.size={16 if colour else 28}", f"data.channels={3 if colour else 1}",
                      "data.num_classes=10"]
        if values.get("data", {}).get("public_size"):
            overrides.append(f"data.public_size={16 if colour else 40}")
    return overrides


def cases() -> dict[str, tuple[str, list[str]]]:
    """name -> (preset, overrides): the presets, then each algorithm on its family's base."""
    from fedmpi.algorithms import REGISTRY

    found, seen = {}, set()
    for preset in cfgmod.presets():
        resolved = cfgmod.resolve(None, preset, small(preset)).to_dict()
        resolved.pop("name")
        key = json.dumps(resolved, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            found[preset] = (preset, small(preset))
    for name, cls in sorted(REGISTRY.items()):
        if not cls.__module__.startswith("fedmpi."):
            continue   # a plugin's (the tests' toy algorithms): not fedmpi's to fingerprint
        if any(preset == name or preset.startswith(name + "_") for preset in found):
            continue   # run on its own preset already
        base = "default" if cls.supervised else SSL_BASE
        extra = ["model.proj_dim=16"] if name == "moon" else []   # MOON's projection head
        # the base's parameters this algorithm also takes (the SSL heads), given explicitly:
        # a new algorithm.name alone would drop them (fedmpi.config.sources)
        takes = {f.name for f in dataclasses.fields(cls.Params)}
        extra += [f"algorithm.{k}={cfgmod.toml_value(v)}" for k, v in cfgmod.load_preset(base).get("algorithm", {}).items()
                  if k in takes and k != "name"]
        found[f"algorithm={name}"] = (base, small(base) + [f'algorithm.name="{name}"', *extra])
    return found


def fingerprint(case: str, preset: str, overrides: list[str], directory: Path) -> dict[str, str]:
    out = directory / f"{case}.h5"
    config = cfgmod.resolve(None, preset, overrides + [f'output="{out}"'])
    torch.manual_seed(0)
    run_experiment(config, LocalComm(), quiet=True)
    with RunFile(out) as run:
        rounds, clients = run.rounds(), run.clients()
        return {
            "rounds": _digest({k: v for k, v in rounds.items() if not k.startswith(MACHINE_COLUMNS)}),
            "clients": _digest({k: v for k, v in clients.items()
                                if not k.startswith(CLIENT_MACHINE_COLUMNS)}),
            "model": _digest({"final": run.model()}),
        }


def _digest(columns: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(columns):
        values = np.ascontiguousarray(columns[name])
        h.update(name.encode() + str(values.dtype).encode() + str(values.shape).encode())
        h.update(values.tobytes())
    return h.hexdigest()


def all_fingerprints(processes: int = 2) -> dict[str, dict[str, str]]:
    """Every case, in ``processes`` fresh processes at once (each run uses one thread),
    whose kernels are pinned (``PINNED``): every process starts, on demand, within this
    call, with PINNED in its environment before MKL, oneDNN, ATen or OpenBLAS choose."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    saved = {name: os.environ.get(name) for name in PINNED}
    os.environ.update(PINNED)
    try:
        with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(
                processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            jobs = {case: pool.submit(fingerprint, case, preset, overrides, Path(tmp))
                    for case, (preset, overrides) in cases().items()}
            return {case: job.result() for case, job in jobs.items()}
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="JSON", help="store the fingerprints here")
    parser.add_argument("--stored", default=str(Path(__file__).resolve().parents[1] / "tests" / "data"
                                                / "preset_fingerprints.json"))
    args = parser.parse_args(argv)
    found = all_fingerprints()
    if args.write:
        Path(args.write).write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(found)} presets' fingerprints to {args.write}")
        return 0
    stored = json.loads(Path(args.stored).read_text())
    changed = [p for p in stored if found.get(p) != stored[p]]
    for preset in changed:
        parts = [k for k in stored[preset] if found.get(preset, {}).get(k) != stored[preset][k]]
        print(f"{preset}: {', '.join(parts)} changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
