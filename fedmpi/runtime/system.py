"""Process-level settings every rank applies before it trains: threads, device, malloc."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import socket
from contextlib import contextmanager

import torch

from ..errors import UsageError
from ..results import schema

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def tune_malloc() -> bool:
    """Keep activation buffers in the heap instead of mmap/munmap on every step.

    With glibc's default dynamic thresholds each training step maps and unmaps its
    larger buffers until some large block happens to be freed: ~20% per step measured
    here (benchmarks/layout.py). Fixed thresholds remove that. No-op off glibc.
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
    node = os.environ.get("SLURM_NODEID", "0") or "0"
    counts = []
    for part in filter(None, spec.split(",")):
        count, _, repeat = part.partition("(x")
        repeat = repeat.removesuffix(")") if repeat else "1"
        if not (count.isdigit() and repeat.isdigit() and node.isdigit()):
            return 1   # not SLURM's format: assume this rank is alone on its node
        counts += [int(count)] * min(int(repeat), int(node) + 1)
    return counts[int(node)] if int(node) < len(counts) else 1


def choose_threads(requested: int, deterministic: bool, is_worker: bool, *,
                   local_workers: int) -> int:
    """Torch threads for this rank.

    Workers share the node's cores; the server (rank 0 of a multi-rank job) mostly
    waits and gets one. Deterministic runs use ``requested`` or 1 on every rank so that
    kernels reduce in the same order whatever the layout. ``local_workers``: the workers
    on this rank's node (`node_workers`), which the launcher's variables cannot say: they
    count the node's ranks, not whether the server is one of them.

    Otherwise never more than the process may use: its affinity mask (all of it when the
    launcher bound the rank to its own cores, else this worker's share of it), its share
    of the cgroup CPU quota (one quota covers every rank in the cgroup, and a rank over
    its share is throttled, not just slowed), and SLURM_CPUS_PER_TASK when set.
    """
    if requested:
        return requested
    if deterministic:
        return 1
    if not is_worker:
        return 1
    share = max(local_workers, 1)
    affinity = _usable_cores()
    limit = affinity if affinity < (os.cpu_count() or affinity) else affinity // share
    quota = cgroup_cpu_limit()
    if quota is not None:
        limit = min(limit, quota // share)
    if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():  # the allocation's own answer
        limit = min(limit, int(os.environ["SLURM_CPUS_PER_TASK"]))
    return max(limit, 1)


def _usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a cgroup or binding may allow
    fewer than the node has)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_MEMBERSHIP = "/proc/self/cgroup"


def cgroup_cpu_limit(root: str | None = None, membership: str | None = None) -> int | None:
    """CPUs the cgroup CPU quota allows this process, quota / period rounded up (at least
    1), the smallest over every level that sets one; None when no level does.

    Reads cgroup v2 ``cpu.max`` ("quota period" or "max period") and cgroup v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: no quota). A container sees its own
    cgroup at ``root``; a process on a host (a SLURM step, a systemd slice) sits further
    down, at the path ``membership`` names, and a quota on any ancestor binds as well.
    Both default to the module's CGROUP_ROOT and CGROUP_MEMBERSHIP.
    """
    root, membership = root or CGROUP_ROOT, membership or CGROUP_MEMBERSHIP
    v2, v1 = "/", "/"
    try:
        with open(membership) as lines:
            for line in lines:
                hierarchy, controllers, path = line.rstrip("\n").split(":", 2)
                if hierarchy == "0" and not controllers:
                    v2 = path
                elif "cpu" in controllers.split(","):
                    v1 = path
    except (OSError, ValueError):
        pass
    limits = []
    for base in (root, os.path.join(root, "unified")):
        for folder in _ancestors(base, v2):
            limits.append(_cpu_max(os.path.join(folder, "cpu.max")))
    for base in (os.path.join(root, "cpu"), os.path.join(root, "cpu,cpuacct"),
                 os.path.join(root, "cpuacct,cpu")):
        for folder in _ancestors(base, v1):
            limits.append(_cfs_quota(folder))
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


