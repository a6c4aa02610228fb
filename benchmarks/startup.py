"""What a ``fedmpi`` process costs before and after its work: the CPU seconds (user +
system, from the kernel's accounting of the child) of short commands, as shipped
(``python -m fedmpi``) and without the exit-time ``gc.freeze`` of ``fedmpi.__main__``
(the same click commands called straight from ``fedmpi.cli``), alternated in the same
run; and the floors: ``import torch`` alone, and ``import torch`` then ``os._exit`` (no
finalisation at all).

Every rank of an ``mpirun`` job pays this, and so does every command of a sweep's or a
test suite's few hundred processes. Figures: docs/performance.md, "Start-up and exit".

    python benchmarks/startup.py               # 5 repetitions of each
    python benchmarks/startup.py --repeat 11
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TINY = """\
name = "tiny"
seed = 3
rounds = 3
[data]
dataset = "synthetic"
num_train = 600
num_test = 200
size = 16
[partition]
kind = "dirichlet"
alpha = 0.5
[clients]
num = 12
per_round = 5
[model]
name = "cnn"
hidden = 32
channels = [4, 8]
[algorithm]
name = "fedavg"
[train]
batch_size = 16
lr = 0.05
[system]
device = "cpu"
threads = 1
"""

SHIPPED = ["-m", "fedmpi"]
UNFROZEN = ["-c", "import sys; sys.argv[0] = 'fedmpi'; from fedmpi.cli import main; main()"]


def cpu_seconds(argv: list[str], cwd: Path) -> float:
    """User + system CPU of one child process, from wait4's rusage."""
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} -> {proc.returncode}: {proc.stderr.read().decode()}")
    proc.stderr.close()
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "tiny.toml").write_text(TINY)
        commands = {
            "fedmpi config": ["config", "tiny.toml"],
            "fedmpi run (3 tiny rounds)": ["run", "-q", "tiny.toml", "-o", "t.h5", "--force"],
        }
        variants = {f"{name}: {kind}": [sys.executable, *prefix, *argv]
                    for name, argv in commands.items()
                    for kind, prefix in (("as shipped", SHIPPED), ("no exit freeze", UNFROZEN))}
        variants["import torch"] = [sys.executable, "-c", "import torch"]
        variants["import torch; os._exit(0)"] = [sys.executable, "-c",
                                                 "import os, torch; os._exit(0)"]
        times = {name: [] for name in variants}
        for _ in range(args.repeat):   # alternated: a slow spell of the machine hits all
            for name, argv in variants.items():
                times[name].append(cpu_seconds(argv, tmp))
    print(f"CPU seconds per process (median of {args.repeat}, user + system):")
    for name, values in times.items():
        print(f"  {name:<44} {statistics.median(values):6.2f}")
    for name in commands:
        shipped = statistics.median(times[f"{name}: as shipped"])
        unfrozen = statistics.median(times[f"{name}: no exit freeze"])
        print(f"  {name}: the exit freeze saves {unfrozen - shipped:.2f} s "
              f"({(unfrozen - shipped) / unfrozen:.0%})")


if __name__ == "__main__":
    main()
