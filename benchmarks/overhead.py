"""fedmpi against a bare PyTorch loop doing exactly the same SGD steps, on one machine.

The reference workload: Fashion-MNIST, 100 clients with Dirichlet(0.3)
label skew, 10 clients per round, 1 local epoch, batch 50, the two-conv CNN with a
820-wide hidden layer (0.90M parameters), 20 rounds, FedAvg, gradient clipping at 10.
Every variant trains the same clients on the same batches in the same order (fedmpi's
keyed sampler and batch order), so the final models agree up to floating point.

Variants, each timed over the 20 rounds (setup excluded), in the same run:

- ``bare``: the loop a researcher writes: the model in the default layout, the dataset
  normalised to float once, ``torch.optim.SGD`` and ``clip_grad_norm_``, 2 threads.
- ``fedmpi``: ``fedmpi run`` in one process (2 threads).
- ``limit``: two 1-thread processes that each train their half of every round's clients
  and score their half of the test set in the last round (fedmpi's placement, kernels
  and evaluation chunks) with no communication at all: the best any 2-worker layout
  can do on 2 cores.
- ``mpirun``: ``mpirun -n 3 fedmpi run`` (server + 2 workers, 1 thread each).

Targets: fedmpi / bare <= 0.85; mpirun / limit <= 1.05. What was measured, on which
machine: docs/performance.md ("Per-step overhead", "Memory layout", "GPUs").

On a GPU (``--device cuda``) the workload is W1's GPU form: ResNet-18 with GroupNorm
(11.2M parameters) on CIFAR-shaped data (the synthetic set at 3x32x32: 20,000 training
and 2,000 test images, which it makes in seconds; 50,000 take it 15 s per process),
otherwise the same. The variants are then the bare loop on the
GPU (FP32: TF32 off, as fedmpi's default ``system.precision``), ``fedmpi run`` in one
process, and ``mpirun -n 2`` (a CPU server and one GPU worker) when mpirun is there;
the 2-process limit is a CPU notion and is left out.

    python benchmarks/overhead.py                 # full workload, 2 repetitions
    python benchmarks/overhead.py --rounds 5 --repeat 1  # quick look
    python benchmarks/overhead.py --device cuda --rounds 5 --repeat 1
    python benchmarks/overhead.py --device cuda --set model.channels_last=false  # NCHW
    python benchmarks/overhead.py --device cuda --rounds 5 --repeat 3 --layouts

``--layouts`` times only ``fedmpi run`` in one process, channels-last and NCHW
(``model.channels_last`` true, then false) one after the other, ``--repeat`` times, and
prints each run and the medians: the layout's cost on this machine, without the bare loop.

``--set KEY=VALUE`` (as ``fedmpi run --set``) changes the workload's config; the bare
loop reads its hyperparameters from it but always runs PyTorch's default layout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedmpi import config as cfgmod
from fedmpi.data import load_dataset, make_partition, to_float
from fedmpi.evaluation import chunks_of, evaluate_chunks
from fedmpi.algorithms.schedule import round_lr
from fedmpi.models import build_model
from fedmpi.runtime.experiment import eval_batch_size
from fedmpi.runtime.plan import place, sample_clients
from fedmpi.runtime.rng import key_seed, torch_generator
from fedmpi.runtime.system import tune_malloc

WORKLOAD = {
    "name": "bench", "seed": 0, "rounds": 20,
    "data": {"dataset": "fashion_mnist"},
    "partition": {"kind": "dirichlet", "alpha": 0.3},
    "clients": {"num": 100, "per_round": 10},
    "model": {"name": "cnn", "hidden": 820},
    "algorithm": {"name": "fedavg"},
    "train": {"local_epochs": 1, "batch_size": 50, "lr": 0.05, "grad_clip": 10.0},
    "eval": {"every": 1000},  # only the last round: the variants compare training
}


# W1 on a GPU: the same federation with ResNet-18-GN on CIFAR-shaped data
GPU_WORKLOAD = {
    "data": {"dataset": "synthetic", "num_train": 20000, "num_test": 2000, "channels": 3,
             "size": 32},
    "model": {"name": "resnet18"},
}


def workload(rounds: int, device: str = "cpu") -> dict:
    values = json.loads(json.dumps(WORKLOAD))
    values["rounds"] = rounds
    if device != "cpu":
        values.update(json.loads(json.dumps(GPU_WORKLOAD)))
    values["system"] = {"device": device}
    return values


def add_set_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="change the workload's config as `fedmpi run --set` does, e.g. "
                         "--set model.channels_last=false (repeatable)")


def apply_sets(ap: argparse.ArgumentParser, values: dict, items: list[str]) -> dict:
    """The workload's config ``values`` with the ``--set`` items on top (fedmpi's own
    overrides, checked against the config: a bad one is a one-line usage error)."""
    if not items:
        return values
    try:
        values = cfgmod.apply_overrides(values, items)
        cfgmod.from_dict(values)
    except ValueError as e:   # fedmpi's one-line UsageError
        ap.error(str(e))
    return values


def sets(args) -> str:
    """The ``--set`` items, for a summary line."""
    return "".join(f"; {item}" for item in args.set)


def bench_device(c) -> torch.device:
    """The config's system.device for a loop outside fedmpi ("auto": the GPU if any)."""
    name = c.system.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def setup(values):
    """Data, partition and the initial model exactly as the fedmpi runtime builds them."""
    c = cfgmod.from_dict(values)
    data = load_dataset(c.data.dataset, c.data.data_dir, seed=c.seed, **c.data.options)
    part = make_partition(c.partition.kind, data.train_y.numpy(), c.clients.num, c.seed,
                          **c.partition.params)
    torch.manual_seed(key_seed(c.seed, "init"))
    model = build_model(c.model.name, data.in_channels, data.num_classes, data.image_size,
                        **c.model.options)
    return c, data, part, model


