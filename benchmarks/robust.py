"""Robust aggregation where the updates are (fedmpi.runtime.gram, .robust) against
gathering every update on rank 0, and against FedAvg's plain Reduce.

Under mpirun, K client updates of d values spread over the workers, as the runtime holds
them. One process run measures one mode, so that each rank's peak resident memory
(``ru_maxrss``) is that mode's alone:

- ``reduce``: each worker sums its clients, one Reduce to the server (FedAvg);
- ``sharded``: the rule as a run computes it: the transpose, per-block Gram partials or
  coordinate rules, the d result values gathered to the server;
- ``gather``: every update gathered to rank 0 (K d float32 there), then the same rule on
  rank 0 block by block (the reference mode the other simulators use).

Prints, as JSON: seconds a round (median of --repeat), the peak memory of rank 0 and the
largest of the workers' (MB), and what rank 0 received. For example:

    mpirun -n 3 python benchmarks/robust.py --mode sharded --rule median
    mpirun -n 5 --oversubscribe python benchmarks/robust.py --mode gather --rule krum --clients 100

(d = 11.2M, ResNet-18's size, by default; --params and --clients to scale; --device cuda
sorts and multiplies each block on the worker's GPU, as a robust run on GPUs does, the
updates on the host as a run keeps them.)
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np
import torch

from fedmpi import config as cfg
from fedmpi.comm.mpi import MPIComm
from fedmpi.flat import host_vector
from fedmpi.runtime import robust
from fedmpi.runtime.gram import BLOCK, Workspace, block_ranges, weighted_sum


def _rule(name: str, f: int):
    config = cfg.from_dict({"clients": {"num": 1000, "per_round": 100},
                            "robust": {"aggregator": name, "f": f}})
    coefficients = None if name in robust.COORDINATE else robust.coefficients(name, config)
    per_block = robust.coordinate_rule(name, f) \
        if name in robust.COORDINATE or name == "bulyan" else None
    return coefficients, per_block


def _gathered(comm, mine, assignment, d: int, coefficients, per_block, device=None):
    """Every update on rank 0, then the rule block by block there, the rows in ascending
    client id as the sharded path orders them."""
    k = sum(len(a) for a in assignment)
    local = np.stack([v.numpy() for v in mine]) if mine else np.zeros((0, d), np.float32)
    everything = np.empty(k * d, np.float32) if comm.is_server else None
    comm.gatherv(local.reshape(-1), out=everything)
    if not comm.is_server:
        return None
    a = everything.reshape(k, d)
    order = np.argsort(np.concatenate(assignment), kind="stable")   # rows by client id

    def block(s, e):   # one block of the K updates in client order (a copy of it alone)
        rows = torch.from_numpy(a[order, s:e]).double()
        return rows if device is None else rows.to(device)
    coef = None
    if coefficients is not None:
        gram = np.zeros((k, k))
        for s, e in block_ranges(d):
            rows = block(s, e)
            gram += (rows @ rows.T).cpu().numpy()
        coef = coefficients(gram)
    out = np.empty(d, np.float32)
    for s, e in block_ranges(d):
        rows = block(s, e)
        out[s:e] = (per_block(rows, coef)[0] if per_block is not None
                    else torch.from_numpy(coef).to(rows.device) @ rows).float().cpu().numpy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=11_200_000)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rule", default="median", choices=[r for r in robust.RULES if r not in
                                                             ("none", "centered_clip", "fltrust")])
    parser.add_argument("--f", type=int, default=2)
    parser.add_argument("--mode", default="sharded", choices=("reduce", "sharded", "gather"))
    parser.add_argument("--check", action="store_true",
                        help="after the timing, compare the sharded result with the gathered "
                             "one (bit for bit) and exit 1 if they differ")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cpu",
                        help="where the blocks are sorted and multiplied (cpu, cuda, cuda:1)")
    args = parser.parse_args()
    try:
        where = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r}: give cpu, cuda or cuda:N")
    if where.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch finds no CUDA device here")
    torch.set_num_threads(1)
    comm = MPIComm()
    d, k, workers = args.params, args.clients, comm.num_workers
    assignment = [np.arange(w, k, workers) for w in range(workers)]
    mine = [torch.randn(d, generator=torch.Generator().manual_seed(int(c)))
            for c in assignment[comm.worker_index]] if comm.is_worker else []
    coefficients, per_block = _rule(args.rule, args.f)
    # the workers' blocks on the device; gathering, rank 0's (the same kernels: --check)
    server_device = None if where.type == "cpu" else where
    device = server_device if comm.is_worker else None
    space, seconds = Workspace(), []
    for _ in range(args.repeat):
        comm.gather_obj(None, count=False)   # every rank starts together
        comm.ledger.take()
        start = time.perf_counter()
        if args.mode == "reduce":
            total = host_vector(d)
            for v in mine:
                total += v
            comm.reduce_sum(total, host_vector(d) if comm.is_server else None)
        elif args.mode == "sharded":
            weighted_sum(comm, mine, assignment, d, coefficients, workspace=space,
                         per_block=per_block, device=device)
        else:
            _gathered(comm, mine, assignment, d, coefficients, per_block, server_device)
        seconds.append(time.perf_counter() - start)
    same = None
    if args.check:
        sharded, _ = weighted_sum(comm, mine, assignment, d, coefficients, per_block=per_block,
                                  device=device)
        gathered = _gathered(comm, mine, assignment, d, coefficients, per_block, server_device)
        same = bool(np.array_equal(sharded.numpy(), gathered)) if comm.is_server else None
    ledgers = comm.gather_obj(comm.ledger.take(), count=False)
    peak = comm.gather_obj(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                           count=False)
    if comm.is_server:
        print(json.dumps({
            "ranks": comm.size, "d": d, "clients": k, "rule": args.rule, "mode": args.mode,
            "seconds": float(np.median(seconds)),
            "peak_mb_rank0": peak[0], "peak_mb_worker_max": max(peak[1:]) if len(peak) > 1
            else peak[0],
            "mb_received_by_rank0": ledgers[0].received / 1e6,
            "mb_of_the_updates": k * d * 4 / 1e6, "block": BLOCK,
            **({"sharded_equals_gathered": same} if args.check else {})}, indent=1))
        if same is False:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
