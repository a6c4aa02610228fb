"""What a rank works with: threads, device, data, partition and model, built the same
way by a run (every rank) and by ``fedmpi evaluate`` (one process)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..config import flatten
from ..data import load_dataset
from ..errors import UsageError
from ..flat import FlatModel
from ..models import build_model
from .clientdata import DeviceData
from .federation import federate
from .rng import key_seed
from .system import (autocast_dtype, choose_device, choose_threads, kernels, node_workers,
                     tune_malloc)


@dataclass
class World:
    threads: int
    device: torch.device
    autocast: object
    dataset: object
    flat: FlatModel
    data: DeviceData | None = None   # workers only
    split: object = None             # the client partition (runs only)

    @property
    def d(self) -> int:
        return self.flat.size


def build_world(config, comm, alg, *, run: bool = True) -> World:
    """Every rank, collectively. ``run``: a training run's world (partition, augmented
    data, the config's memory layout); otherwise a finished model's (standard layout,
    no augmentation: the file's order), as ``fedmpi evaluate`` wants."""
    s = config.system
    tune_malloc()
    peers = node_workers(comm)
    threads = choose_threads(s.threads, s.deterministic, comm.is_worker,
                             local_workers=len(peers))
    torch.set_num_threads(threads)

    def device_and_precision():
        device = choose_device(s.device, comm.is_worker, comm.rank, peers, s.gpu_share)
        return device, autocast_dtype(device, s.precision) if comm.is_worker else None

    device, autocast = agree(comm, device_and_precision)
    if device.type == "cuda":
        torch.cuda.set_device(device)   # before anything else touches CUDA
    dataset = comm.node_shared(lambda: load_dataset(  # once per node, see Comm.node_shared
        config.data.dataset, config.data.data_dir, seed=config.seed, **config.data.options))
    same_data(comm, config, dataset)
    # the partition: computed once on the server from the seed, broadcast (see `federate`)
    split = comm.bcast_obj(federate(config, dataset) if comm.is_server else None) if run else None
    channels_last = config.model.channels_last and run
    torch.manual_seed(key_seed(config.seed, "init"))
    module = alg.build_model(build_model, config.model.name, dataset.in_channels,
                             dataset.num_classes, dataset.image_size, config.model.options)
    flat = FlatModel(module, device, channels_last=channels_last)
    data = None
    if comm.is_worker:
        data = DeviceData(dataset, device, augment=config.data.augment and run,
                          crop_padding=config.data.crop_padding if run else 0,
                          flip=config.data.flip and run,
                          channels_last=channels_last and dataset.train_x.dim() == 4)
    return World(threads, device, autocast, dataset, flat, data, split)


def software() -> dict[str, str]:
    """What this rank runs: the versions that decide its bits, and a digest of fedmpi's
    own source files (one node's stale copy keeps the version number)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return {"fedmpi": __version__, "fedmpi's code": digest.hexdigest()[:16],
            "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def same_software(comm) -> None:
    """Raise UsageError on every rank unless every rank runs the server's software.

    Each node runs its own Python environment (a module loaded, a container, an install
    on local disk): another torch or a stale fedmpi on one node gives other bits than a
    run on one rank, or a protocol the others do not speak, silently."""
    if comm.size == 1:
        return
    mine = software()

    def differs(rank, theirs):
        host, theirs = theirs
        shown = "; ".join(f"{k} {theirs.get(k)} there, {v} on rank 0"
                          for k, v in mine.items() if theirs.get(k) != v)
        return (f"rank {rank} on {host} runs other software than rank 0 ({shown}); every "
                f"rank must run the same environment: is a node's install stale, or "
                f"another module loaded there? Nothing was run")

    _agree(comm, (socket.gethostname(), mine), differs, key=lambda value: value[1])


def same_config(comm, config) -> None:
    """Raise UsageError on every rank unless every rank resolved the server's config.

    Each rank reads the config file (or the results file it resumes) itself: one edited
    while a job starts, or a stale copy on one node, would have that rank train another
    model or learning rate, its buffers of another length, silently."""
    mine = json.dumps(config.to_dict(), sort_keys=True, default=str)

    def differs(rank, theirs):
        here, there = flatten(json.loads(mine)), flatten(json.loads(theirs))
        keys = sorted(k for k in here.keys() | there.keys() if here.get(k) != there.get(k))
        shown = "; ".join(f"{k} = {there.get(k)!r} there, {here.get(k)!r} on rank 0" for k in keys[:3])
        more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
        return (f"rank {rank} resolved another config than rank 0 ({shown}{more}); every "
                f"rank must read the same one: was the config file edited while the "
                f"job started? Nothing was run")

    _agree(comm, mine, differs)


def _agree(comm, mine, differs, key=lambda value: value) -> None:
    """Every rank's ``mine`` goes to the server, which compares each ``key`` with its own;
    for the first rank whose differs, ``differs(rank, theirs)`` is the message of the
    UsageError that every rank then raises."""
    values = comm.gather_obj(mine, count=False)
    problem = None
    if comm.is_server:
        rank = next((r for r, value in enumerate(values) if key(value) != key(mine)), None)
        if rank is not None:
            problem = differs(rank, values[rank])
    problem = comm.bcast_obj(problem)
    if problem:
        raise UsageError(problem)


def same_data(comm, config, dataset) -> None:
    """Raise UsageError on every rank unless every host loaded the server's data.

    Each node reads the files itself (``data.data_dir`` on node-local scratch, staged by
    a job's prologue): a stale or other copy on one node would train its clients on
    other data, silently. The lowest rank of each host other than the server's hashes
    what it loaded (``Dataset.sha256``, as the results file records it) and the server
    compares; a run on one host hashes nothing here."""
    hosts = comm.hostnames()
    me = hosts[comm.rank]
    first = hosts.index(me) == comm.rank and me != hosts[0]
    digests = comm.gather_obj(dataset.sha256() if first else None, count=False)
    problem = None
    if comm.is_server and any(digests):
        mine = dataset.sha256()
        rank = next((r for r, digest in enumerate(digests) if digest not in (None, mine)), None)
        if rank is not None:
            data = config.data
            where = (f"data.path = {data.options['path']}" if "path" in data.options else
                     f"data.data_dir = {data.data_dir}" if data.data_dir else
                     f"data.dataset = {data.dataset}")
            problem = (f"rank {rank} on {hosts[rank]} loaded other data than rank 0 on {hosts[0]} "
                       f"({where}; SHA-256 {digests[rank][:12]}... there, {mine[:12]}... on rank 0); "
                       f"every node must read the same files: is a node's copy stale or "
                       f"incomplete? Nothing was run")
    problem = comm.bcast_obj(problem)
    if problem:
        raise UsageError(problem)


def agree(comm, step):
    """``step()`` on every rank; if it raises UsageError on any, every rank raises the
    first one, so the server reports it once (a GPU missing on some worker's node)."""
    try:
        result, problem = step(), None
    except UsageError as exc:
        result, problem = None, str(exc)
    problems = comm.gather_obj(problem, count=False)
    first = comm.bcast_obj(next((p for p in problems if p), None) if comm.is_server else None)
    if first:
        raise UsageError(first)
    return result


def rank_info(comm, world: World) -> dict:
    return {"rank": comm.rank, "host": socket.gethostname(), "pid": os.getpid(),
            "device": str(world.device), "threads": world.threads,
            "kernels": kernels(world.device)}


EVAL_BATCH_CPU, EVAL_BATCH_GPU = 250, 1000


def eval_batch_size(configured: int, devices: list[str]) -> int:
    """eval.batch_size, or when it is 0 (auto) the size for the workers' devices: 250 test
    samples keep a CPU's activations in cache, a GPU wants larger batches. The same on
    every rank (it is also the chunk each worker scores), so the server decides."""
    if configured:
        return configured
    return EVAL_BATCH_GPU if any(d.startswith("cuda") for d in devices) else EVAL_BATCH_CPU


def rank_table(ranks: list[dict]) -> str:
    """Which rank runs where, on which device: printed at start (also in the file's
    ``ranks`` attribute)."""
    lines = [f"{'rank':>4}  {'role':<6}  {'host':<20}  {'device':<8}  threads  kernels"]
    for r in ranks:
        role = "server" if r["rank"] == 0 and len(ranks) > 1 else ("both" if len(ranks) == 1 else "worker")
        lines.append(f"{r['rank']:>4}  {role:<6}  {r['host'][:20]:<20}  {r['device']:<8}  "
                     f"{r['threads']:<7}  {r['kernels']}")
    return "\n".join(lines)
