"""Launcher environments -> local rank, ranks per node and threads; the node's workers ->
each worker's GPU (no GPU here: torch's CUDA queries are faked, and the node's workers
come from a real mpirun's shared-memory split)."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, mpirun, needs_mpi
from fedmpi.errors import UsageError
from fedmpi.results.schema import kernels_changed
from fedmpi.runtime.experiment import rank_table
from fedmpi.runtime.system import (choose_device, choose_threads, cpu_model, kernels,
                                  kernels_warning, local_rank_info)

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


# the last rows are not SLURM's format (a copied environment): 1, never a traceback; a
# repeat count of 10**12 is not expanded into a list
@pytest.mark.parametrize("spec, node, size", [("3", "0", 3), ("5(x2),1", "1", 5),
                                              ("5(x2),1", "2", 1), ("4(x3)", "7", 1),
                                              ("4(x1000000000000),2", "3", 4),
                                              ("2(xabc)", "0", 1), ("2", "x", 1), ("2(x-1)", "0", 1),
                                              ("-2", "0", 1)])
def test_srun_without_ntasks_per_node_reads_the_step_layout(env, spec, node, size):
    env.setenv("SLURM_LOCALID", "1")
    env.setenv("SLURM_STEP_TASKS_PER_NODE", spec)
    env.setenv("SLURM_NODEID", node)
    assert local_rank_info() == (1, size)


def test_threads_split_the_node_between_workers(env):
    import os
    assert choose_threads(0, False, True, local_workers=2) == max((os.cpu_count() or 1) // 2, 1)
    assert choose_threads(0, False, False, local_workers=2) == 1
    assert choose_threads(0, True, True, local_workers=2) == 1
    assert choose_threads(4, True, True, local_workers=2) == 4


def test_threads_follow_slurm_cpus_per_task_and_the_affinity_mask(env):
    import os
    from fedmpi.runtime import system
    env.setenv("SLURM_CPUS_PER_TASK", "6")
    env.setattr(os, "cpu_count", lambda: 8)
    env.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    env.setattr(system, "cgroup_cpu_limit", lambda *a, **k: None)
    assert choose_threads(0, False, True, local_workers=1) == 6
    env.setenv("SLURM_CPUS_PER_TASK", "12")   # never more than the cores it may use
    assert choose_threads(0, False, True, local_workers=1) == 8
    env.delenv("SLURM_CPUS_PER_TASK")
    if hasattr(os, "sched_getaffinity") and (os.cpu_count() or 1) > 1:
        env.setattr(os, "sched_getaffinity", lambda pid: {0})  # bound to one core
        assert choose_threads(0, False, True, local_workers=2) == 1


def test_device_choice_on_a_cpu_machine(env):
    assert choose_device("auto", True, 1) == torch.device("cpu")
    assert choose_device("cpu", True, 1) == torch.device("cpu")
    assert choose_device("cuda:1", False, 0) == torch.device("cpu")  # the server never trains


def test_rank_table_names_roles_and_devices():
    table = rank_table([{"rank": 0, "host": "n1", "device": "cpu", "threads": 1, "kernels": "cpu AVX2"},
                        {"rank": 1, "host": "n1", "device": "cuda:0", "threads": 8,
                         "kernels": "NVIDIA H100 80GB HBM3"}])
    lines = table.splitlines()
    assert "server" in lines[1] and "worker" in lines[2] and "cuda:0" in lines[2]
    assert lines[1].endswith("cpu AVX2") and lines[2].endswith("NVIDIA H100 80GB HBM3")
    assert "both" in rank_table([{"rank": 0, "host": "h", "device": "cpu", "threads": 2,
                                  "kernels": "cpu AVX2"}])


def test_kernels_name_the_cpu_instruction_set_torch_dispatches_on_and_the_cpu_model():
    """The instruction set alone does not decide the bits: two AVX-512 machines, both
    labelled "cpu AVX512", ended the same deterministic 100-round run of FedU^2 (the same
    commit and torch) 18-23 points of kNN apart (MKL dispatches by vendor, oneDNN by AMX
    and the cache sizes). The CPU's model now stands beside the instruction set."""
    model = cpu_model()
    isa = torch.backends.cpu.get_cpu_capability()
    assert kernels(torch.device("cpu")) == f"cpu {isa} on {model}"
    assert model and model == " ".join(model.split())   # one line, single spaces
    if Path("/proc/cpuinfo").exists():
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        names = [line.split(":", 1)[1] for line in lines
                 if line.split(":", 1)[0].strip() == "model name"]
        assert not names or model == " ".join(names[0].split())
    assert kernels(torch.device("meta")) == "meta"


