"""fedmpi.runtime.gram bitwise against a straightforward single-process computation: the K
vectors stacked, each block converted to float64 on its own and multiplied by torch (the
kernel that defines the bits), Grams added in block order, each block's weighted sum in
float64. Ranks are simulated by threads (1 to 4 workers and a server), so no mpirun."""

import threading

import numpy as np
import pytest
import torch

from fedmpi.comm import LocalComm
from fedmpi.comm.base import Comm, as_array, joined
from fedmpi.runtime.gram import BLOCK, Workspace, block_ranges, weighted_sum


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()   # as in deterministic runs: one thread per rank
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class ThreadComm(Comm):
    """One rank of a world whose ranks are threads: the collectives weighted_sum uses."""

    def __init__(self, rank: int, world: dict):
        self.rank, self.size, self.world = rank, world["size"], world

    def _exchange(self, value) -> list:
        self.world["slots"][self.rank] = value
        self.world["barrier"].wait()
        got = list(self.world["slots"])
        self.world["barrier"].wait()
        return got

    def alltoallv(self, parts, out=None):
        got = self._exchange([joined(p) for p in parts])
        return into([got[r][self.rank] for r in range(self.size)], out, "alltoallv")

    def gatherv(self, sendbuf, root=0, out=None):
        got = self._exchange(np.array(as_array(sendbuf), copy=True))
        return into(got, out, "gatherv") if self.rank == root else None

    def bcast(self, buf, root=0):
        got = self._exchange(np.array(as_array(buf), copy=True))
        np.copyto(as_array(buf), got[root])


def into(arrays: list, out, what: str) -> list:
    """``arrays`` as views of one array, as the comms return them (``out`` or a new one)."""
    return np.split(joined(arrays, out, what), np.cumsum([a.size for a in arrays])[:-1])


def distributed(vectors: dict, d: int, block: int, coefficients, workers: int,
                spaces: dict | None = None):
    """weighted_sum over 1 + workers thread ranks, clients dealt round-robin (uneven);
    ``spaces``: each rank's Workspace, kept by the caller (None: new ones)."""
    ids = list(vectors)
    assignment = [np.array(ids[w::workers], dtype=np.int64) for w in range(workers)]
    world = {"size": workers + 1, "slots": [None] * (workers + 1),
             "barrier": threading.Barrier(workers + 1, timeout=60)}
    results, errors = {}, []

    def rank(r):
        try:
            mine = [vectors[c] for c in assignment[r - 1]] if r else []
            results[r] = weighted_sum(ThreadComm(r, world), mine, assignment, d, coefficients,
                                      block=block, workspace=(spaces or {}).get(r))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)
            world["barrier"].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(workers + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert all(results[r] == (None, None) for r in range(1, workers + 1))
    return results[0]


def reference(vectors: dict, d: int, block: int, coefficients):
    stacked = torch.stack([vectors[c].reshape(-1).float() for c in sorted(vectors)])
    chunks = [stacked[:, s:e].contiguous().double() for s, e in block_ranges(d, block)]
    gram = np.zeros((len(vectors), len(vectors)))
    for a in chunks:
        gram += (a @ a.T).numpy()
    coef = np.asarray(coefficients(gram), dtype=np.float64)
    weights = torch.from_numpy(coef)
    return torch.cat([(weights @ a).float() for a in chunks]), coef


CASES = [  # d, client ids (training order), block, dtype
    (53, [4, 0, 9, 2, 7], 7, torch.float32),
    (20_000, [3, 1, 2, 0, 5], 4096, torch.float32),      # last block partial
    (16_384, [6], 4096, torch.float32),                  # K = 1: workers without clients
    (9_000, [2, 8, 5], 4096, torch.float64),             # inputs rounded to float32 first
    (70_000, [1, 0], BLOCK, torch.float32),              # the default block, d < 2 blocks
]


@pytest.mark.parametrize("d, clients, block, dtype", CASES)
def test_gram_and_sum_are_the_reference_bits_for_any_number_of_workers(d, clients, block, dtype):
    g = torch.Generator().manual_seed(d)
    vectors = {c: (torch.randn(d, generator=g, dtype=torch.float64) * (1 + c)).to(dtype)
               for c in clients}

    def coefficients(gram, seen):
        seen.append(gram.copy())
        return np.arange(1, len(gram) + 1) / np.sqrt(np.diag(gram)) - 0.25

    expect_seen = []
    expect, expect_coef = reference(vectors, d, block, lambda gram: coefficients(gram, expect_seen))
    seen = []
    got = [weighted_sum(LocalComm(), list(vectors.values()), [np.array(clients)], d,
                        lambda gram: coefficients(gram, seen), block=block)]
    got += [distributed(vectors, d, block, lambda gram: coefficients(gram, seen), workers)
            for workers in (1, 2, 3, 4)]
    assert len(seen) == len(got)
    for (total, coef), gram in zip(got, seen):
        assert gram.tobytes() == expect_seen[0].tobytes()
        assert coef.tobytes() == expect_coef.tobytes()
        assert total.dtype == torch.float32 and total.shape == (d,)
        assert total.numpy().tobytes() == expect.numpy().tobytes()


def test_buffers_kept_across_calls_leave_the_bits_alone():
    """Each rank's Workspace carried through calls of every shape in turn, its buffers
    holding the last call's values (bigger and smaller d and K, more and fewer clients a
    worker): the same bits as the reference every time."""
    for workers in (1, 3):
        spaces = {r: Workspace() for r in range(workers + 1)}
        for d, clients, block, dtype in CASES + CASES[::-1]:
            g = torch.Generator().manual_seed(d + 1)
            vectors = {c: torch.randn(d, generator=g).to(dtype) for c in clients}

            def coefficients(gram):
                return np.arange(1, len(gram) + 1) / np.sqrt(np.diag(gram))

            expect, expect_coef = reference(vectors, d, block, coefficients)
            total, coef = distributed(vectors, d, block, coefficients, workers, spaces)
            assert coef.tobytes() == expect_coef.tobytes()
            assert total.numpy().tobytes() == expect.numpy().tobytes()
        # the buffers were kept and reused (one worker receives nothing from others)
        assert spaces[1].kept["block"].numel() > 0
        assert (spaces[1].kept["received"].size > 0) == (workers > 1)
