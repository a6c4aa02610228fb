"""Default torch threads from what the process may use: affinity mask, cgroup CPU quota
(fake cgroup folders), SLURM_CPUS_PER_TASK and the node's workers; the start-up load
warning; and one real one-core affinity under taskset."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from fedmpi.runtime import system
from fedmpi.runtime.system import cgroup_cpu_limit, choose_threads, load_warning

LAUNCHER_VARS = ("SLURM_CPUS_PER_TASK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
                 "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE",
                 "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


@pytest.fixture
def node(monkeypatch, tmp_path):
    """An 8-core node with no launcher variables and an empty cgroup tree: ``node(cores,
    quota)`` sets the affinity mask and, when given, a cgroup v2 cpu.max."""
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "cgroup"
    root.mkdir()
    monkeypatch.setattr(system, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(system, "CGROUP_MEMBERSHIP", str(tmp_path / "no-membership"))
    monkeypatch.setattr(os, "cpu_count", lambda: 8)

    def make(cores=8, quota=None):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
        if quota is not None:
            (root / "cpu.max").write_text(quota + "\n")
        return monkeypatch
    return make


@pytest.mark.parametrize("text, cpus", [("max 100000", None), ("150000 100000", 2),
                                        ("50000 100000", 1), ("400000 100000", 4),
                                        ("1 100000", 1)])
def test_cgroup_v2_cpu_max(tmp_path, text, cpus):
    (tmp_path / "cpu.max").write_text(text + "\n")
    assert cgroup_cpu_limit(str(tmp_path), str(tmp_path / "none")) == cpus


@pytest.mark.parametrize("quota, cpus", [("-1", None), ("250000", 3), ("100000", 1), ("20000", 1)])
def test_cgroup_v1_cfs_quota(tmp_path, quota, cpus):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(quota + "\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(str(tmp_path), str(tmp_path / "none")) == cpus


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert cgroup_cpu_limit(str(tmp_path), str(tmp_path / "none")) is None
    (tmp_path / "cpu.max").write_text("garbage\n")
    assert cgroup_cpu_limit(str(tmp_path), str(tmp_path / "none")) is None


def test_a_quota_on_any_ancestor_of_the_own_cgroup_binds(tmp_path):
    """A process on a host: /proc/self/cgroup names its cgroup below the root."""
    membership = tmp_path / "membership"
    membership.write_text("1:cpu,cpuacct:/slurm/job_7\n0::/job/step\n")
    (tmp_path / "job" / "step").mkdir(parents=True)
    (tmp_path / "job" / "step" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "job" / "cpu.max").write_text("300000 100000\n")
    assert cgroup_cpu_limit(str(tmp_path), str(membership)) == 3
    v1 = tmp_path / "cpu,cpuacct" / "slurm" / "job_7"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(str(tmp_path), str(membership)) == 2


def test_explicit_threads_deterministic_and_the_server(node):
    node(cores=8, quota="100000 100000")
    assert choose_threads(4, True, False, local_workers=2) == 4   # system.threads wins
    assert choose_threads(16, False, True, local_workers=2) == 16
    assert choose_threads(0, True, True, local_workers=1) == 1
    assert choose_threads(0, False, False, local_workers=2) == 1  # the server waits


def test_unbound_workers_split_the_node(node):
    node(cores=8)
    assert choose_threads(0, False, True, local_workers=1) == 8
    assert choose_threads(0, False, True, local_workers=3) == 2
    assert choose_threads(0, False, True, local_workers=16) == 1
    assert choose_threads(0, False, True, local_workers=0) == 8   # a server-only node's view


def test_the_node_s_workers_are_told_never_guessed_from_the_launcher(node):
    """The launcher's variables count a node's ranks, not whether the server is one of
    them: subtracting it on every node gave each of a node's 2 workers (the server on
    another node) 2 threads on 2 cores, where 1 is right. The caller says how many
    workers share the node (``node_workers``: MPI's shared-memory split)."""
    env = node(cores=2)
    env.setattr(os, "cpu_count", lambda: 2)          # a 2-core node, all of it usable
    env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    env.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")   # 2 workers; the server elsewhere
    with pytest.raises(TypeError, match="local_workers"):
        choose_threads(0, False, True)
    assert choose_threads(0, False, True, local_workers=2) == 1


def test_a_bound_rank_uses_its_own_cores_undivided(node):
    node(cores=4)
    assert choose_threads(0, False, True, local_workers=2) == 4


def test_the_cgroup_quota_is_shared_by_the_node_s_workers(node):
    node(cores=8, quota="400000 100000")
    assert choose_threads(0, False, True, local_workers=1) == 4
    assert choose_threads(0, False, True, local_workers=2) == 2
    assert choose_threads(0, False, True, local_workers=8) == 1


def test_slurm_cpus_per_task_is_capped_by_affinity_and_quota(node):
    env = node(cores=8)
    env.setenv("SLURM_CPUS_PER_TASK", "6")
    assert choose_threads(0, False, True, local_workers=1) == 6
    env = node(cores=2)   # bound to two cores
    assert choose_threads(0, False, True, local_workers=1) == 2
    env = node(cores=8, quota="300000 100000")
    assert choose_threads(0, False, True, local_workers=1) == 3
    env.setenv("SLURM_CPUS_PER_TASK", "0")
    assert choose_threads(0, False, True, local_workers=1) == 1


def test_load_warning_is_one_line_when_the_node_is_overloaded(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (12.5, 3.0, 1.0))
    line = load_warning(3, 8)
    assert line.startswith("fedmpi: ") and "\n" not in line
    assert "12.5" in line and "8 cores" in line and "3 torch thread" in line
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert "4 cores" in load_warning(1)   # the node's cores by default


@pytest.mark.parametrize("load", [0.0, 7.9, 8.0])
def test_no_load_warning_within_the_cores(monkeypatch, load):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 20.0, 20.0))
    assert load_warning(2, 8) is None


