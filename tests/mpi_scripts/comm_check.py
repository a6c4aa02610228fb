"""Run under mpirun: every collective of MPIComm, values and ledger against closed form."""

import json
import sys

import numpy as np
import torch

from fedmpi.comm.mpi import MPIComm

comm = MPIComm()
r, n = comm.rank, comm.size
failures = []


def check(name, ok):
    if not ok:
        failures.append(name)


buf = torch.arange(1000, dtype=torch.float32) if r == 0 else torch.zeros(1000)
comm.bcast(buf)
check("bcast", torch.equal(buf, torch.arange(1000, dtype=torch.float32)))
led = comm.ledger.take()
check("bcast bytes", (led.sent, led.received) == ((4000 * (n - 1), 0) if r == 0 else (0, 4000)))

send = np.full(10, float(r), dtype=np.float64)
out = np.zeros(10) if r == 0 else None
comm.reduce_sum(send, out)
if r == 0:
    check("reduce", np.all(out == sum(range(n))))
led = comm.ledger.take()
check("reduce bytes", (led.sent, led.received) == ((0, 80 * (n - 1)) if r == 0 else (80, 0)))

parts = comm.gatherv(np.arange(r, dtype=np.float32))
if r == 0:
    check("gatherv", [p.tolist() for p in parts] == [list(range(k)) for k in range(n)])
led = comm.ledger.take()
expect = (0, 4 * sum(range(n))) if r == 0 else (4 * r, 0)
check("gatherv bytes", (led.sent, led.received) == expect)

# rank r sends r + 1 copies of 100 * r + dest to each dest (nothing to itself counts)
got = comm.alltoallv([np.full(r + 1, 100.0 * r + dest, dtype=np.float32) for dest in range(n)])
check("alltoallv", [g.tolist() for g in got] == [[100.0 * src + r] * (src + 1) for src in range(n)])
led = comm.ledger.take()
check("alltoallv bytes", (led.sent, led.received) ==
      (4 * (r + 1) * (n - 1), 4 * (sum(range(1, n + 1)) - (r + 1))))

# the same values in pieces, each sent where it is, received back to back: several
# pieces a part, empty ones among them, a strided view, a torch tensor, slices of one
# array out of order; the part for itself too, and nothing at all (an empty list)
grid = np.empty((n, 2 * (n + 1)), np.float32)
parts = [[] for _ in range(n)]
for dest in reversed(range(n)):
    if dest == (r + 1) % n and n > 2:
        continue                               # r sends r + 1 nothing: no pieces
    count = r + 1
    grid[dest] = 100.0 * r + dest
    parts[dest] = [grid[dest, ::2][:count // 2],   # strided
                   np.zeros(0, np.float32), torch.full((count - count // 2,), 100.0 * r + dest + 0.25)]
got = comm.alltoallv(parts)
sends_to_me = [0 if r == (src + 1) % n and n > 2 else src + 1 for src in range(n)]
check("alltoallv pieces", [g.tolist() for g in got] ==
      [[100.0 * src + r] * (c // 2) + [100.0 * src + r + 0.25] * (c - c // 2)
       for src, c in enumerate(sends_to_me)])
check("alltoallv pieces dtype", all(g.dtype == np.float32 for g in got))
led = comm.ledger.take()
sent_to = [0 if (dest == (r + 1) % n and n > 2) or dest == r else r + 1 for dest in range(n)]
check("alltoallv pieces bytes", (led.sent, led.received) ==
      (4 * sum(sent_to), 4 * (sum(sends_to_me) - sends_to_me[r])))
got = comm.alltoallv([[np.full(3, r + 0.5)] if dest == 0 and r > 0 else [] for dest in range(n)])
check("alltoallv float64 to a rank that sends nothing",
      (n == 1 or [g.dtype for g in got] == [np.float64] * n)   # n = 1: no piece anywhere
      and [g.tolist() for g in got] == ([[]] + [[src + 0.5] * 3 for src in range(1, n)]
                                        if r == 0 else [[]] * n))
comm.ledger.take()

# into buffers the caller keeps: views of the start of ``out``, values as without it,
# the rest of ``out`` untouched
kept = np.full(sum(range(1, n + 1)) + 2, -1.0, np.float32)
got = comm.alltoallv([np.full(r + 1, 100.0 * r + dest, dtype=np.float32) for dest in range(n)],
                     out=kept)
check("alltoallv out", [g.tolist() for g in got] == [[100.0 * src + r] * (src + 1) for src in range(n)]
      and all(np.shares_memory(g, kept) for g in got if g.size)
      and kept[:sum(range(1, n + 1))].tolist() == sum(([100.0 * src + r] * (src + 1)
                                                       for src in range(n)), [])
      and kept[-2:].tolist() == [-1.0, -1.0])
total = np.full(sum(range(n)), -1.0, np.float32) if r == 0 else None
parts = comm.gatherv(np.arange(r, dtype=np.float32), out=total)
if r == 0:
    check("gatherv out", [p.tolist() for p in parts] == [list(range(k)) for k in range(n)]
          and total.tolist() == sum((list(range(k)) for k in range(n)), []))
comm.ledger.take()

a = np.ones(5)
comm.allreduce_sum(a)
check("allreduce", np.all(a == n))
check("bcast_obj", comm.bcast_obj({"x": [1, 2]} if r == 0 else None) == {"x": [1, 2]})
check("scatter_obj", comm.scatter_obj(list(range(n)) if r == 0 else None) == r)
got = comm.gather_obj(r * 10)
if r == 0:
    check("gather_obj", got == [k * 10 for k in range(n)])
led = comm.ledger.take()
check("idle+comm seconds recorded", led.calls > 0 and led.idle_seconds >= 0 and led.comm_seconds >= 0)

result = comm.gather_obj(failures, count=False)
if r == 0:
    print(json.dumps({"size": n, "failures": result}))
sys.exit(0)
