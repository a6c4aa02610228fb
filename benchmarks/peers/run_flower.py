"""Flower simulation (Ray engine, Message API) on a peers workload file, in Flower's own environment.

How Flower is made to do the bare loop's work, step for step:

- the simulation: ``flwr.simulation.run_simulation`` with one SuperNode per client of
  the population (100 for W1, 1,000 for W2), a ``ServerApp`` running Flower's own
  ``FedAvg`` strategy (``flwr.serverapp.strategy``: the mean weighted by each reply's
  ``num-examples``, as fedmpi and the bare loop), no federated evaluation
  (``fraction_evaluate = 0``);
- the cohort: ``configure_train`` is overridden to send round t's messages to the
  workload's sampled clients, client c being the c-th SuperNode in the order of the
  Grid's node ids; each message carries the model and, in its config, the client, the
  round, the learning rate and the workload file; the ``ClientApp`` trains that client's
  samples in fedmpi's batch order for that round, cut into the same batches (one local
  epoch), with ``torch.optim.SGD`` and ``clip_grad_norm_`` as the bare loop;
- resources: ``--actors 1`` (default) gives each ClientApp 2 CPUs (one Ray actor at a
  time on a 2-core machine, 2 torch threads, as the other runners), ``--actors 2`` 1 CPU
  each (two actors side by side, 1 torch thread each).

Each round's seconds come from Flower's server-side ``evaluate_fn``, which the strategy
calls after every round (and once before the first). The ClientApp counts its SGD steps
and returns them as a metric; the server adds them up.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from common import cli, finish, load_once, loss

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app import MessageType
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

HERE = Path(__file__).resolve().parent
client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    config = msg.content["config"]
    torch.set_num_threads(int(config["threads"]))
    w = load_once(str(config["workload"]))
    model = w.build_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=float(config["lr"]))
    model.train()
    x, y = w.client_data(int(config["round"]), int(config["k"]))
    steps = 0
    for s in range(0, len(y), w.batch_size):
        opt.zero_grad()
        loss(model, x[s:s + w.batch_size], y[s:s + w.batch_size]).backward()
        if w.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), w.grad_clip)
        opt.step()
        steps += 1
    metrics = MetricRecord({"num-examples": len(y), "steps": steps})
    return Message(content=RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                       "metrics": metrics}), reply_to=msg)


class WorkloadFedAvg(FedAvg):
    """Flower's FedAvg, sending each round to the workload's sampled clients."""

    def __init__(self, w, path: str, threads: int):
        super().__init__(fraction_evaluate=0.0)
        self.w, self.path, self.threads, self.steps = w, path, threads, 0

    def configure_train(self, server_round, arrays, config, grid):
        t = server_round - 1
        nodes = sorted(grid.get_node_ids())
        messages = []
        for k, client in enumerate(self.w.clients[t].tolist()):
            cfg = ConfigRecord({"round": t, "k": k, "client": client, "lr": float(self.w.lr[t]),
                                "workload": self.path, "threads": self.threads})
            messages.append(Message(content=RecordDict({"arrays": arrays, "config": cfg}),
                                    message_type=MessageType.TRAIN, dst_node_id=nodes[client]))
        return messages

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.steps += sum(int(r.content["metrics"]["steps"]) for r in replies if not r.has_error())
        return super().aggregate_train(server_round, replies)


def main() -> None:
    import argparse

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--actors", type=int, choices=[1, 2], default=1)
    known, rest = pre.parse_known_args()
    sys.argv = [sys.argv[0]] + rest
    args = cli(__doc__)
    path = str(args.workload.resolve())
    w = load_once(path)
    threads = args.threads if known.actors == 1 else 1
    strategy = WorkloadFedAvg(w, path, threads)
    clock: dict = {"rounds": [], "final": None}

    def tick(server_round, arrays):
        now = time.perf_counter()
        if server_round > 0:
            clock["rounds"].append(now - clock["last"])
        clock["last"] = now
        if server_round == w.rounds:
            clock["final"] = arrays
        return None

    server_app = ServerApp()

    @server_app.main()
    def server(grid: Grid, context: Context) -> None:
        while len(list(grid.get_node_ids())) < w.meta["num_clients"]:   # start-up, untimed
            time.sleep(0.1)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(w.init), num_rounds=w.rounds,
                       evaluate_fn=tick)

    cpus = 2 if known.actors == 1 else 1
    # Ray's workers inherit this environment: they import common.py (the workload cache)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    run_simulation(server_app=server_app, client_app=client_app,
                   num_supernodes=w.meta["num_clients"],
                   backend_config={"client_resources": {"num_cpus": cpus, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2}})
    model = w.build_model()
    model.load_state_dict(clock["final"].to_torch_state_dict())
    finish("flower", args, w, model, clock["rounds"], strategy.steps, actors=known.actors)


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    main()
