"""Small configs shared by the runtime, MPI and CLI tests.

They train on the CPU wherever the suite runs: their tests compare bits of runs that are
bitwise the same only on the CPU (a GPU's kernels are so only in deterministic mode) and
name the CPU's kernels; what a GPU does is tested in tests/test_cuda.py, which sets the
device itself. ``FEDMPI_SUITE_DEVICE=cuda`` puts these configs on the GPU (workers
sharing it) for the tests that hold there too: tests/test_kill_resume.py, whose runs are
all deterministic."""

import os
import subprocess
import sys
from pathlib import Path

from fedmpi.config import to_toml

DEVICE = os.environ.get("FEDMPI_SUITE_DEVICE", "cpu")
_SYSTEM = {"device": DEVICE} if DEVICE == "cpu" else {"device": DEVICE, "gpu_share": True}

TINY = {
    "name": "tiny", "seed": 3, "rounds": 3,
    "data": {"dataset": "synthetic", "num_train": 600, "num_test": 200, "size": 16},
    "partition": {"kind": "dirichlet", "alpha": 0.5},
    "clients": {"num": 12, "per_round": 5},
    "model": {"name": "cnn", "hidden": 32, "channels": [4, 8]},
    "algorithm": {"name": "fedavg"},
    "train": {"local_epochs": 1, "batch_size": 16, "lr": 0.05},
    "eval": {"every": 1, "batch_size": 64},
    "system": dict(_SYSTEM),
}

# A self-supervised run in seconds: heads small enough for a 16x16 synthetic set; clients
# skip rounds (FedEMA's reset); deterministic, so 1 and N ranks compare bitwise.
SSL = {
    "name": "ssl", "seed": 3, "rounds": 3,
    "data": {"dataset": "synthetic", "num_train": 1200, "num_test": 200, "size": 16},
    "partition": {"kind": "dirichlet", "alpha": 0.5},
    "clients": {"num": 6, "per_round": 4},
    "model": {"name": "cnn", "hidden": 32, "channels": [4, 8]},
    "algorithm": {"name": "fedbyol", "proj_dim": 16, "proj_hidden": 32, "pred_hidden": 16},
    "train": {"batch_size": 64, "lr": 0.05},
    "system": {"deterministic": True, **_SYSTEM},
}


def merged(base=TINY, **sections) -> dict:
    """``base`` with sections updated key by key and top-level values replaced."""
    values = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in sections.items():
        if isinstance(value, dict):
            values.setdefault(key, {}).update(value)
        else:
            values[key] = value
    return values


def write_config(path: Path, base=TINY, **sections) -> Path:
    """TINY with some sections/keys replaced, written as TOML."""
    path.write_text(to_toml(merged(base, **sections)))
    return path


def run_file(tmp_path: Path, name: str, values: dict):
    """Run ``values`` in this process into ``tmp_path / name.h5``; its RunFile, open."""
    from fedmpi import config
    from fedmpi.comm import LocalComm
    from fedmpi.results import RunFile
    from fedmpi.runtime import run_experiment

    path = tmp_path / f"{name}.h5"
    run_experiment(config.from_dict({**values, "output": str(path)}), LocalComm(), quiet=True)
    return RunFile(path)


def assert_same_on_3_ranks(tmp_path: Path, values: dict, columns=(), client_eval=False) -> None:
    """``values`` under ``mpirun -n 3`` and in this process: the final models, these
    /rounds columns and (``client_eval``) every /client_eval column bit for bit the same."""
    assert_same_on_ranks(tmp_path, values, 3, columns, client_eval)


def assert_same_on_ranks(tmp_path: Path, values: dict, ranks: int, columns=(),
                         client_eval=False, client_columns=()) -> None:
    """``values`` under ``mpirun -n ranks`` and in this process: the final models, these
    /rounds columns, these /clients columns and (``client_eval``) every /client_eval
    column bit for bit the same."""
    import numpy as np

    from conftest import mpirun
    from fedmpi.results import RunFile

    config = write_config(tmp_path / f"n{ranks}.toml", values)
    mpirun(ranks, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o",
                   str(tmp_path / f"n{ranks}.h5")])
    with run_file(tmp_path, "one", values) as a, RunFile(tmp_path / f"n{ranks}.h5") as b:
        assert np.array_equal(a.model(), b.model())
        for name in columns:
            assert np.array_equal(a.rounds()[name], b.rounds()[name], equal_nan=True), name
        for name in client_columns:
            assert np.array_equal(a.clients()[name], b.clients()[name], equal_nan=True), name
        if client_eval:
            rows = b.client_eval()
            for name, column in a.client_eval().items():
                assert np.array_equal(column, rows[name], equal_nan=True), name


# 12 clients of exactly 32 samples (a power of two: n_i Delta_i and Delta_i sum to the same
# bits up to that factor), 4 a round drawn uniformly: the privacy tests' reductions
EQUAL_SIZES = merged({**TINY, "partition": {"kind": "iid"}}, rounds=2,
                     data={**TINY["data"], "num_train": 384}, clients={"num": 12, "per_round": 4},
                     system={**TINY["system"], "deterministic": True})


def run_and_resume(values: dict, tmp_path: Path):
    """Run ``values`` to ``tmp_path / "ref.h5"``; copy the file as if the process had died
    after its last round was flushed (status running, no final model) and resume the
    copy from its checkpoint. Returns (the copy's path, the resumed Experiment)."""
    import h5py

    from fedmpi import config
    from fedmpi.comm import LocalComm
    from fedmpi.runtime import run_experiment

    ref, crashed = tmp_path / "ref.h5", tmp_path / "crashed.h5"
    run_experiment(config.from_dict({**values, "output": str(ref)}), LocalComm(), quiet=True)
    crashed.write_bytes(ref.read_bytes())
    with h5py.File(crashed, "r+") as f:
        f.attrs["status"] = "running"
        del f["model/final"]
    exp = run_experiment(config.from_dict({**values, "output": str(crashed)}), LocalComm(),
                         quiet=True, resume=True)
    return crashed, exp


def descendants(pid: int) -> list[int]:
    """The pids of ``pid``'s children, theirs, and so on (mpirun's ranks, say)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        children.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
