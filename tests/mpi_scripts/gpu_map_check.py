"""Run under mpirun: which device each rank would take on a node with fake GPUs.

    python gpu_map_check.py CASES_JSON

CASES_JSON: a list of [GPUS, VISIBILITY, REQUESTED, SHARE] cases, all checked in this one
launch. VISIBILITY: "node" (every rank sees the same CUDA_VISIBLE_DEVICES, as SLURM's
per-node --gres sets it), "task" (rank r sees only GPU r-1, as --gpus-per-task=1 sets it)
or "unset". torch's CUDA queries are replaced by fakes (no GPU here); the launcher's
local-rank variables are removed, as under an unknown launcher, since the mapping must
not need them. Prints one JSON line per case and rank: case, rank, device or error.
"""

import json
import os
import sys

import torch

cases = json.loads(sys.argv[1])
for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_LOCALID",
             "MPI_LOCALRANKID"):
    os.environ.pop(name, None)

from fedmpi.comm.mpi import MPIComm  # noqa: E402
from fedmpi.errors import UsageError  # noqa: E402
from fedmpi.runtime.system import choose_device, node_workers  # noqa: E402

comm = MPIComm()
torch.cuda.is_available = lambda: True
for case, (gpus, visibility, requested, share) in enumerate(cases):
    if visibility == "node":
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in range(gpus))
    elif visibility == "task":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(max(comm.rank - 1, 0))
        gpus = 1
    else:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    torch.cuda.device_count = lambda gpus=gpus: gpus
    peers = node_workers(comm)
    try:
        result = {"device": str(choose_device(requested, comm.is_worker, comm.rank, peers,
                                              share == "1"))}
    except UsageError as exc:
        result = {"error": str(exc)}
    print(json.dumps({"case": case, "rank": comm.rank, **result}), flush=True)