def test_no_load_warning_without_a_load_average(monkeypatch):
    def unknown():
        raise OSError("no load average")
    monkeypatch.setattr(os, "getloadavg", unknown)
    assert load_warning(2, 1) is None


# fedmpi.runtime's package imports torch (seconds); system.py needs neither at import
IMPORT_SYSTEM_ONLY = (
    "import sys, types\n"
    "sys.modules['torch'] = types.ModuleType('torch')\n"
    "runtime = types.ModuleType('fedmpi.runtime')\n"
    f"runtime.__path__ = [{str(ROOT / 'fedmpi' / 'runtime')!r}]\n"
    "sys.modules['fedmpi.runtime'] = runtime\n"
    "from fedmpi.runtime.system import choose_threads\n"
    "print(choose_threads(0, False, True, local_workers=1))\n")


@pytest.mark.skipif(shutil.which("taskset") is None, reason="no taskset")
def test_one_core_affinity_gives_one_thread():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", IMPORT_SYSTEM_ONLY],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1"


def test_a_run_on_an_overloaded_node_warns_once_on_stderr(monkeypatch, tmp_path, capsys):
    """Through the runtime: after the rank table, one warning line; a quiet run prints
    nothing (its errors stay one line)."""
    from fedmpi import config as cfg
    from fedmpi.comm import LocalComm
    from fedmpi.runtime import run_experiment
    from helpers import TINY, merged

    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    for quiet in (False, True):
        values = merged(TINY, rounds=1, system={"threads": 1})
        values["output"] = str(tmp_path / f"q{quiet}.h5")
        run_experiment(cfg.from_dict(values), LocalComm(), quiet=quiet)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "load average" in line]
        assert len(lines) == (0 if quiet else 1)
        if not quiet:
            assert "99.0" in lines[0] and "1 torch thread" in lines[0]
