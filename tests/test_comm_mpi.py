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


def test_parts_of_one_buffer_are_sent_from_it_and_others_are_packed():
    """The Alltoallv's send buffer: parts that are slices of one contiguous array (as
    fedmpi.runtime.gram packs its transpose) are sent from that array, at their offsets,
    with no copy; anything else (separate arrays, a strided or 2-D owner, another dtype)
    is concatenated as before."""
    import numpy as np

    from fedmpi.comm.mpi import send_buffer

    owner = np.arange(20, dtype=np.float32)
    parts = [owner[12:15], owner[0:0], owner[3:7], owner[15:15]]
    buffer, offsets = send_buffer(parts, np.float32)
    assert buffer is owner and offsets.tolist() == [12, 0, 3, 0]
    wide = owner.astype(np.float64)
    for others in ([np.ones(2, np.float32), owner[:3]],                    # two owners
                   [owner[::2][:3], owner[10:12]],                          # a strided copy
                   [wide[:2], wide[4:6]]):                                  # another dtype
        got, offsets = send_buffer([np.ascontiguousarray(p) for p in others], np.float32)
        assert got is not owner and got.dtype == np.float32
        assert got.tolist() == np.concatenate(others).astype(np.float32).tolist()
        assert offsets.tolist() == [0, len(others[0])]
    grid = np.zeros((2, 4), np.float32)
    assert send_buffer([grid.reshape(-1)[:2], grid.reshape(-1)[4:]], np.float32)[0] is not grid
