import json
import sys

import pytest

from conftest import ROOT, mpirun, needs_mpi


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("n", [2, 3])
def test_mpi_collectives_and_ledger(n):
    proc = mpirun(n, [sys.executable, str(ROOT / "tests/mpi_scripts/comm_check.py")], timeout=120)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["size"] == n
    assert report["failures"] == [[] for _ in range(n)]


def test_a_part_in_pieces_is_received_as_the_pieces_back_to_back():
    """alltoallv's part: one array, or a list of pieces (arrays, torch tensors, strided
    views, empty ones) that arrive as one array; a rank's own part too, in one process
    (the pieces under mpirun: tests/mpi_scripts/comm_check.py)."""
    import numpy as np
    import torch

    from fedmpi.comm import LocalComm
    from fedmpi.comm.base import joined, pieces

    grid = np.arange(12, dtype=np.float32).reshape(3, 4)
    part = [grid[:, 1], np.zeros(0, np.float32), torch.tensor([7.5, 8.5]), grid[2]]
    assert [p.tolist() for p in pieces(part)] == [[1, 5, 9], [], [7.5, 8.5], [8, 9, 10, 11]]
    assert len(pieces(grid[0])) == 1 and np.shares_memory(pieces(grid[0])[0], grid)
    (got,) = LocalComm().alltoallv([part])
    assert got.dtype == np.float32 and got.tolist() == [1, 5, 9, 7.5, 8.5, 8, 9, 10, 11]
    assert LocalComm().alltoallv([grid[1]])[0].tolist() == [4, 5, 6, 7]
    assert joined([]).tolist() == [] and joined(np.ones(2)).dtype == np.float64
