"""Launcher environments -> local rank, ranks per node, threads and device (no GPU here:
CUDA selection is checked through the same local-rank arithmetic)."""

import pytest
import torch

from fedmpi.runtime.experiment import rank_table
from fedmpi.runtime.system import choose_device, choose_threads, local_rank_info

LAUNCHER_VARS = ("SLURM_CPUS_PER_TASK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_LOCALID",
                 "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                 "SLURM_NODEID", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


@pytest.fixture
def env(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_direct_run_is_rank_0_of_1(env):
    assert local_rank_info() == (0, 1)


def test_openmpi_variables(env):
    env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    env.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "5")
    assert local_rank_info() == (2, 5)


@pytest.mark.parametrize("spec, node, size", [("3", "0", 3), ("5(x2),1", "1", 5),
                                              ("5(x2),1", "2", 1), ("4(x3)", "7", 1)])
def test_srun_without_ntasks_per_node_reads_the_step_layout(env, spec, node, size):
    env.setenv("SLURM_LOCALID", "1")
    env.setenv("SLURM_STEP_TASKS_PER_NODE", spec)
    env.setenv("SLURM_NODEID", node)
    assert local_rank_info() == (1, size)


def test_threads_split_the_node_between_workers(env):
    env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    env.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3")  # server + 2 workers on this node
    import os
    assert choose_threads(0, False, True, 3) == max((os.cpu_count() or 1) // 2, 1)
    assert choose_threads(0, False, False, 3) == 1 and choose_threads(0, True, True, 3) == 1
    assert choose_threads(4, True, True, 3) == 4


def test_threads_follow_slurm_cpus_per_task_and_the_affinity_mask(env):
    import os
    env.setenv("SLURM_CPUS_PER_TASK", "6")
    assert choose_threads(0, False, True, 5) == 6
    env.delenv("SLURM_CPUS_PER_TASK")
    if hasattr(os, "sched_getaffinity") and (os.cpu_count() or 1) > 1:
        env.setattr(os, "sched_getaffinity", lambda pid: {0})  # bound to one core
        assert choose_threads(0, False, True, 3) == 1


def test_device_choice_on_a_cpu_machine(env):
    assert choose_device("auto", True, 1) == torch.device("cpu")
    assert choose_device("cpu", True, 1) == torch.device("cpu")
    assert choose_device("cuda:1", False, 0) == torch.device("cpu")  # the server never trains


def test_rank_table_names_roles_and_devices():
    table = rank_table([{"rank": 0, "host": "n1", "device": "cpu", "threads": 1},
                        {"rank": 1, "host": "n1", "device": "cuda:0", "threads": 8}])
    lines = table.splitlines()
    assert "server" in lines[1] and "worker" in lines[2] and "cuda:0" in lines[2]
    assert "both" in rank_table([{"rank": 0, "host": "h", "device": "cpu", "threads": 2}])
