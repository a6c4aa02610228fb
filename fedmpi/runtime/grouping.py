"""``system.client_group`` resolved at setup: how many clients a worker trains in lock-step
(fedmpi.algorithms.group_sgd), the same on every rank.

On CPU workers ``"auto"`` times the two paths before it chooses (``probe``): whether a
group's larger kernels beat one client's depends on the model, the threads and the CPU
(W2's McMahan CNN was 1.13x faster in groups on one 2-core machine and 0.89x on another),
so no rule stays right. A deterministic run does not time (its bits would follow the
timing): there, and on a GPU, the rule of ``plan.group_size`` decides."""

from __future__ import annotations

import time

import torch

from ..algorithms import group_sgd, local_sgd
from ..config.validate import group_refusal
from ..errors import UsageError
from .plan import GROUP_MEMORY_CPU, group_size


def group_memory(device: torch.device) -> int:
    """Bytes a client group may take on ``device``: GROUP_MEMORY_CPU on a CPU, a quarter of
    what is free on a GPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 4
    return GROUP_MEMORY_CPU


PROBE_PASSES = 3     # timed passes of each path after one warm-up; the fastest counts
PROBE_LONG = 0.5     # seconds: a warm-up longer than this is followed by one timed pass
PROBE_MARGIN = 1.05  # a group must be this much faster: it holds G rows, not one model


def _best(passes: int, work) -> float:
    start = time.perf_counter()
    work()   # warm-up: allocations, torch.func's first transform, caches
    if time.perf_counter() - start > PROBE_LONG:   # a large model: setup stays short
        passes = 1
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def probe(flat, g: int, batch_size: int, sample_shape: tuple, num_classes: int, autocast,
          passes: int = PROBE_PASSES) -> tuple[float, float]:
    """(seconds of g clients' SGD steps one after another, seconds of the same steps as
    one group step), each the fastest of ``passes`` after a warm-up (one pass where the
    warm-up took more than PROBE_LONG: a large model's step), on random batches
    of the data's shape (the float layout the data path hands the model). The steps use
    lr 0 and the parameters are restored: the probe changes nothing a run computes."""
    gen = torch.Generator().manual_seed(0)
    shape = tuple(sample_shape)
    x = torch.randn(g * batch_size, *shape, generator=gen).to(flat.params.device)
    if len(shape) == 3 and flat.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(num_classes, (g, batch_size), generator=gen).to(flat.params.device)
    grouped, n = x.view(g, batch_size, *shape), flat.num_params
    model, saved = group_sgd.group_model(flat), flat.params.detach().clone()
    model.buffer(g).copy_(flat.params.expand(g, -1))
    device_type = flat.params.device.type
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)

    def one_by_one():   # local_sgd.train's step: bf16 forward and loss where the run's is
        flat.module.train()
        for i in range(g):
            flat.zero_grad()
            with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
                loss = local_sgd.cross_entropy(flat.module, x[i * batch_size:(i + 1) * batch_size], y[i])
            loss.float().backward()
            local_sgd.sgd_step(flat.params[:n], flat.grads[:n], 0.0, 0.0, 0.0, None, 0.0, False)
        sync()

    def as_group():
        _, pieces = model.gradient_pieces(g, grouped, y, None, autocast)
        model.descend_pieces(g, pieces, 0.0, 0.0)
        sync()

    try:
        return _best(passes, one_by_one), _best(passes, as_group)
    finally:
        with torch.no_grad():
            flat.params.copy_(saved)
        flat.zero_grad()


def client_group(cfg, comm, flat, d: int, device: torch.device, autocast,
                 sample: tuple | None = None, recorded: int | None = None) -> tuple[int, dict]:
    """(the group size, what "auto" measured). "auto": 1 where groups are refused, else
    by the smallest memory budget of the workers' devices; on CPU workers of a run that
    is not deterministic, 1 unless ``probe`` timed the group at least PROBE_MARGIN times
    faster than its clients one by one on every worker taken together. ``sample``: the
    data's (sample shape, classes), which the probe draws batches of; ``recorded``: the
    size a resumed run's file chose (read on the server), which it keeps: the run's bits
    follow it."""
    setting = cfg.system.client_group
    buffers = flat.size != flat.num_params
    if buffers and cfg.eval.client_finetune_group > 1:
        raise UsageError("config field eval.client_finetune_group: the model has float buffers "
                         "(BatchNorm statistics), which a client group cannot carry per "
                         "client; set 1 (one client after another)")
    if setting == "auto" and (buffers or group_refusal(cfg)):
        return 1, {}
    if setting != 1 and buffers:
        raise UsageError("config field system.client_group: the model has float buffers "
                         "(BatchNorm statistics), which a client group cannot carry per "
                         "client; set 1 (one client after another)")
    if setting != "auto":
        return setting, {}
    recorded = comm.bcast_obj(recorded)   # the server read it
    if recorded is not None:
        return recorded, {}
    mine = None
    if comm.is_worker:
        # convolutions that torch.func.vmap differentiates (the model is no chain of
        # plain layers, or the step is bf16), whose grouped kernels lose on a CPU
        vmapped = any(isinstance(m, torch.nn.Conv2d) for m in flat.module.modules()) \
            and not group_sgd.group_model(flat).by_hand(autocast)
        mine = (group_memory(device), device.type == "cpu", torch.get_num_threads(), vmapped)
    workers = [w for w in comm.gather_obj(mine, count=False) or [] if w is not None]
    size = None
    timing = False
    if comm.is_server:
        on_cpu = all(cpu for _, cpu, _, _ in workers)
        one_thread = any(threads == 1 for _, _, threads, _ in workers)
        convolutions = any(v for _, _, _, v in workers)
        timing = on_cpu and not cfg.system.deterministic and sample is not None
        size = group_size("auto", d, cfg.clients.per_round, comm.num_workers,
                          min(free for free, _, _, _ in workers),
                          sequential_faster=not timing and on_cpu and (convolutions or one_thread))
        timing = timing and size > 1
    size, timing = comm.bcast_obj((size, timing))
    if not timing:
        return size, {}
    times = probe(flat, size, cfg.train.batch_size, *sample, autocast) if comm.is_worker else None
    workers = [t for t in comm.gather_obj(times, count=False) or [] if t is not None]
    measured = {}
    if comm.is_server:
        sequential, grouped = (sum(t[i] for t in workers) for i in range(2))
        chosen = size if grouped * PROBE_MARGIN <= sequential else 1
        measured = {"group": size, "sequential_s": sequential, "group_s": grouped,
                    "chosen": chosen}
        size = chosen
    return comm.bcast_obj(size), measured
