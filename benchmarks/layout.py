"""Memory layout and threads for one local SGD step of the `cnn` model.

Times forward + cross-entropy + backward + a manual SGD update on a batch of 50, for
  - layouts: NCHW (default); channels_last (model and input); channels_last input only;
  - torch threads: 2 and 1;
  - workloads: 28x28x1 with hidden=880 (~0.96M params) and 32x32x3 default (~0.88M).
Reports the median ms/step over --steps steps after --warmup steps; the layouts run in
interleaved blocks so slow drifts of the machine hit them equally.

It then checks whether one step is bitwise identical at 1 and 2 threads, which decides
whether a deterministic mode must pin the thread count. Figures: docs/performance.md,
"Memory layout".

glibc malloc thresholds are fixed (the script re-executes itself with them, as every
fedmpi rank should run) unless --system-malloc is given or they are already set.

    python benchmarks/layout.py [--steps 200] [--warmup 30] [--system-malloc]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fedmpi.models import build_model  # noqa: E402

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
BATCH = 50
LR = 0.01
WORKLOADS = {  # label -> (in_channels, image_size, model options)
    "28x28x1 hidden=880": (1, 28, {"hidden": 880}),
    "32x32x3 default": (3, 32, {}),
}
LAYOUTS = ("nchw", "channels_last", "input_cl")
THREADS = (2, 1)


def ensure_malloc_env(args: argparse.Namespace) -> None:
    """Re-exec with fixed malloc thresholds: glibc reads them only at process start."""
    if args.system_malloc or all(k in os.environ for k in MALLOC_ENV):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})


def make_case(workload: str, layout: str, seed: int = 0):
    """A freshly seeded model and a fixed batch, both in the requested layout."""
    in_channels, size, options = WORKLOADS[workload]
    torch.manual_seed(seed)
    model = build_model("cnn", in_channels, 10, size, **options)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, in_channels, size, size, generator=gen)
    y = torch.randint(0, 10, (BATCH,), generator=gen)
    if layout == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    if layout in ("channels_last", "input_cl"):
        x = x.contiguous(memory_format=torch.channels_last)
    return model, x, y


def sgd_step(model, x, y) -> tuple[torch.Tensor, torch.Tensor]:
    """One local SGD step; returns (logits, loss) of the forward pass."""
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    model.zero_grad(set_to_none=True)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-LR)
    return logits, loss


def time_steps(case, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        sgd_step(*case)
        samples.append(time.perf_counter() - start)
    return samples


def time_layouts(workload: str, threads: int, steps: int, warmup: int, block: int = 25):
    """Median ms/step per layout, interleaving blocks of `block` steps across layouts."""
    torch.set_num_threads(threads)
    cases = {layout: make_case(workload, layout) for layout in LAYOUTS}
    samples: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for layout in LAYOUTS:
        time_steps(cases[layout], warmup)
    for _ in range(0, steps, block):
        for layout in LAYOUTS:
            samples[layout] += time_steps(cases[layout], block)
    return {layout: 1e3 * statistics.median(s) for layout, s in samples.items()}


def print_timings(args: argparse.Namespace) -> None:
    print(f"median ms/step over {args.steps} steps (warm-up {args.warmup}), batch {BATCH}")
    print(f"{'workload':<20} {'thr':>3} {'nchw':>7} {'ch_last':>7} {'in_cl':>7}"
          f" {'nchw/ch_last':>12} {'nchw/in_cl':>10}")
    for workload in WORKLOADS:
        for threads in THREADS:
            ms = time_layouts(workload, threads, args.steps, args.warmup)
            print(f"{workload:<20} {threads:>3} {ms['nchw']:7.2f} {ms['channels_last']:7.2f}"
                  f" {ms['input_cl']:7.2f} {ms['nchw'] / ms['channels_last']:12.2f}"
                  f" {ms['nchw'] / ms['input_cl']:10.2f}", flush=True)


def step_result(workload: str, layout: str, threads: int) -> dict[str, torch.Tensor]:
    """Logits, loss, gradients and updated parameters of one step from the seeded start."""
    torch.set_num_threads(threads)
    model, x, y = make_case(workload, layout)
    logits, loss = sgd_step(model, x, y)
    result = {"logits": logits.detach(), "loss": loss.detach()}
    for name, p in model.named_parameters():
        result[f"grad {name}"] = p.grad
        result[f"param {name}"] = p.detach()
    return result


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str:
    """'bitwise identical', or which tensors differ and by how much at most."""
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    if not differ:
        return "bitwise identical"
    worst = max((a[k] - b[k]).abs().max().item() for k in differ)
    return f"DIFFERENT in {len(differ)}/{len(a)} tensors (first: {differ[0]}; max abs diff {worst:.2g})"


def print_determinism() -> None:
    print("\nbitwise determinism of one step (logits, loss, grads, updated params)")
    for workload in WORKLOADS:
        for layout in ("nchw", "channels_last"):
            one, two = step_result(workload, layout, 1), step_result(workload, layout, 2)
            again = step_result(workload, layout, 2)
            print(f"{workload:<20} {layout:<13} 1 vs 2 threads: {compare(one, two)};"
                  f" 2 vs 2 (rerun): {compare(two, again)}")
        nchw, cl = step_result(workload, "nchw", 2), step_result(workload, "channels_last", 2)
        print(f"{workload:<20} {'nchw vs cl':<13} at 2 threads: {compare(nchw, cl)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--system-malloc", action="store_true", help="keep glibc's defaults")
    args = parser.parse_args()
    ensure_malloc_env(args)
    malloc = {k: os.environ.get(k, "default") for k in MALLOC_ENV}
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, malloc {malloc},"
          f" MKL_CBWR={os.environ.get('MKL_CBWR', 'unset')}")
    print_timings(args)
    print_determinism()


if __name__ == "__main__":
    main()
