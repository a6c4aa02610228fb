import numpy as np
import torch

from fedmpi.comm import Ledger, LocalComm, launched_size


def test_local_comm_is_server_and_worker_and_moves_nothing():
    comm = LocalComm()
    assert comm.is_server and comm.is_worker and comm.num_workers == 1
    buf = torch.arange(4.0)
    comm.bcast(buf)
    out = torch.zeros(4)
    comm.reduce_sum(buf, out)
    assert torch.equal(out, buf)
    parts = comm.gatherv(np.arange(3.0))
    assert len(parts) == 1 and parts[0].tolist() == [0.0, 1.0, 2.0]
    assert comm.bcast_obj({"a": 1}) == {"a": 1}
    assert comm.scatter_obj([5]) == 5
    assert comm.ledger.take().sent == 0


def test_ledger_take_resets():
    ledger = Ledger(sent=10, received=4, calls=2, comm_seconds=0.5)
    snap = ledger.take()
    assert (snap.sent, snap.received, snap.calls) == (10, 4, 2)
    assert (ledger.sent, ledger.received, ledger.calls, ledger.comm_seconds) == (0, 0, 0, 0.0)


def test_launcher_detection(monkeypatch):
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "PMIX_RANK", "PMI_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert launched_size() is None
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert launched_size() == 4
