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
