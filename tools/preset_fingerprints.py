"""Fingerprints of every preset's results: a refactor of the runtime must not change a bit.

    python tools/preset_fingerprints.py            # compare with the stored ones
    python tools/preset_fingerprints.py --write    # results changed on purpose: store anew
    python tools/preset_fingerprints.py --add      # a new kind of machine: add its set

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
so do the round metrics that report them). The worker processes therefore run with all
four pinned to their AVX2 code paths (``PINNED``), which any x86-64 CPU of the last
decade has. That made an AVX2-only AMD EPYC and an AVX-512 machine agree, but not a Xeon
with AMX: pinned as well, every case there differs in its last bits (numpy's version is
not the cause: 2.3.5 and 2.4.6 give the same bits there).

So the stored sets are kept per kind of machine, each under its *kernel canary*: one
training step of each model family the cases use (the CNN both layouts, the ResNet-18)
and the server's float64 algebra, on fixed inputs, in the same pinned workers, hashed.
Machines whose canaries agree ran the same kernels; the comparison takes the set stored
under this machine's canary. The set written before canaries existed (``UNRECORDED``, on
the AMD machine) is the comparison for a machine whose canary has no set, until the next
``--write`` replaces every set; a machine with neither has nothing to compare with.
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
from fedmpi.models import build_model
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

# MKL's conditional numerical reproducibility branch, ATen's dispatch, oneDNN's JIT
PINNED = {"MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
          "OPENBLAS_CORETYPE": "Haswell"}   # numpy's OpenBLAS: its AVX2 kernels
MACHINE_COLUMNS = ("time_", "mpi_bytes")    # measure the machine and transport, not the method
CLIENT_MACHINE_COLUMNS = ("seconds", "rank")


SSL_BASE = "fussl_fmnist_silo"
UNRECORDED = "unrecorded"   # the canary of the set stored before canaries were
STORED = Path(__file__).resolve().parents[1] / "tests" / "data" / "preset_fingerprints.json"


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
        extra = {"moon": ["model.proj_dim=16"],          # MOON's projection head
                 "fedbn": ['model.norm="batch"']}.get(name, [])   # FedBN's private layers
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


def kernel_canary() -> str:
    """What this machine's pinned kernels make of fixed inputs: the gradients of one step
    of each model family the cases train, and the server's float64 algebra (a Gram matrix
    and a least-squares solve, as FedU^2's EUA does). Changing any one library's pin
    changes it. One thread, as the cases run: a second splits the batch, and the weight
    gradients' sums with it."""
    torch.set_num_threads(1)
    digest = hashlib.sha256()
    for name, channels, size, layout in (("cnn", 1, 28, torch.channels_last),
                                         ("cnn", 1, 28, torch.contiguous_format),
                                         ("resnet18", 3, 16, torch.channels_last)):
        torch.manual_seed(0)
        model = build_model(name, channels, 10, size).to(memory_format=layout)
        x = torch.randn(16, channels, size, size).contiguous(memory_format=layout)
        torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (16,))).backward()
        for p in model.parameters():
            digest.update(p.grad.contiguous().numpy().tobytes())
    g = np.random.default_rng(0).standard_normal((6, 4096))
    gram = g @ g.T
    digest.update(gram.tobytes())
    digest.update(np.linalg.lstsq(gram + np.eye(6), np.ones(6), rcond=None)[0].tobytes())
    return digest.hexdigest()[:16]


def all_fingerprints(processes: int = 2, only=None) -> tuple[str, dict[str, dict[str, str]]]:
    """(kernel canary, every case's fingerprints; or those of the cases ``only``), in
    ``processes`` fresh processes at once (each run uses one thread), whose kernels are
    pinned (``PINNED``): every process starts, on demand, within this call, with PINNED in
    its environment before MKL, oneDNN, ATen or OpenBLAS choose."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    saved = {name: os.environ.get(name) for name in PINNED}
    os.environ.update(PINNED)
    try:
        with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(
                processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            canary = pool.submit(kernel_canary)
            jobs = {case: pool.submit(fingerprint, case, preset, overrides, Path(tmp))
                    for case, (preset, overrides) in cases().items()
                    if only is None or case in only}
            return canary.result(), {case: job.result() for case, job in jobs.items()}
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def compare(stored: dict, canary: str, found: dict, only=None) -> tuple[str, str]:
    """("same" | "changed" | "no set", what to say): ``found`` against the set stored
    for machines of this ``canary``, or else the set whose canary was not recorded;
    ``only``: the cases ``found`` holds, of a set that must still name exactly ``cases()``."""
    if only is not None:   # one shard: the whole set's cases first, then the shard's bits
        which = canary if canary in stored else UNRECORDED
        if which in stored and sorted(stored[which]["fingerprints"]) != sorted(cases()):
            return compare(stored, canary, dict.fromkeys(cases()))
        stored = {key: {**family, "fingerprints": {c: f for c, f in family["fingerprints"].items()
                                                   if c in only}}
                  for key, family in stored.items()}
    which = canary if canary in stored else UNRECORDED
    family = stored.get(which)
    if family is None:
        return "no set", (f"no fingerprints stored for this machine's kernels (canary {canary}; "
                          f"stored: {', '.join(sorted(stored))}); `python tools/preset_fingerprints.py "
                          f"--add` stores them, on a commit whose results you trust")
    expected = family["fingerprints"]
    if sorted(found) != sorted(expected):
        return "changed", (f"cases added or removed (against {which}): "
                           f"{sorted(set(found) ^ set(expected))}: regenerate on purpose (--write)")
    changed = {case: [part for part in expected[case] if found[case][part] != expected[case][part]]
               for case in expected if found[case] != expected[case]}
    if changed:
        return "changed", (f"results changed against the set for canary {which} ({family['cpu']}; "
                           f"this machine's canary: {canary}): {changed}")
    return "same", f"every case as stored for canary {which} ({family['cpu']})"


def cpu_name() -> str:
    """The CPU's model name and its widest vector units, for a person reading the store."""
    with open("/proc/cpuinfo") as f:
        info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
    info = {key.strip(): value.strip() for key, value in info.items()}
    flags = set(info.get("flags", "").split())
    units = [name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AMX", "amx_tile"))
             if flag in flags]
    return f"{info.get('model name', 'unknown CPU')} ({', '.join(units) or 'no AVX2'})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true",
                      help="results changed on purpose: store this machine's set, drop the others")
    what.add_argument("--add", action="store_true",
                      help="store this machine's set beside the others (results unchanged)")
    parser.add_argument("--stored", type=Path, default=STORED)
    args = parser.parse_args(argv)
    canary, found = all_fingerprints()
    stored = json.loads(args.stored.read_text()) if args.stored.exists() else {}
    if args.write or args.add:
        family = {"cpu": cpu_name(), "fingerprints": found}
        stored = {canary: family} if args.write else {**stored, canary: family}
        args.stored.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
        print(f"stored {len(found)} cases' fingerprints for canary {canary} ({family['cpu']}) "
              f"in {args.stored}; {len(stored)} set(s) there")
        return 0
    verdict, message = compare(stored, canary, found)
    print(message)
    return 0 if verdict == "same" else 1


if __name__ == "__main__":
    sys.exit(main())