def batches(c, part, t, client, n_epochs=1):
    """fedmpi's batch order for (seed, round, client, phase 0)."""
    idx = torch.as_tensor(part.client(client))
    order = torch_generator(c.seed, "batch", t, client, 0)
    for _ in range(n_epochs):
        perm = idx[torch.randperm(len(idx), generator=order)]
        for s in range(0, len(perm), c.train.batch_size):
            yield perm[s:s + c.train.batch_size]


# ---- bare loop --------------------------------------------------------------------------

def run_bare(values) -> dict:
    """The bare loop over the config's rounds: its model, E epochs, its round lr, clipping
    when grad_clip > 0. Returns the wall time (training and the final scoring), each
    round's seconds, the accuracy and the final parameters. On a GPU (system.device) the
    model and the normalised dataset live there, in FP32 (TF32 off, as fedmpi's default)."""
    from fedmpi.runtime.system import numerics

    torch.set_num_threads(2)
    tune_malloc()
    c, data, part, model = setup(values)
    device = bench_device(c)
    with numerics(device, "fp32", deterministic=False):
        return _bare_rounds(c, data, part, model.to(device), device)


def _bare_rounds(c, data, part, model, device) -> dict:
    # normalised once, as a bare loop does
    x_all = to_float(data.train_x, data.mean, data.std).to(device)
    y_all = data.train_y.to(device)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    sizes = part.sizes
    synchronize(device)
    t0, rounds = time.perf_counter(), []
    for t in range(c.rounds):
        start = time.perf_counter()
        total = {k: torch.zeros_like(v) for k, v in global_state.items()}
        clients = sample_clients(c.seed, t, c.clients.num, c.clients.per_round)
        weight = float(sizes[clients].sum())
        for client in clients.tolist():
            model.load_state_dict(global_state)
            opt = torch.optim.SGD(model.parameters(), lr=round_lr(c.train, t, c.rounds))
            model.train()
            for b in batches(c, part, t, client, c.train.local_epochs):
                b = b.to(device)
                opt.zero_grad()
                F.cross_entropy(model(x_all[b]), y_all[b]).backward()
                if c.train.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), c.train.grad_clip)
                opt.step()
            for k, v in model.state_dict().items():
                total[k] += v * (sizes[client] / weight)
        global_state = total
        synchronize(device)
        rounds.append(time.perf_counter() - start)
    model.load_state_dict(global_state)
    acc = _accuracy(model, data, device)
    wall = time.perf_counter() - t0
    params = torch.cat([v.reshape(-1) for v in global_state.values()]).cpu()
    return {"wall": wall, "rounds": rounds, "acc": acc, "params": params.tolist()}


@torch.no_grad()
def _accuracy(model, data, device, batch_size=1000) -> float:
    model.eval()
    correct = 0
    for s in range(0, len(data.test_y), batch_size):
        x = to_float(data.test_x[s:s + batch_size], data.mean, data.std).to(device)
        correct += int((model(x).argmax(1).cpu() == data.test_y[s:s + batch_size]).sum())
    return correct / len(data.test_y)


# ---- communication-free limit: one half of the clients, fedmpi's kernels ------------------

