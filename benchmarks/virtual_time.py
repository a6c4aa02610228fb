"""Virtual time to accuracy under the synchronous round policies, and the clock's own cost.

Fashion-MNIST, 100 clients with Dirichlet(0.3) label skew, 10 per round, FedAvg, the
McMahan CNN, E = 1, B = 50; devices from ``[system_model] profiles = "lognormal"`` with
heavy tails (speed and bandwidth sigma 1: a tenth of the clients are 3.6x slower than
the median). Runs, in the same process one after another:

- ``off``: no system model (the wall-time reference);
- ``wait_all``: the round lasts as long as its slowest client;
- ``deadline``: clients past the deadline are dropped (default: the 70th percentile of
  all clients' participation times, printed);
- ``overselect``: 30% more clients selected, the first 10 to finish kept;
- ``fedbuff``: asynchronous, 10 clients in flight, a server step per 5 arrivals
  (staleness weight 1/sqrt(1 + tau)), run for twice the rounds: the same 1,000 client
  updates as 100 synchronous rounds of 10;
- ``fedasync``: asynchronous, 10 in flight, a step per arrival (mixing 0.6,
  polynomial staleness), ten times the rounds.

Prints, for each policy, the virtual hours until the test accuracy first reaches each
``--target``, the final accuracy and the clients dropped per round; then the clock's
overhead: median wall seconds per round with the clock (``wait_all``) against without
(target: within 3%), the time to schedule one round of 100,000 selected clients, and
the time per round to schedule 100,000 clients with trace and with Markov availability
(mask, draw among the available, times, over-selection, dropout; target < 1 s), and
the cost of FedBuff's event schedule per server step for 100,000 clients.

    python benchmarks/virtual_time.py                    # 100 rounds, targets 0.70 0.75 0.80
    python benchmarks/virtual_time.py --rounds 40 --target 0.7
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from fedmpi import config as cfgmod
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment
from fedmpi.runtime.devices import draw_profiles
from fedmpi.runtime.vclock import durations, schedule

SYSTEM_MODEL = {"profiles": "lognormal", "step_time": 0.05, "speed_sigma": 1.0,
                "down_mbps": 20.0, "up_mbps": 5.0, "bandwidth_sigma": 1.0, "latency": 0.05}


POLICIES = {"off": 1, "wait_all": 1, "deadline": 1, "overselect": 1, "fedbuff": 2, "fedasync": 10}


def workload(rounds: int) -> dict:
    return {"name": "vtime", "seed": 0, "rounds": rounds,
            "data": {"dataset": "fashion_mnist"},
            "partition": {"kind": "dirichlet", "alpha": 0.3},
            "clients": {"num": 100, "per_round": 10},
            "model": {"name": "cnn"}, "algorithm": {"name": "fedavg"},
            "train": {"local_epochs": 1, "batch_size": 50, "lr": 0.05},
            "eval": {"every": 5}}


def run(values: dict, out: Path) -> RunFile:
    values = {**values, "output": str(out)}
    run_experiment(cfgmod.from_dict(values), LocalComm(), quiet=True)
    return RunFile(out)


def default_deadline(values: dict, quantile: float) -> float:
    """The ``quantile`` of every client's participation time (the FedAvg messages, E
    epochs of its data): a deadline a fixed share of the population would miss."""
    config = cfgmod.from_dict({**values, "system_model": SYSTEM_MODEL})
    with tempfile.TemporaryDirectory() as tmp:
        with run({**values, "rounds": 1, "eval": {"every": 1000, "at_start": False},
                  "system_model": SYSTEM_MODEL}, Path(tmp) / "probe.h5") as r:
            sizes = r.partition()["client_sizes"]
            bytes_down = float(r.clients()["bytes_down"][0])
            bytes_up = float(r.clients()["bytes_up"][0])
    steps = config.train.local_epochs * -(-sizes // config.train.batch_size)
    profiles = draw_profiles(config.seed, len(sizes), config.system_model)
    times = durations(np.arange(len(sizes)), steps, bytes_down, bytes_up, profiles,
                      config.system_model.step_time)
    return float(np.quantile(times, quantile))


def hours_to(rounds: dict, target: float) -> float:
    reached = np.flatnonzero(np.nan_to_num(rounds["test_acc"]) >= target)
    return float(rounds["virtual_time"][reached[0]] / 3600) if len(reached) else float("nan")


def scheduling_seconds(clients: int = 100_000) -> float:
    """One round's schedule (times and the deadline cut) for ``clients`` selected clients."""
    model = cfgmod.from_dict({"system_model": SYSTEM_MODEL}).system_model
    profiles = draw_profiles(0, clients, model)
    ids = np.arange(clients)
    steps = np.random.default_rng(0).integers(1, 50, clients)
    t0 = time.perf_counter()
    times = durations(ids, steps, 4e6, 4e6, profiles, model.step_time)
    schedule(ids, times, "overselect", clients // 2, 0.0)
    return time.perf_counter() - t0


def availability_seconds(clients: int = 100_000, rounds: int = 5,
                         per_round: int = 10_000) -> dict[str, float]:
    """Mean seconds per round to schedule ``clients`` clients with availability (one
    figure per kind, ``trace`` and ``markov``): the round's mask (a trace of 4 intervals
    per client over a virtual day; the Markov chain stepped once), the draw of
    ``per_round`` among the available ones, and the selected clients' times and
    over-selection cut, with 10% mid-round dropout."""
    from types import SimpleNamespace

    from fedmpi.runtime.availability import Availability, dropout_mask
    from fedmpi.runtime.vclock import sample_available

    model = cfgmod.from_dict({"system_model": SYSTEM_MODEL}).system_model
    profiles = draw_profiles(0, clients, model)
    steps = np.random.default_rng(0).integers(1, 50, clients)
    rng = np.random.default_rng(1)
    starts = np.sort(rng.uniform(0, 86_400, (clients, 4)), axis=1).ravel()
    trace = (np.repeat(np.arange(clients), 4), starts, starts + rng.uniform(600, 7200, starts.size))
    out = {}
    for kind in ("trace", "markov"):
        m = SimpleNamespace(availability=kind, p_on_off=0.1, p_off_on=0.3, availability_file="")
        avail = Availability(m, 0, clients, trace=trace if kind == "trace" else None)
        now, t0 = 36_000.0, time.perf_counter()
        for t in range(rounds):
            pool = np.flatnonzero(avail.mask(t, now))
            chosen = sample_available(0, t, pool, per_round)
            times = durations(chosen, steps[chosen], 4e6, 4e6, profiles, model.step_time)
            stay = ~dropout_mask(0, t, chosen, clients, 0.1)
            _, length = schedule(chosen[stay], times[stay], "overselect", per_round // 2, 0.0)
            now += length
        out[kind] = (time.perf_counter() - t0) / rounds
    return out


def async_seconds(clients: int = 100_000, concurrency: int = 1_000, buffer: int = 100,
                  steps: int = 20) -> float:
    """Mean seconds per FedBuff server step of the event schedule alone, for ``clients``
    clients with heavy-tailed durations, ``concurrency`` in flight, ``buffer`` a step."""
    from fedmpi.runtime.asyncfl import AsyncSchedule

    model = cfgmod.from_dict({"system_model": SYSTEM_MODEL}).system_model
    profiles = draw_profiles(0, clients, model)
    times = durations(np.arange(clients), np.random.default_rng(0).integers(1, 50, clients),
                      4e6, 4e6, profiles, model.step_time)
    schedule_ = AsyncSchedule(0, times, concurrency, buffer)
    schedule_.step()   # the first C starts
    t0 = time.perf_counter()
    for _ in range(steps):
        schedule_.step()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--target", type=float, nargs="+", default=[0.70, 0.75, 0.80])
    ap.add_argument("--deadline-quantile", type=float, default=0.7)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--threads", type=int, default=0, help="system.threads (0: all cores)")
    args = ap.parse_args()
    values = {**workload(args.rounds), "system": {"threads": args.threads}}
    deadline = default_deadline(values, args.deadline_quantile)
    print(f"deadline: {deadline:.2f} s (the {args.deadline_quantile:.0%} quantile of the "
          f"clients' participation times)", flush=True)
    policies = {"off": None, "wait_all": {},
                "deadline": {"policy": "deadline", "deadline": deadline},
                "overselect": {"policy": "overselect", "overselect": 0.3},
                "fedbuff": {"policy": "fedbuff", "concurrency": 10, "buffer": 5},
                "fedasync": {"policy": "fedasync", "concurrency": 10, "mixing": 0.6}}
    walls, table = {}, []
    with tempfile.TemporaryDirectory(prefix="fedmpi-vtime-") as tmp:
        for name, policy in policies.items():
            if name not in args.policies:
                continue
            v = dict(values) if policy is None else {**values, "system_model": {**SYSTEM_MODEL, **policy}}
            steps = POLICIES[name]   # server steps per synchronous round: the same client updates
            v.update(rounds=args.rounds * steps, eval={"every": 5 * steps})
            with run(v, Path(tmp) / f"{name}.h5") as r:
                rounds = r.rounds()
                trained = rounds["round"] >= 1
                walls[name] = float(np.median(rounds["time_wall"][trained]))
                acc = float(rounds["test_acc"][-1])
                if policy is not None:
                    table.append((name, [hours_to(rounds, x) for x in args.target], acc,
                                  float(rounds["virtual_time"][-1] / 3600),
                                  float(np.mean(rounds["n_dropped"][trained]))))
            print(f"{name}: done, final acc {acc:.4f}", flush=True)
    header = " | ".join(f"h to {x:.0%}" for x in args.target)
    print(f"\n| policy | {header} | final acc | virtual h | dropped / round |")
    print("|---|" + "---|" * (len(args.target) + 3))
    for name, hours, acc, total, dropped in table:
        cells = " | ".join("not reached" if np.isnan(h) else f"{h:.2f}" for h in hours)
        print(f"| {name} | {cells} | {acc:.4f} | {total:.2f} | {dropped:.1f} |")
    if "off" in walls and "wait_all" in walls:
        print(f"\nwall s/round, median: off {walls['off']:.3f}, wait_all {walls['wait_all']:.3f} "
              f"(ratio {walls['wait_all'] / walls['off']:.3f}, target <= 1.03)")
    print(f"scheduling one round of 100,000 selected clients: {scheduling_seconds():.4f} s "
          f"(target < 1 s)")
    print(f"FedBuff's event schedule, 100,000 clients, 1,000 in flight, 100 a step: "
          f"{async_seconds():.4f} s a server step (target < 1 s)")
    per_kind = ", ".join(f"{k} {v:.4f} s" for k, v in availability_seconds().items())
    print(f"scheduling a round of 100,000 clients with availability: {per_kind} "
          f"(target < 1 s each)")


if __name__ == "__main__":
    main()
