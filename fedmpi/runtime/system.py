"""Process-level settings every rank applies before it trains: threads, device, malloc."""

from __future__ import annotations

import ctypes
import os
import socket

import torch

from ..errors import UsageError

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def tune_malloc() -> bool:
    """Keep activation buffers in the heap instead of mmap/munmap on every step.

    With glibc's default dynamic thresholds each training step maps and unmaps its
    larger buffers until some large block happens to be freed: ~20% per step measured
    here (DESIGN.md section 11). Fixed thresholds remove that. No-op off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, 1024 * 1024 * 1024)
        return bool(ok)
    except (OSError, AttributeError):
        return False


def local_rank_info() -> tuple[int, int]:
    """(local rank, ranks on this node) from the launcher, (0, 1) when run directly."""
    for rank_var, size_var in (("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                               ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
                               ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")):
        if os.environ.get(rank_var, "").isdigit() and os.environ.get(size_var, "").isdigit():
            return int(os.environ[rank_var]), int(os.environ[size_var])
    if os.environ.get("SLURM_LOCALID", "").isdigit():  # srun without --ntasks-per-node
        return int(os.environ["SLURM_LOCALID"]), _slurm_tasks_on_node()
    return 0, 1


def _slurm_tasks_on_node() -> int:
    """This node's task count from SLURM_STEP_TASKS_PER_NODE, e.g. "3(x2),1" -> 3 on the
    first nodes; SLURM_NODEID says which entry is ours."""
    spec = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE", "")
    counts = []
    for part in filter(None, spec.split(",")):
        count, _, repeat = part.partition("(x")
        if not count.isdigit():
            return 1
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    node = int(os.environ.get("SLURM_NODEID", "0") or 0)
    return counts[node] if node < len(counts) else 1


def choose_threads(requested: int, deterministic: bool, is_worker: bool, world_size: int) -> int:
    """Torch threads for this rank.

    Workers share the node's cores; the server (rank 0 of a multi-rank job) mostly
    waits and gets one. Deterministic runs use ``requested`` or 1 on every rank so that
    kernels reduce in the same order whatever the layout.
    """
    if requested:
        return requested
    if deterministic:
        return 1
    if not is_worker:
        return 1
    if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():  # the allocation's own answer
        return max(int(os.environ["SLURM_CPUS_PER_TASK"]), 1)
    usable = _usable_cores()
    if usable < (os.cpu_count() or usable):
        return usable  # the launcher bound this rank to its own cores
    _, local_size = local_rank_info()
    local_workers = max(local_size - (1 if world_size > 1 else 0), 1)
    return max(usable // local_workers, 1)


def _usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a cgroup or binding may allow
    fewer than the node has)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_device(requested: str, is_worker: bool, rank: int) -> torch.device:
    """``auto``: the worker's GPU by local rank when CUDA is present, else the CPU.

    On the node that hosts the server (rank 0, block placement) workers are local ranks
    1..G, elsewhere 0..G-1; either way they map onto GPUs 0..G-1.
    """
    if not is_worker or requested == "cpu":
        return torch.device("cpu")
    if requested != "auto" and not torch.cuda.is_available():
        raise UsageError(f"config field system.device: {requested!r}, but torch finds no CUDA "
                         f"device on {socket.gethostname()} (torch {torch.__version__}); use "
                         f"'auto' (GPU when present, else CPU) or 'cpu'")
    if requested == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        local_rank, _ = local_rank_info()
        first_worker = 1 if rank == local_rank and rank > 0 else 0
        return torch.device("cuda", (local_rank - first_worker) % torch.cuda.device_count())
    return torch.device(requested)
