import numpy as np
import pytest
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


def test_local_comm_receives_into_a_kept_buffer_and_refuses_one_that_does_not_fit():
    comm = LocalComm()
    kept = np.full(5, -1.0, np.float32)
    (got,) = comm.alltoallv([[np.arange(2, dtype=np.float32), np.ones(1, np.float32)]], out=kept)
    assert np.shares_memory(got, kept) and kept.tolist() == [0.0, 1.0, 1.0, -1.0, -1.0]
    (got,) = comm.gatherv(np.arange(3, dtype=np.float32), out=kept)
    assert np.shares_memory(got, kept) and got.tolist() == [0.0, 1.0, 2.0]
    for bad in (np.zeros(2, np.float32), np.zeros(5), np.zeros((5, 1), np.float32),
                np.zeros(10, np.float32)[::2]):
        with pytest.raises(ValueError, match=r"^gatherv: out must be a contiguous 1-D float32 "
                                             r"array of at least 3 values, got"):
            comm.gatherv(np.arange(3, dtype=np.float32), out=bad)


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


def test_objects_between_ranks_must_be_host_data():
    """MPIComm pickles objects with a pickler that refuses torch tensors anywhere inside
    (a CUDA tensor would be unpickled onto a GPU the receiver may not have; CPU tensors are
    refused too, so that CPU tests under mpirun catch such code). Types that cross ranks
    define a host form: the kNN partials and covariance sums arrive as CPU tensors."""
    import pickle

    import pytest
    import torch

    from fedmpi.comm.mpi import host_pickle
    from fedmpi.evaluation.spectrum import CovarianceSums
    from fedmpi.evaluation.ssl import KnnPartial

    with pytest.raises(TypeError, match=r"comm.gather_obj: got a torch tensor \(device cpu, "
                                        r"shape \(2,\)\).*send tensor.detach\(\).cpu\(\).numpy\(\)"):
        host_pickle({"bank": [1, (torch.zeros(2),)]}, "gather_obj")
    partial = KnnPartial(torch.rand(3, 2), torch.arange(6).view(3, 2), torch.ones(3, 2, dtype=torch.int64))
    sums = CovarianceSums(4, torch.rand(3, dtype=torch.float64), torch.rand(3, 3, dtype=torch.float64))
    back_partial, back_sums = pickle.loads(host_pickle((partial, sums), "gather_obj"))
    for a, b in ((partial.sims, back_partial.sims), (partial.index, back_partial.index),
                 (partial.labels, back_partial.labels), (sums.mean, back_sums.mean),
                 (sums.scatter, back_sums.scatter)):
        assert b.device.type == "cpu" and torch.equal(a, b)
    assert back_sums.n == 4