def _ancestors(base: str, path: str) -> list[str]:
    """``base``/``path`` and each of its parents up to ``base``, those that exist."""
    parts = [part for part in path.split("/") if part]
    folders = [os.path.join(base, *parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [folder for folder in folders if os.path.isdir(folder)]


def _cpu_max(path: str) -> int | None:
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else _cpus(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _cfs_quota(folder: str) -> int | None:
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota < 0 else _cpus(quota, period)
    except (OSError, ValueError):
        return None


def _cpus(quota: int, period: int) -> int | None:
    return max(-(-quota // period), 1) if period > 0 else None


def load_warning(threads: int, cores: int | None = None) -> str | None:
    """One line for stderr when the node is already busier than its cores at start-up
    (another job, a stale run): this run's threads then compete for them and it runs
    slower than its thread count suggests. None otherwise, or where the load average is
    unknown.

    The load average counts the whole node (a container sees its host's), so it is set
    against the node's cores (``os.cpu_count()``), not this process's share: a job bound
    to a few cores of a full node has those cores to itself.
    """
    cores = cores or os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    if load <= cores:
        return None
    return (f"fedmpi: warning: load average {load:.1f} on {socket.gethostname()} exceeds its "
            f"{cores} cores at start-up; other work competes with this run's {threads} torch "
            f"thread(s) per worker, so it may take several times longer than on an idle machine "
            f"(system.threads sets another number)")


def kernels(device: torch.device) -> str:
    """The kind of arithmetic this rank's training runs, which decides its last bits as
    much as the software does: the GPU's model, or the CPU's vector instruction set as
    torch dispatches on it and the CPU's model ("cpu AVX512 on AMD EPYC 9654";
    ``ATEN_CPU_CAPABILITY`` may lower the first). The instruction set alone does not
    decide the bits: MKL dispatches by vendor, and oneDNN by AMX and the cache sizes, so
    an AVX-512 Xeon and an AVX-512 EPYC end a run with other models."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"cpu {torch.backends.cpu.get_cpu_capability()} on {cpu_model()}"
    return device.type


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model as the OS names it (Linux: /proc/cpuinfo's first ``model name``,
    else platform.processor(), else the architecture)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def kernels_warning(ranks: list[dict]) -> str | None:
    """One line for stderr when a deterministic run's ranks of one device type run
    different kernels (a partition of two CPU models or GPU models): a client's bits
    then depend on where it trains, and the run is not bitwise that of another rank count.
    None otherwise (a CPU server beside GPU workers is the usual layout), and for ranks
    recorded without their kernels."""
    types: dict[str, set[str]] = {}
    for r in ranks:
        if "kernels" in r:
            types.setdefault(r["device"].split(":")[0], set()).add(r["kernels"])
    if all(len(seen) < 2 for seen in types.values()):
        return None
    kinds = schema.kernels_by_kind(ranks)
    shown = "; ".join(f"{kind}: {schema.ranks_text(at)}" for kind, at in kinds.items())
    return (f"fedmpi: warning: system.deterministic, but the ranks run different kernels "
            f"({shown}): a client's bits depend on where it trains, and this run is not "
            f"bitwise that of another rank count; run on one kind of node (sbatch "
            f"--constraint) for that")


def node_workers(comm) -> list[tuple[int, str]]:
    """(rank, visible GPUs) of the workers on this rank's node, in rank order: one
    collective over every rank. Taken from MPI's shared-memory split rather than launcher
    variables, so it is the same under mpirun, srun, MPICH's hydra or anything else, and
    the server is left out wherever it runs."""
    peers = comm.node_peers((comm.is_worker, visible_gpus()))
    return [(rank, seen) for rank, (worker, seen) in peers if worker]


def visible_gpus() -> str:
    """What this process is allowed to see: CUDA_VISIBLE_DEVICES as the launcher set it
    (per node: the same on every rank; per task: one GPU each), "all" when unset."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "all").strip()


def choose_device(requested: str, is_worker: bool, rank: int, peers=None,
                  share: bool = False) -> torch.device:
    """This rank's device. The server (rank 0 of a multi-rank job) always gets the CPU and
    never creates a CUDA context.

    ``auto`` and ``cuda`` mean this worker's own GPU when CUDA is present (``auto`` falls
    back to the CPU). ``peers`` lists (rank, visible GPUs) of the workers on this node
    (``Comm.node_peers``): workers that see the same GPUs (one CUDA_VISIBLE_DEVICES value)
    take them in rank order, k-th worker -> cuda:k, so the answer does not depend on which
    launcher variables exist; a worker that sees its own GPU (SLURM binding one per task)
    takes cuda:0. More workers than GPUs is an error unless ``share`` (system.gpu_share).
    """
    if not is_worker or requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if requested == "auto":
            return torch.device("cpu")
        raise UsageError(f"config field system.device: {requested!r}, but torch finds no CUDA "
                         f"device on {socket.gethostname()} (torch {torch.__version__}); use "
                         f"'auto' (GPU when present, else CPU) or 'cpu'")
    count = torch.cuda.device_count()
    visible = visible_gpus()
    group = sorted(r for r, seen in (peers or [(rank, visible)]) if seen == visible)
    where = (f"{len(group)} worker(s) on {socket.gethostname()} see {count} GPU(s) "
             f"(CUDA_VISIBLE_DEVICES={visible})")
    if requested.startswith("cuda:"):
        index = int(requested[5:])
        if index >= count:
            raise UsageError(f"config field system.device: {requested!r}, but {where}")
        if len(group) > 1 and not share:
            raise UsageError(f"config field system.device: {requested!r} puts all {where} on "
                             f"one GPU; use 'cuda' (one GPU per worker) or set "
                             f"system.gpu_share = true")
        return torch.device("cuda", index)
    if len(group) > count and not share:
        raise UsageError(f"config field system.device: {where}; start at most {count} workers "
                         f"per node, or set system.gpu_share = true to share them")
    return torch.device("cuda", group.index(rank) % count)


CUBLAS_WORKSPACE = ":4096:8"   # what cuBLAS needs for reproducible matmuls (CUDA >= 10.2)


@contextmanager
def numerics(device: torch.device, precision: str, deterministic: bool):
    """The kernel settings a run trains under, restored afterwards (a library user's own
    settings survive a run).

    On CUDA: TF32 for matmuls and cuDNN convolutions only with ``precision = "tf32"``
    (PyTorch's own default allows it for convolutions, which would make "fp32" not quite
    FP32); in deterministic mode ``torch.use_deterministic_algorithms(True)`` (index_add
    and embedding backward then take their deterministic paths, anything without one
    raises instead of varying), cuDNN deterministic without benchmarking, and cuBLAS's
    fixed workspace. Bitwise reproducibility then holds for the same GPU model and
    software, any number of ranks; CPU and GPU results differ. On the CPU, kernels are
    already deterministic at a fixed thread count, which deterministic mode fixes.
    """
    if device.type != "cuda":
        yield
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) = saved[:4]
        torch.use_deterministic_algorithms(saved[4], warn_only=saved[5])
        if saved[6] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[6]


def autocast_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """bfloat16 when training steps run under autocast (``precision = "bf16"``), else None.
    On a CPU without native bfloat16 (AVX512-BF16 or AMX) autocast would emulate it, many
    times slower than FP32: refused."""
    if precision != "bf16":
        return None
    if device.type == "cpu" and not _cpu_has_bf16():
        raise UsageError("config field system.precision: 'bf16' on a CPU without native "
                         "bfloat16 (AVX512-BF16 or AMX) would be emulated; use 'fp32'")
    return torch.bfloat16


def _cpu_has_bf16() -> bool:
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool((check and check()) or (amx and amx()))
