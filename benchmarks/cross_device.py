"""W2, the cross-device workload: many small clients, small batches, small models.

Fashion-MNIST, 1,000 clients with Dirichlet(0.3) label skew (about 60 samples each), 50
clients per round, batch 10, E = 1 or 5 local epochs, FedAvg without clipping, the
McMahan et al. 2017 CNN or 2NN. Each local step is tiny, so a simulator's per-step
overhead and kernels too small to fill the cores decide the time. Variants, timed over
the same rounds (setup excluded) in one run:

- ``bare``: the sequential loop a researcher writes (torch.optim.SGD, the dataset
  normalised once, fedmpi's batch order), 2 threads;
- ``seq``: ``fedmpi run``, one process, clients one after another (client_group 1);
- ``groups``: ``fedmpi run``, one process, ``system.client_group = "auto"`` (all 50
  when the setup's probe times the group faster, else 1: the file's
  ``client_group_probe``; ``--group 50`` forces the group);
- ``seq-n3`` / ``groups-n3``: the same under ``mpirun -n 3`` (server + 2 workers,
  1 thread each; ``--group 25`` a group of 25 a worker).

Prints the median seconds per training round (the last round, which also scores the
test set, left out; a group run pays torch.func's one-time start-up at setup), the final
test accuracy of every variant and the speed-up of groups over fedmpi's own sequential
path (targets on a 2-core CPU: >= 2x for the 2NN,
>= 1x for the CNN, the same accuracy within seed noise; what was measured, on a 2-core
CPU and an H200: docs/performance.md, "Client groups"):

    python benchmarks/cross_device.py --model 2nn --epochs 1
    python benchmarks/cross_device.py --model cnn --rounds 6 --repeat 3 --variants seq groups
    python benchmarks/cross_device.py --model 2nn --rounds 100 --variants seq groups   # accuracy curve
    python benchmarks/cross_device.py --batches --device cuda   # a grouped round's batches alone
    python benchmarks/cross_device.py --profile --device cuda   # its training alone, profiled
    python benchmarks/cross_device.py --profile --model cnn  # and a gradient: by hand, vmap

``--device cuda`` runs every variant on the GPU (the bare loop too; the ``-n3`` variants
then put both workers on it, ``system.gpu_share``), where "auto" groups one-thread workers
too:

    python benchmarks/cross_device.py --device cuda --model cnn --variants bare seq groups

``--set KEY=VALUE`` (as ``fedmpi run --set``, repeatable) changes W2's config, e.g.
the layout:

    python benchmarks/cross_device.py --device cuda --model cnn --variants seq groups \
        --set model.channels_last=false
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import _sub, add_set_option, apply_sets, sets, time_fedmpi  # noqa: E402

from fedmpi import config as cfgmod  # noqa: E402
from fedmpi.results import RunFile  # noqa: E402

VARIANTS = ("bare", "seq", "groups", "seq-n3", "groups-n3")


def workload(model: str, epochs: int, rounds: int, device: str = "cpu") -> dict:
    return {
        "name": "w2", "seed": 0, "rounds": rounds,
        "data": {"dataset": "fashion_mnist"},
        "partition": {"kind": "dirichlet", "alpha": 0.3},
        "clients": {"num": 1000, "per_round": 50},
        "model": {"name": model},
        "algorithm": {"name": "fedavg"},
        "train": {"local_epochs": epochs, "batch_size": 10, "lr": 0.05, "grad_clip": 0.0},
        "eval": {"every": 100000, "at_start": False},   # scored once, after the last round
        "system": {"device": device, "gpu_share": device != "cpu"},
    }


def measure(variant: str, values: dict, tmp: Path, group) -> dict:
    if variant == "bare":   # overhead.py's bare loop, in its own process
        proc = _sub([sys.executable, str(Path(__file__).parent / "overhead.py"), "--bare",
                     "--values", json.dumps(values)])
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        return {"round": statistics.median(result["rounds"]), "acc": result["acc"]}
    values = json.loads(json.dumps(values))
    values["system"]["client_group"] = group if variant.startswith("groups") else 1
    path = tmp / f"{variant}.toml"
    path.write_text(cfgmod.to_toml(values))
    ranks = 3 if variant.endswith("-n3") else None
    out = tmp / f"{variant}.h5"
    result = time_fedmpi(path, out, ranks)
    with RunFile(out) as run:
        walls = run.rounds()["time_wall"]
    return {"round": float(np.median(walls[:-1] if len(walls) > 1 else walls)),
            "acc": result["acc"]}


def round_clients(values: dict):
    """(config, world, the clients of one round): W2's world built in this process, and
    50 of its clients (a round's sample) as the runtime hands a group, in non-increasing
    step counts."""
    from fedmpi import algorithms
    from fedmpi.comm import LocalComm
    from fedmpi.runtime.world import build_world

    config = cfgmod.from_dict(values)
    world = build_world(config, LocalComm(), algorithms.build("fedavg", {}))
    chosen = np.random.default_rng(0).choice(config.clients.num, config.clients.per_round,
                                             replace=False)
    group = sorted((world.data.client(world.split.client(c), 0, 1, int(c), 0) for c in chosen),
                   key=lambda c: -c.num_samples)
    return config, world, group


def _timed(world, passes: int, work) -> list[float]:
    """Seconds of each of ``passes`` calls of ``work``, the device drained around each."""
    sync = torch.cuda.synchronize if world.device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(passes):
        sync()
        start = time.perf_counter()
        work()
        sync()
        times.append(time.perf_counter() - start)
    return times


def time_batches(values: dict, repeat: int) -> None:
    """A grouped round's input pipeline alone, on the workload's data and device: every
    batch of a round's 50 clients stacked from each client's own stream
    (``ClientData.group_batches``) against gathered a step at a time for the whole group
    (``TensorClientData.group_batches``); the same bits, timed as the median of
    ``repeat`` passes."""
    from fedmpi.algorithms.base import ClientData
    from fedmpi.runtime.clientdata import TensorClientData

    config, world, group = round_clients(values)
    epochs, b = config.train.local_epochs, config.train.batch_size
    steps = group[0].num_steps(epochs, b)
    for name, source in (("per client", ClientData), ("gathered", TensorClientData)):
        times = _timed(world, repeat, lambda: sum(1 for _ in source.group_batches(group, epochs, b)))
        print(f"  {name:<10} {1e3 * statistics.median(times):7.2f} ms a round "
              f"({steps} steps, {len(group)} clients, {world.device})")


def profile_training(values: dict, repeat: int, top: int = 15) -> None:
    """A round's local training alone, none of the engine around it: FedAvg's local
    updates of a round's 50 clients one after another and as one group, each timed as
    the median of ``repeat`` passes; then the group under torch.profiler: the device's
    busy time per pass against the pass's wall time (on a GPU, how much of a group's
    round the device idles while the host launches), kernels launched, and the
    operators that take the host's time; then one step's gradient by hand against vmap
    (``compare_gradients``)."""
    from torch.profiler import ProfilerActivity, profile

    from fedmpi import algorithms
    from fedmpi.algorithms import ClientTask, RoundContext, group_sgd
    from fedmpi.runtime.system import numerics

    config, world, group = round_clients(values)
    t = config.train
    alg = algorithms.build("fedavg", {})
    tasks = [ClientTask(client=i, data=c, model=world.flat, device=world.device,
                        autocast=world.autocast) for i, c in enumerate(group)]
    ctx = RoundContext(round=1, phase="train", lr=t.lr, lr_prev=t.lr, global_lr=t.global_lr,
                       weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                       local_epochs=t.local_epochs, batch_size=t.batch_size,
                       num_clients=config.clients.num, participants=tuple(range(len(group))),
                       seed=0)
    payload = {"x": world.flat.params.detach().clone()}
    variants = {"sequential": lambda: [alg.local_update(task, payload, None, ctx) for task in tasks],
                "group": lambda: alg.local_update_group(tasks, payload, [None] * len(tasks), ctx)}
    group_sgd.warm_up(world.flat, world.autocast)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if world.device.type == "cuda" else [])
    with numerics(world.device, config.system.precision, config.system.deterministic):
        walls = {name: statistics.median(_timed(world, repeat, work))
                 for name, work in variants.items()}
        with profile(activities=activities) as prof:
            profiled = sum(_timed(world, repeat, variants["group"]))
    steps = group[0].num_steps(t.local_epochs, t.batch_size)
    print(f"A round's local training, {len(group)} clients ({steps} group steps), "
          f"{world.device}: sequential {1e3 * walls['sequential']:.1f} ms, group "
          f"{1e3 * walls['group']:.1f} ms ({walls['sequential'] / walls['group']:.2f}x)")
    events = prof.key_averages()
    busy = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
    launches = sum(e.count for e in events if "LaunchKernel" in e.key)
    print(f"profiled group passes: {1e3 * profiled / repeat:.1f} ms a pass (profiler on), "
          f"device busy {1e3 * busy / repeat:.1f} ms, {launches / repeat:.0f} kernel launches, "
          f"{sum(e.count for e in events if e.key.startswith('aten::')) / repeat:.0f} "
          f"operators a pass")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top))
    if world.device.type == "cuda":
        print(events.table(sort_by="self_device_time_total", row_limit=top))
    with numerics(world.device, config.system.precision, config.system.deterministic):
        compare_gradients(world, group, t, repeat, activities)


def compare_gradients(world, group, train, repeat: int, activities) -> None:
    """The first step's gradient of the whole group (every client's first batch) by the
    model's hand-written chain (fedmpi.algorithms.group_chain) and by torch.func.vmap:
    the median of ``repeat`` calls and the operators (and kernel launches) one call
    runs, as torch.profiler counts them (``activities``: the CPU's, and a GPU's)."""
    from torch.profiler import profile

    from fedmpi.algorithms import group_sgd

    model = group_sgd.group_model(world.flat)
    chain = model.chain
    if chain is None or world.autocast is not None:
        return
    x, y, weights = next(type(group[0]).group_batches(group, train.local_epochs,
                                                      train.batch_size))
    model.buffer(len(group)).copy_(world.flat.params.detach().expand(len(group), -1))
    for name, form in (("by hand", chain), ("vmap", None)):
        model.chain = form
        work = lambda: model.gradient_pieces(len(y), x, y, weights)  # noqa: E731
        wall = statistics.median(_timed(world, repeat + 1, work)[1:])
        with profile(activities=activities) as prof:
            _timed(world, 1, work)
        events = prof.key_averages()
        print(f"a group step's gradient ({len(y)} clients, {name:<7}): {1e3 * wall:7.2f} ms, "
              f"{sum(e.count for e in events if e.key.startswith('aten::'))} operators, "
              f"{sum(e.count for e in events if 'LaunchKernel' in e.key)} kernel launches")
    model.chain = chain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("2nn", "cnn"), default="2nn")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--group", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help='system.client_group of the groups variants (default "auto": the '
                         'group where the setup probe times it faster, else 1)')
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_set_option(ap)
    ap.add_argument("--batches", action="store_true",
                    help="time only a grouped round's batches: per client against gathered")
    ap.add_argument("--profile", action="store_true",
                    help="time and profile only a round's local training, sequential and as "
                         "one group")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{Path(__file__).name}: --device cuda, but torch {torch.__version__} finds no "
              f"CUDA device", file=sys.stderr)
        sys.exit(2)
    values = workload(args.model, args.epochs, args.rounds, args.device)
    values = apply_sets(ap, values, args.set)
    if args.batches:
        return time_batches(values, max(args.repeat, 20))
    if args.profile:
        return profile_training(values, max(args.repeat, 5))
    walls: dict[str, list[float]] = {v: [] for v in args.variants}
    accs: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="fedmpi-w2-") as tmp:
        for rep in range(args.repeat):
            for variant in args.variants:
                result = measure(variant, values, Path(tmp), args.group)
                walls[variant].append(result["round"])
                accs[variant] = result["acc"]
                print(f"rep {rep + 1} {variant:<10} {walls[variant][-1]:7.3f} s/round (median)  "
                      f"acc {result['acc']:.4f}", flush=True)
    med = {v: statistics.median(w) for v, w in walls.items()}
    print(f"\nW2: Fashion-MNIST, 1000 clients Dir(0.3), 50/round, B=10, E={args.epochs}, "
          f"{args.model}, FedAvg, {args.rounds} rounds, groups: client_group = {args.group}, "
          f"on {args.device}; medians of {args.repeat}{sets(args)}")
    for v in args.variants:
        print(f"  {v:<10} {med[v]:7.3f} s/round   final acc {accs[v]:.4f}")
    for a, b in (("seq", "groups"), ("seq-n3", "groups-n3"), ("bare", "groups")):
        if a in med and b in med:
            print(f"  {b} speed-up over {a}: {med[a] / med[b]:.2f}x")


if __name__ == "__main__":
    main()