def run_half(values, part_index: int, parts: int) -> dict:
    """Train this process's share of every round (fedmpi placement, FlatModel NHWC,
    local SGD on the flat buffer), 1 thread, no communication."""
    from fedmpi.algorithms import ClientTask, build
    from fedmpi.flat import FlatModel
    from fedmpi.runtime.clientdata import DeviceData

    torch.set_num_threads(1)
    tune_malloc()
    c, data, part, model = setup(values)
    flat = FlatModel(model, channels_last=True)
    dev = DeviceData(data, torch.device("cpu"), augment=False, crop_padding=0, flip=False,
                     channels_last=True)
    alg = build("fedavg", {})
    x = flat.params.clone()
    exp = _context_factory(c)
    t0 = time.perf_counter()
    for t in range(c.rounds):
        clients = sample_clients(c.seed, t, c.clients.num, c.clients.per_round)
        mine = place(clients, -(-part.sizes // c.train.batch_size), parts)[part_index]
        ctx = exp(t, clients)
        acc = torch.zeros(flat.size)
        for client in mine.tolist():
            task = ClientTask(client, dev.client(part.client(client), c.seed, t, client, 0), flat,
                              torch.device("cpu"))
            upload = alg.local_update(task, {"x": x}, None, ctx)
            acc += upload.delta * float(upload.num_samples)
    flat.load(x)
    batch = eval_batch_size(c.eval.batch_size, ["cpu"])   # what fedmpi's CPU workers use
    chunks = chunks_of(len(data.test_y), batch, part_index, parts)
    evaluate_chunks(flat.module, dev, chunks, batch)
    return {"wall": time.perf_counter() - t0}


def _context_factory(c):
    from fedmpi.algorithms import RoundContext

    def make(t, clients):
        tr = c.train
        lr = tr.lr * tr.lr_decay ** t
        return RoundContext(round=t, phase="train", lr=lr, lr_prev=lr, global_lr=1.0,
                            weight_decay=tr.weight_decay, grad_clip=tr.grad_clip,
                            local_epochs=tr.local_epochs, batch_size=tr.batch_size,
                            num_clients=c.clients.num, participants=tuple(clients.tolist()),
                            seed=c.seed)
    return make


# ---- orchestration -----------------------------------------------------------------------

def _sub(args, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    if proc.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def time_fedmpi(config_path: Path, out: Path, ranks: int | None) -> dict:
    from fedmpi.results import RunFile

    cmd = [sys.executable, "-m", "fedmpi", "run", "-q", "--force", str(config_path), "-o", str(out)]
    if ranks:
        mpirun = str(Path(sys.executable).parent / "mpirun")
        cmd = [mpirun, "-n", str(ranks), "--oversubscribe", "--bind-to", "none"] + cmd
    _sub(cmd, env={"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    with RunFile(out) as run:
        rounds = run.rounds()
        trained = rounds["round"] >= 1   # round 0 scores the initial model: not in the workload
        return {"wall": float(rounds["time_wall"][trained].sum()), "acc": float(rounds["test_acc"][-1]),
                "params": run.model()}


def time_limit(config_values: dict) -> dict:
    blob = json.dumps(config_values)
    procs = [subprocess.Popen([sys.executable, __file__, "--half", str(k), "--values", blob],
                              stdout=subprocess.PIPE, text=True) for k in range(2)]
    walls = [json.loads(p.communicate()[0].strip().splitlines()[-1])["wall"] for p in procs]
    return {"wall": max(walls)}


def time_bare(config_values: dict) -> dict:
    proc = _sub([sys.executable, __file__, "--bare", "--values", json.dumps(config_values)])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--only-mpi", action="store_true",
                    help="time only the comm-free limit and mpirun (the MPI-overhead ratio)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: W1's GPU form (ResNet-18-GN, CIFAR-shaped data) on the GPU")
    ap.add_argument("--layouts", action="store_true",
                    help="time only fedmpi in one process, channels-last against NCHW, "
                         "alternated")
    add_set_option(ap)
    ap.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--half", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--values", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare:
        print(json.dumps(run_bare(json.loads(args.values))))
        return
    if args.half is not None:
        print(json.dumps(run_half(json.loads(args.values), args.half, 2)))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{Path(__file__).name}: --device cuda, but torch {torch.__version__} finds no "
              f"CUDA device", file=sys.stderr)
        sys.exit(2)
    values = workload(args.rounds, args.device)
    values = apply_sets(ap, values, args.set)
    with tempfile.TemporaryDirectory(prefix="fedmpi-bench-") as tmp:
        if args.layouts:
            measure_layouts(args, values, Path(tmp))
        else:
            (measure_gpu if args.device == "cuda" else measure)(args, values, Path(tmp))


def bare_and_single(values, config_path: Path, tmp: Path, times: dict) -> str:
    """The bare loop and ``fedmpi run`` in one process on the same workload: their wall
    times appended to ``times``; returns the text that reports them."""
    bare = time_bare(values)
    single = time_fedmpi(config_path, tmp / "single.h5", None)
    diff = float(np.max(np.abs(np.asarray(bare["params"]) - single["params"])))
    times["bare"].append(bare["wall"])
    times["fedmpi"].append(single["wall"])
    return (f"bare {bare['wall']:.2f} s (acc {bare['acc']:.4f})  fedmpi {single['wall']:.2f} s "
            f"(acc {single['acc']:.4f})  max |bare - fedmpi| param diff {diff:.2e}")


def measure(args, values, tmp: Path) -> None:
    config_path = tmp / "bench.toml"
    config_path.write_text(cfgmod.to_toml(values))
    times = {"bare": [], "fedmpi": [], "limit": [], "mpirun": []}
    for rep in range(args.repeat):
        if not args.only_mpi:
            print(f"rep {rep + 1}: {bare_and_single(values, config_path, tmp, times)}", flush=True)
        limit = time_limit(values)
        multi = time_fedmpi(config_path, tmp / "mpi.h5", 3)
        times["limit"].append(limit["wall"])
        times["mpirun"].append(multi["wall"])
        print(f"rep {rep + 1}: limit {limit['wall']:.2f} s  mpirun -n 3 {multi['wall']:.2f} s "
              f"(acc {multi['acc']:.4f})", flush=True)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    print(f"\nworkload: {args.rounds} rounds, 100 clients Dir(0.3), 10/round, E=1, B=50, "
          f"cnn 0.90M params, Fashion-MNIST; medians of {args.repeat}{sets(args)}")
    if "bare" in med:
        print(f"  fedmpi (1 process) / bare loop      = {med['fedmpi'] / med['bare']:.3f}   (target <= 0.85)")
        print(f"  comm-free limit / fedmpi 1 process   = {med['limit'] / med['fedmpi']:.3f}")
    print(f"  mpirun -n 3 / comm-free 2-proc limit = {med['mpirun'] / med['limit']:.3f}   (target <= 1.05)")


def measure_layouts(args, values, tmp: Path) -> None:
    """``fedmpi run`` in one process with channels-last and with NCHW storage and
    activations, alternated, ``args.repeat`` times each."""
    times = {"true": [], "false": []}
    for rep in range(args.repeat):
        for layout in times:
            config_path = tmp / f"channels_last_{layout}.toml"
            config_path.write_text(cfgmod.to_toml(
                cfgmod.apply_overrides(values, [f"model.channels_last={layout}"])))
            run = time_fedmpi(config_path, tmp / f"channels_last_{layout}.h5", None)
            times[layout].append(run["wall"])
            print(f"rep {rep + 1}: model.channels_last={layout:5s} fedmpi {run['wall']:.2f} s "
                  f"(acc {run['acc']:.4f})", flush=True)
    last, nchw = (statistics.median(times[k]) for k in ("true", "false"))
    print(f"\nworkload: {args.rounds} rounds, {values['model']['name']} on "
          f"{values['system']['device']}; medians of {args.repeat}{sets(args)}")
    print(f"  channels-last {last:.2f} s, NCHW {nchw:.2f} s: NCHW / channels-last = "
          f"{nchw / last:.3f}")


def measure_gpu(args, values, tmp: Path) -> None:
    """W1 on a GPU: the bare loop, fedmpi in one process and, with mpirun, a CPU server
    and one GPU worker, timed over the same rounds."""
    from fedmpi.runtime.system import kernels

    config_path = tmp / "bench.toml"
    config_path.write_text(cfgmod.to_toml(values))
    have_mpirun = (Path(sys.executable).parent / "mpirun").exists()
    times = {"bare": [], "fedmpi": []} | ({"mpirun": []} if have_mpirun else {})
    for rep in range(args.repeat):
        line = f"rep {rep + 1}: {bare_and_single(values, config_path, tmp, times)}"
        if have_mpirun:
            multi = time_fedmpi(config_path, tmp / "mpi.h5", 2)
            times["mpirun"].append(multi["wall"])
            line += f"  mpirun -n 2 {multi['wall']:.2f} s (acc {multi['acc']:.4f})"
        print(line, flush=True)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    print(f"\nworkload: {args.rounds} rounds, 100 clients Dir(0.3), 10/round, E=1, B=50, "
          f"ResNet-18-GN 11.2M params, synthetic 3x32x32 (20,000 train), FP32, on "
          f"{kernels(bench_device(cfgmod.from_dict(values)))}; medians of {args.repeat}"
          f"{sets(args)}")
    print(f"  bare loop                       {med['bare']:.2f} s")
    print(f"  fedmpi (1 process) / bare loop  = {med['fedmpi'] / med['bare']:.3f}")
    if "mpirun" in med:
        print(f"  mpirun -n 2 / fedmpi 1 process  = {med['mpirun'] / med['fedmpi']:.3f}")


if __name__ == "__main__":
    main()