def test_kernels_changed_compares_models_and_only_the_instruction_set_with_older_files():
    def table(*kinds):
        return [{"rank": r, "device": "cpu", "kernels": k} for r, k in enumerate(kinds)]

    xeon, epyc = "cpu AVX512 on Intel(R) Xeon(R) Platinum 8480+", "cpu AVX512 on AMD EPYC 9654"
    assert not kernels_changed(table(epyc, epyc), table(epyc))
    assert kernels_changed(table(xeon), table(epyc))                 # same instruction set
    assert kernels_changed(table(xeon, xeon), table(xeon, epyc))
    # a file from before the model was recorded: only the instruction set can be compared
    assert not kernels_changed(table("cpu AVX512"), table(epyc))
    assert kernels_changed(table("cpu AVX2"), table(epyc))
    # nothing recorded on either side: nothing to compare
    assert not kernels_changed([{"rank": 0, "device": "cpu"}], table(epyc))
    assert not kernels_changed(table(epyc), [])
    # GPUs keep their model names
    assert kernels_changed(table("NVIDIA A100"), table("NVIDIA H100"))
    assert kernels_warning(table(xeon, epyc)) is not None


def test_kernels_warning_names_each_kind_and_its_ranks():
    def rank(r, kind, device="cpu"):
        return {"rank": r, "device": device, "kernels": kind}

    assert kernels_warning([rank(0, "cpu AVX2"), rank(1, "cpu AVX2")]) is None
    assert kernels_warning([rank(0, "cpu AVX2")]) is None
    assert kernels_warning([{"rank": 0, "device": "cpu"}, rank(1, "cpu AVX2")]) is None   # not recorded
    # a CPU server beside GPU workers of one model: the usual layout, nothing to say
    assert kernels_warning([rank(0, "cpu AVX512"), rank(1, "NVIDIA A100", "cuda:0"),
                            rank(2, "NVIDIA A100", "cuda:1")]) is None
    line = kernels_warning([rank(0, "cpu AVX512"), rank(1, "cpu AVX2"), rank(2, "cpu AVX512"),
                            rank(3, "cpu AVX2")])
    assert "\n" not in line and line.startswith("fedmpi: warning: system.deterministic")
    assert "(cpu AVX512: ranks 0, 2; cpu AVX2: ranks 1, 3)" in line
    assert "(cpu AVX512: rank 0; NVIDIA A100: rank 1; NVIDIA H100: rank 2)" in kernels_warning(
        [rank(0, "cpu AVX512"), rank(1, "NVIDIA A100", "cuda:0"), rank(2, "NVIDIA H100", "cuda:0")])


# ---- GPUs: one per worker, from the node's workers and what each of them sees -----------

@pytest.fixture
def gpus(monkeypatch):
    """A node with n fake GPUs (no CUDA here): torch's two queries are replaced."""
    def make(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return make


def test_workers_that_see_the_same_gpus_take_them_in_rank_order(gpus, monkeypatch):
    gpus(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")    # SLURM --gres, per node
    peers = [(r, "0,1,2,3") for r in (1, 2, 3, 4)]             # the server is not a worker
    assert [choose_device("auto", True, r, peers) for r in (1, 2, 3, 4)] == \
        [torch.device("cuda", k) for k in range(4)]
    assert choose_device("cuda", True, 3, peers) == torch.device("cuda", 2)
    assert choose_device("auto", False, 0, peers) == torch.device("cpu")   # the server


def test_a_worker_bound_to_its_own_gpu_takes_cuda_0(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")           # SLURM --gpus-per-task=1
    peers = [(1, "4"), (2, "5"), (3, "6")]
    assert choose_device("auto", True, 2, peers) == torch.device("cuda", 0)


def test_more_workers_than_gpus_needs_gpu_share(gpus):
    gpus(2)
    peers = [(r, "all") for r in (1, 2, 3)]
    with pytest.raises(UsageError, match=r"3 worker\(s\) on .* see 2 GPU\(s\).*system.gpu_share = true"):
        choose_device("auto", True, 3, peers)
    assert [choose_device("auto", True, r, peers, share=True) for r in (1, 2, 3)] == \
        [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 0)]


def test_cuda_n_is_one_gpu_for_one_worker(gpus):
    gpus(4)
    assert choose_device("cuda:2", True, 1, [(1, "all")]) == torch.device("cuda", 2)
    with pytest.raises(UsageError, match="puts all 2 worker"):
        choose_device("cuda:2", True, 1, [(1, "all"), (2, "all")])
    assert choose_device("cuda:2", True, 1, [(1, "all"), (2, "all")], share=True) == torch.device("cuda", 2)
    with pytest.raises(UsageError, match="'cuda:4', but 1 worker"):
        choose_device("cuda:4", True, 1, [(1, "all")])


def test_cuda_without_cuda_is_a_usage_error(gpus):
    gpus(0)
    assert choose_device("auto", True, 1, [(1, "all")]) == torch.device("cpu")
    for requested in ("cuda", "cuda:0"):
        with pytest.raises(UsageError, match="torch finds no CUDA device"):
            choose_device(requested, True, 1, [(1, "all")])


GPU_CASES = [   # visibility, GPUs on the node, system.device, gpu_share, each worker's device
    ("node", 2, "auto", "0", {1: "cuda:0", 2: "cuda:1"}),
    ("unset", 2, "cuda", "0", {1: "cuda:0", 2: "cuda:1"}),
    ("task", 1, "auto", "0", {1: "cuda:0", 2: "cuda:0"}),
    ("node", 1, "auto", "0", {1: "error", 2: "error"}),
    ("node", 1, "auto", "1", {1: "cuda:0", 2: "cuda:0"}),
    ("node", 2, "cuda:1", "0", {1: "error", 2: "error"}),
]


@pytest.mark.slow
@needs_mpi
def test_gpu_mapping_under_mpirun():
    """1 server + 2 workers on one node, under a real mpirun, the local-rank variables
    removed: the mapping comes from MPI's shared-memory split alone (every case in one
    launch)."""
    cases = [[gpus, visibility, requested, share] for visibility, gpus, requested, share, _ in GPU_CASES]
    proc = mpirun(3, [sys.executable, str(ROOT / "tests/mpi_scripts/gpu_map_check.py"),
                      json.dumps(cases)], timeout=120)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for case, (*_, expected) in enumerate(GPU_CASES):
        got = {r["rank"]: r.get("device", "error") for r in lines if r["case"] == case}
        assert got == {0: "cpu", **expected}, (GPU_CASES[case], lines)


# ---- numerics: deterministic kernels and precision --------------------------------------

def test_deterministic_cuda_flags_are_set_for_the_run_and_restored(monkeypatch):
    """Only flags and an environment variable: no GPU is touched, so this runs here."""
    from fedmpi.runtime.system import CUBLAS_WORKSPACE, numerics

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              torch.are_deterministic_algorithms_enabled())
    with numerics(torch.device("cuda", 0), "fp32", deterministic=True):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    with numerics(torch.device("cuda", 0), "tf32", deterministic=False):
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert not torch.are_deterministic_algorithms_enabled()
    after = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.are_deterministic_algorithms_enabled())
    assert after == before and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with numerics(torch.device("cpu"), "tf32", deterministic=True):   # nothing to set on a CPU
        assert torch.backends.cuda.matmul.allow_tf32 == before[0]
        assert not torch.are_deterministic_algorithms_enabled()


