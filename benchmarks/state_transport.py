"""Client states between the server's store and the workers: flat buffers against pickles.

A method with a model-sized state per client (SCAFFOLD's c_i, Ditto's and pFedMe's
personal models, APFL's v_i) sends each sampled client's state to its worker and back
every round. Under mpirun, this times one round of that traffic both ways: (a) as the
runtime moves it (fedmpi.runtime.phase: the store's arrays sent uncopied with
``alltoallv``, the new states ``gatherv``-ed as ids and one flat buffer), (b) as it was
moved before (``scatter_obj``/``gather_obj``: every state pickled, sent, unpickled).
Prints seconds per round (median of --repeat) and their ratio; with ``--way flat`` or
``--way pickle`` alone, each rank's peak resident memory (the pickles are copies):

    mpirun -n 3 python benchmarks/state_transport.py                 # d = 11.2M (ResNet-18), 10 clients
    mpirun -n 3 python benchmarks/state_transport.py --way pickle    # its peak memory alone

Both ways give the same bits (checked each round).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np

from fedmpi.comm.mpi import MPIComm
from fedmpi.runtime.state import ClientStateStore, pack, pieces, unpack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=11_200_000)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--way", choices=("both", "flat", "pickle"), default="both")
    args = parser.parse_args()
    comm = MPIComm()
    sizes = {"c": args.params}
    workers = comm.num_workers
    assignment = [np.arange(w, args.clients, workers) for w in range(workers)]
    store = ClientStateStore(sizes) if comm.is_server else None
    if store is not None:
        for c in range(args.clients):
            store.put(c, {"c": np.random.default_rng(c).standard_normal(args.params, np.float32)})
    mine = assignment[comm.worker_index].tolist() if comm.is_worker else []

    def flat_round():
        parts = [[] for _ in range(comm.size)]
        if comm.is_server:
            for w, a in enumerate(assignment):
                parts[w + 1] = pieces((store.get(c) for c in a.tolist()), sizes)
        got = comm.alltoallv(parts)[0]
        states = unpack(got, mine, sizes) if comm.is_worker else {}
        new = {c: {"c": s["c"] + 1} for c, s in states.items()}
        ids, flat = pack(new, sizes)
        clients, values = comm.gatherv(ids), comm.gatherv(flat)
        return {} if not comm.is_server else \
            {c: s for cs, v in zip(clients, values) for c, s in unpack(v, cs, sizes).items()}

    def pickle_round():
        parts = None
        if comm.is_server:
            parts = [{}] + [{c: store.get(c) for c in a.tolist()} for a in assignment]
        states = comm.scatter_obj(parts)
        new = {c: {"c": s["c"] + 1} for c, s in states.items()}
        parts = comm.gather_obj(new)
        return {} if not comm.is_server else {c: s for part in parts for c, s in part.items()}

    seconds = {}
    ways = {"flat": flat_round, "pickle": pickle_round}
    for name, step in ways.items():
        if args.way not in ("both", name):
            continue
        times = []
        for _ in range(args.repeat):
            comm.comm.Barrier()
            start = time.perf_counter()
            got = step()
            comm.comm.Barrier()
            times.append(time.perf_counter() - start)
        seconds[name] = float(np.median(times))
        if comm.is_server:   # both ways: every client's state + 1
            assert all(np.array_equal(got[c]["c"], store.get(c)["c"] + 1) for c in range(args.clients))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # MB
    everyone = comm.gather_obj(round(peak), count=False)
    if comm.is_server:
        out = {"params": args.params, "clients": args.clients, "ranks": comm.size,
               "state_mb": round(args.params * 4 / 2 ** 20, 1),
               **{f"seconds_{k}": round(v, 4) for k, v in seconds.items()}}
        if args.way == "both":
            out["pickle_over_flat"] = round(seconds["pickle"] / seconds["flat"], 2)
        else:
            out["peak_rss_mb_by_rank"] = everyone
        print(json.dumps(out))


if __name__ == "__main__":
    main()
