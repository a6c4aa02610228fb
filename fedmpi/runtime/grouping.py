"""``system.client_group`` resolved at setup: how many clients a worker trains in lock-step
(fedmpi.algorithms.group_sgd), the same on every rank."""

from __future__ import annotations

import torch

from ..algorithms import group_sgd
from ..config.validate import group_refusal
from ..errors import UsageError
from .plan import GROUP_MEMORY_CPU, group_size


def group_memory(device: torch.device) -> int:
    """Bytes a client group may take on ``device``: GROUP_MEMORY_CPU on a CPU, a quarter of
    what is free on a GPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 4
    return GROUP_MEMORY_CPU


def client_group(cfg, comm, flat, d: int, device: torch.device, autocast) -> int:
    """The group size ("auto": 1 where groups are refused or slower, else by the smallest
    memory budget of the workers' devices)."""
    setting = cfg.system.client_group
    buffers = flat.size != flat.num_params
    if buffers and cfg.eval.client_finetune_group > 1:
        raise UsageError("config field eval.client_finetune_group: the model has float buffers "
                         "(BatchNorm statistics), which a client group cannot carry per "
                         "client; set 1 (one client after another)")
    if setting == "auto" and (buffers or group_refusal(cfg)):
        return 1
    if setting != 1 and buffers:
        raise UsageError("config field system.client_group: the model has float buffers "
                         "(BatchNorm statistics), which a client group cannot carry per "
                         "client; set 1 (one client after another)")
    if setting != "auto":
        return setting
    mine = None
    if comm.is_worker:
        # convolutions that torch.func.vmap differentiates (the model is no chain of
        # plain layers, or the step is bf16), whose grouped kernels lose on a CPU
        vmapped = any(isinstance(m, torch.nn.Conv2d) for m in flat.module.modules()) \
            and not group_sgd.group_model(flat).by_hand(autocast)
        mine = (group_memory(device), device.type == "cpu", torch.get_num_threads(), vmapped)
    workers = [w for w in comm.gather_obj(mine, count=False) or [] if w is not None]
    size = None
    if comm.is_server:
        on_cpu = all(cpu for _, cpu, _, _ in workers)
        one_thread = any(threads == 1 for _, _, threads, _ in workers)
        convolutions = any(v for _, _, _, v in workers)
        size = group_size("auto", d, cfg.clients.per_round, comm.num_workers,
                          min(free for free, _, _, _ in workers),
                          sequential_faster=on_cpu and (convolutions or one_thread))
    return comm.bcast_obj(size)
