"""The dataset held once per node (``Comm.node_shared``), under a real mpirun at 3 ranks:
one rank loads, every rank reads the same bytes, the results do not change, and where
MPI cannot share memory every rank loads its own copy without an error."""

import json
import sys

import pytest

from fedmpi.comm import LocalComm
from fedmpi.data import load_dataset

from conftest import mpirun, needs_mpi

SIZES = {"num_train": 300, "num_test": 100, "size": 8}

# Run under mpirun: node_shared in each way it can go, one JSON line from rank 0.
SCRIPT = r'''
import json, os, sys
import numpy as np
import torch
from fedmpi.comm.mpi import MPIComm
from fedmpi.data import load_dataset

SIZES = json.loads(sys.argv[1])


class NoWindow(MPIComm):
    """MPI without shared memory to give: the allocation fails on every rank."""
    def _allocate_shared(self, nbytes, node):
        return None


def attempt(comm, fail_on_leader=False):
    """What node_shared gave this rank: who loaded, a digest of the data, whether a
    value the leader writes afterwards shows up here (same bytes) and tensor facts."""
    loaded = []
    def load():
        loaded.append(comm.rank)
        if fail_on_leader and comm.rank == 0:
            raise ValueError("leader cannot read")
        return load_dataset("synthetic", seed=5, **SIZES)
    try:
        ds = comm.node_shared(load)
    except ValueError as exc:
        comm.gather_obj(None, count=False)   # match the others' collectives
        comm.bcast_obj(None)
        return {"loaded": bool(loaded), "error": str(exc)}
    digest = [float(t.double().sum()) for t in (ds.train_x, ds.train_y, ds.test_x, ds.test_y)]
    before = int(ds.train_x.view(-1)[7])
    comm.gather_obj(None, count=False)   # every rank has read before the leader writes
    if comm.rank == 0:
        ds.train_x.view(-1)[7] = (before + 1) % 256   # only to detect sharing: never in fedmpi
    comm.bcast_obj(None)
    seen = int(ds.train_x.view(-1)[7]) == (before + 1) % 256
    return {"loaded": bool(loaded), "digest": digest, "seen": seen, "name": ds.name,
            "classes": ds.num_classes, "contiguous": ds.train_x.is_contiguous(),
            "dtype": str(ds.train_x.dtype), "shape": list(ds.train_x.shape)}


comm = MPIComm()
report = {"shared": attempt(comm)}
report["no_window"] = attempt(NoWindow())
report["leader_fails"] = attempt(comm, fail_on_leader=True)
os.environ["FEDMPI_NODE_SHARED"] = "0"
report["switched_off"] = attempt(comm)
del os.environ["FEDMPI_NODE_SHARED"]

# a worker's DeviceData on the CPU reads the window itself: no copy per rank
from fedmpi import algorithms
from fedmpi.config import from_dict
from fedmpi.runtime.world import build_world
config = from_dict(json.loads(sys.argv[2]))
world = build_world(config, comm, algorithms.build(config.algorithm.name, config.algorithm.params))
windows = [window.Shared_query(0)[0] for _, window in comm.node_windows]
spans = [(np.frombuffer(b, dtype=np.uint8).ctypes.data, len(b)) for b in windows]
inside = lambda t: any(start <= t.data_ptr() < start + n for start, n in spans)
report["world"] = {"dataset": inside(world.dataset.train_x),
                   "data": None if world.data is None else inside(world.data.train_x)}
everyone = comm.gather_obj(report, count=False)
if comm.rank == 0:
    print(json.dumps(everyone))
'''


def launch(tmp_path, env=None):
    script = tmp_path / "node_shared_check.py"
    script.write_text(SCRIPT)
    config = {"name": "ns", "seed": 3, "rounds": 1, "data": {"dataset": "synthetic", **SIZES},
              "clients": {"num": 4, "per_round": 2}, "model": {"name": "2nn"},
              "algorithm": {"name": "fedavg"}, "system": {"device": "cpu"}}
    proc = mpirun(3, [sys.executable, str(script), json.dumps(SIZES), json.dumps(config)],
                  timeout=120, env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def expected_digest():
    ds = load_dataset("synthetic", seed=5, **SIZES)
    return [float(t.double().sum()) for t in (ds.train_x, ds.train_y, ds.test_x, ds.test_y)]


def test_local_comm_just_loads():
    calls = []
    ds = LocalComm().node_shared(lambda: calls.append(1) or load_dataset("synthetic", seed=5, **SIZES))
    assert calls == [1] and ds.train_x.shape[0] == SIZES["num_train"]


@pytest.mark.slow
@needs_mpi
def test_one_rank_per_node_loads_and_all_read_the_same_bytes(tmp_path):
    ranks = launch(tmp_path)
    digest = expected_digest()
    shared = [r["shared"] for r in ranks]
    assert [s["loaded"] for s in shared] == [True, False, False]   # only the node's leader
    assert all(s["digest"] == digest for s in shared)
    assert all(s["seen"] for s in shared)                           # one buffer on the node
    assert all(s["name"] == "synthetic" and s["classes"] == shared[0]["classes"] for s in shared)
    assert all(s["contiguous"] and s["dtype"] == "torch.uint8" for s in shared)
    # the runtime's own path: dataset and a worker's CPU tensors lie in the window
    assert [r["world"] for r in ranks] == [{"dataset": True, "data": None}] + \
        [{"dataset": True, "data": True}] * 2
    # no window to be had, or switched off: every rank loads its own copy, no error
    for way in ("no_window", "switched_off"):
        got = [r[way] for r in ranks]
        assert all(g["loaded"] and g["digest"] == digest for g in got), way
        assert [g["seen"] for g in got] == [True, False, False], way   # private copies
    # the leader's loader fails: it raises, the others are not left waiting (they load)
    failed = [r["leader_fails"] for r in ranks]
    assert failed[0] == {"loaded": True, "error": "leader cannot read"}
    assert all(f["loaded"] and f["digest"] == digest for f in failed[1:])


@pytest.mark.slow
@needs_mpi
def test_mpi_without_shared_memory_falls_back_without_error(tmp_path):
    """Open MPI with its shared-memory window component excluded: Allocate_shared raises
    MPI_ERR_INTERN on every rank, and every rank loads as before."""
    ranks = launch(tmp_path, env={"OMPI_MCA_osc": "^sm,ucx"})
    digest = expected_digest()
    got = [r["shared"] for r in ranks]
    assert all(g["loaded"] and g["digest"] == digest for g in got)
    assert [g["seen"] for g in got] == [True, False, False]
    assert [r["world"] for r in ranks] == [{"dataset": False, "data": None}] + \
        [{"dataset": False, "data": False}] * 2


# A whole run under mpirun reads the shared window by default: tests/test_mpi_runtime.py's
# deterministic runs at 2, 3 and 4 ranks (with augmentation) equal the single-process run
# bit for bit.
