"""A failing client ends the run promptly, never a hang, and the file keeps what was done."""

import os
import sys
import time

import pytest

from fedmpi import config as cfg
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

from conftest import ROOT, mpirun, needs_mpi
from helpers import TINY, merged, write_config

CRASH = dict(plugins=["toy_algorithms"], algorithm={"name": "toy_crash", "crash_round": 1})


def test_single_process_failure_marks_the_file(tmp_path):
    values = merged(TINY, **CRASH)
    values["output"] = str(tmp_path / "crash.h5")
    c = cfg.from_dict(values)
    with pytest.raises(RuntimeError, match="toy crash"):
        run_experiment(c, LocalComm(), quiet=True)
    with RunFile(c.output_path()) as run:
        assert run.status == "failed" and "toy crash" in run.attrs["error"]
        assert run.rounds()["round"].tolist() == [1]


@needs_mpi
def test_worker_failure_aborts_the_mpi_job_promptly(tmp_path):
    config = write_config(tmp_path / "crash.toml", **CRASH)
    env = {"PYTHONPATH": str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.monotonic()
    proc = mpirun(3, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o",
                      str(tmp_path / "crash.h5")], env=env, check=False, timeout=120)
    assert proc.returncode != 0 and "toy crash" in proc.stderr
    assert time.monotonic() - start < 60
    with RunFile(tmp_path / "crash.h5") as run:
        assert run.rounds()["round"].tolist() == [1]  # the completed round survived