def test_bf16_on_a_cpu_without_native_bfloat16_is_refused(monkeypatch):
    from fedmpi.runtime import system

    monkeypatch.setattr(system, "_cpu_has_bf16", lambda: False)
    with pytest.raises(UsageError, match="system.precision: 'bf16' on a CPU without native"):
        system.autocast_dtype(torch.device("cpu"), "bf16")
    assert system.autocast_dtype(torch.device("cuda", 0), "bf16") == torch.bfloat16
    assert system.autocast_dtype(torch.device("cpu"), "fp32") is None


def test_bf16_training_keeps_fp32_master_weights_and_is_reproducible(tmp_path):
    from fedmpi import config as cfgmod
    from fedmpi.comm import LocalComm
    from fedmpi.results import RunFile
    from fedmpi.runtime import run_experiment
    from fedmpi.runtime.system import _cpu_has_bf16
    from helpers import TINY, merged

    if not _cpu_has_bf16():
        pytest.skip("this CPU has no native bfloat16")
    finals = {}
    for name, precision in (("a", "bf16"), ("b", "bf16"), ("fp32", "fp32")):
        values = merged(TINY, rounds=2, system={"precision": precision, "deterministic": True})
        values["output"] = str(tmp_path / f"{name}.h5")
        exp = run_experiment(cfgmod.from_dict(values), LocalComm(), quiet=True)
        assert exp.flat.params.dtype == torch.float32 and exp.autocast == (
            torch.bfloat16 if precision == "bf16" else None)
        with RunFile(values["output"]) as run:
            assert run.config["system"]["precision"] == precision
            assert np.isfinite(run.rounds()["train_loss"][1:]).all()   # [0]: round 0, untrained
            finals[name] = run.model()
    assert np.array_equal(finals["a"], finals["b"])          # bf16 is deterministic too
    assert not np.array_equal(finals["a"], finals["fp32"])    # and really ran in bf16
    assert np.allclose(finals["a"], finals["fp32"], atol=0.05)


def test_eval_batch_is_auto_by_device_unless_configured(tmp_path):
    from fedmpi import config as cfgmod
    from fedmpi.comm import LocalComm
    from fedmpi.results import RunFile
    from fedmpi.runtime import run_experiment
    from fedmpi.runtime.experiment import eval_batch_size
    from helpers import TINY, merged

    assert eval_batch_size(0, ["cpu", "cpu", "cpu"]) == 250
    assert eval_batch_size(0, ["cpu", "cuda:0", "cuda:1"]) == 1000
    assert eval_batch_size(64, ["cpu", "cuda:0"]) == 64
    values = merged(TINY, rounds=1, eval={"batch_size": 0})
    values["output"] = str(tmp_path / "auto.h5")
    run_experiment(cfgmod.from_dict(values), LocalComm(), quiet=True)
    with RunFile(values["output"]) as run:
        assert run.config["eval"]["batch_size"] == 0 and run.attrs["eval_batch_size"] == 250
