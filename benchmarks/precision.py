"""system.precision: one local SGD step of the CNN and ResNet-18-GN in fp32, tf32 and
bf16, the way fedmpi trains (flat FP32 parameters, forward and loss under autocast for
bf16, manual SGD update), on this machine's CPU and, when present, its GPU.

Reports the median ms/step over --steps steps after --warmup steps, each precision in
interleaved blocks so that slow drifts of the machine hit them equally, and the ratio to
fp32. tf32 only differs from fp32 on NVIDIA GPUs (Ampere and later); on the CPU it is
fp32. bf16 on a CPU without native bfloat16 (AVX512-BF16 or AMX) is refused by fedmpi
and skipped here.

    python benchmarks/precision.py [--steps 40] [--warmup 10] [--device cpu|cuda|all]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fedmpi.algorithms.base import ClientTask  # noqa: E402
from fedmpi.algorithms.local_sgd import autocast, cross_entropy, sgd_step  # noqa: E402
from fedmpi.flat import FlatModel  # noqa: E402
from fedmpi.models import build_model  # noqa: E402
from fedmpi.runtime.system import _cpu_has_bf16, numerics  # noqa: E402

WORKLOADS = {  # label -> (model, in_channels, image size, batch, options)
    "cnn 28x28x1 B50": ("cnn", 1, 28, 50, {}),
    "resnet18-gn 32x32x3 B64": ("resnet18", 3, 32, 64, {}),
}
PRECISIONS = ("fp32", "tf32", "bf16")


def step_timer(workload: str, device: torch.device, precision: str):
    name, channels, size, batch, options = WORKLOADS[workload]
    torch.manual_seed(0)
    flat = FlatModel(build_model(name, channels, 10, size, **options), device, channels_last=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, channels, size, size, generator=gen).to(device)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    task = ClientTask(0, None, flat, device,
                      autocast=torch.bfloat16 if precision == "bf16" else None)
    loss_fn = autocast(cross_entropy, task)

    def run(steps: int) -> float:
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            flat.zero_grad()
            loss_fn(flat.module, x, y).backward()
            sgd_step(flat.params[:flat.num_params], flat.grads, 0.01, 0.0, 10.0)
        sync()
        return (time.perf_counter() - t0) / steps * 1000
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda", "all"), default="all")
    args = parser.parse_args()
    devices = []
    if args.device in ("cpu", "all"):
        devices.append(torch.device("cpu"))
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        devices.append(torch.device("cuda", 0))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU bf16: {_cpu_has_bf16()}, CUDA: "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
    for device in devices:
        precisions = [p for p in PRECISIONS if not (p == "bf16" and device.type == "cpu"
                                                    and not _cpu_has_bf16())]
        for workload in WORKLOADS:
            times = {p: [] for p in precisions}
            timers = {}
            for p in precisions:
                with numerics(device, p, deterministic=False):
                    timers[p] = step_timer(workload, device, p)
                    timers[p](args.warmup)
            for _ in range(args.blocks):
                for p in precisions:
                    with numerics(device, p, deterministic=False):
                        times[p].append(timers[p](args.steps // args.blocks or 1))
            base = statistics.median(times["fp32"])
            cells = "  ".join(f"{p} {statistics.median(t):7.2f} ms ({base / statistics.median(t):.2f}x)"
                              for p, t in times.items())
            print(f"{device.type:<4} {workload:<26} {cells}")


if __name__ == "__main__":
    main()
