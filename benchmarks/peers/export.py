"""Write one workload (W1 or W2) as a neutral file every simulator's runner reads.

The file (numpy ``.npz``) holds exactly the work fedmpi does, so that each peer can be
made to do the same SGD steps: the normalised Fashion-MNIST arrays, the initial
parameters (fedmpi's keyed initialisation), every round's learning rate and sampled
clients (fedmpi's keyed sampler), and every (round, client)'s samples in fedmpi's batch
order (one local epoch: each client's slice is cut into batches of ``batch_size`` in
order, the last one shorter). The model is fedmpi's (``fedmpi.models.build_model`` with
the stored name and options), which needs only torch.

    python benchmarks/peers/export.py w2 --rounds 20 -o /tmp/w2.npz

Runs in fedmpi's environment; the peers' runners (``run_*.py``) read the file in theirs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from cross_device import workload as w2_workload  # noqa: E402
from overhead import WORKLOAD as W1, batches, setup  # noqa: E402

from fedmpi.algorithms.schedule import round_lr  # noqa: E402
from fedmpi.data import to_float  # noqa: E402
from fedmpi.runtime.plan import sample_clients  # noqa: E402


def config_values(name: str, rounds: int, model: str) -> dict:
    """fedmpi's config of W1 or W2 (one local epoch: the peers' epochs must cut the same
    batches, which a fresh permutation per epoch would not let them)."""
    if name == "w1":
        values = json.loads(json.dumps(W1))
        values["rounds"] = rounds
        values["eval"] = {"every": 100000, "at_start": False}
    else:
        values = w2_workload(model or "2nn", 1, rounds)
    values["system"] = {"device": "cpu"}
    return values


def export(values: dict, out: Path) -> dict:
    c, data, part, model = setup(values)
    if c.train.local_epochs != 1:
        raise ValueError(f"train.local_epochs must be 1 for the peers (a framework iterating "
                         f"one ordered dataset cannot cut a fresh permutation per epoch), "
                         f"got {c.train.local_epochs}")
    rounds, per_round = c.rounds, c.clients.per_round
    clients = np.stack([sample_clients(c.seed, t, c.clients.num, per_round) for t in range(rounds)])
    orders, offsets = [], [0]
    for t in range(rounds):
        for client in clients[t].tolist():
            order = torch.cat(list(batches(c, part, t, client, 1))).numpy()
            orders.append(order)
            offsets.append(offsets[-1] + len(order))
    state = model.state_dict()
    meta = {"model": c.model.name, "model_options": dict(c.model.options),
            "in_channels": data.in_channels, "num_classes": data.num_classes,
            "image_size": data.image_size, "batch_size": c.train.batch_size,
            "grad_clip": float(c.train.grad_clip), "rounds": rounds, "per_round": per_round,
            "num_clients": c.clients.num, "params": list(state),
            "steps": int(sum(-(-len(o) // c.train.batch_size) for o in orders)),
            "config": values}
    np.savez(out, meta=np.array(json.dumps(meta)),
             train_x=to_float(data.train_x, data.mean, data.std).numpy(),
             train_y=data.train_y.numpy(),
             test_x=to_float(data.test_x, data.mean, data.std).numpy(),
             test_y=data.test_y.numpy(),
             lr=np.array([round_lr(c.train, t, rounds) for t in range(rounds)]),
             clients=clients, sizes=part.sizes, order=np.concatenate(orders),
             offsets=np.array(offsets),
             **{f"param:{k}": v.numpy() for k, v in state.items()})
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=["w1", "w2"])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--model", choices=["2nn", "cnn"], default="2nn",
                    help="W2's model (W1 is always its 820-wide CNN)")
    ap.add_argument("-o", "--out", type=Path, required=True)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    try:
        meta = export(config_values(args.workload, args.rounds, args.model), args.out)
    except ValueError as e:
        ap.error(str(e))
    print(json.dumps({"steps": meta["steps"], "out": str(args.out)}))


if __name__ == "__main__":
    main()
