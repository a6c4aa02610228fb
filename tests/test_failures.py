"""A failing client ends the run promptly, never a hang, and the file keeps what was done."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmpi import config as cfg
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment
from fedmpi.runtime.system import cpu_model, kernels

from conftest import ROOT, fedmpi, mpirun, mpirun_path, needs_mpi
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
        assert run.rounds()["round"].tolist() == [0, 1]   # 0: the initial model's evaluation


@pytest.mark.slow
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
        assert run.rounds()["round"].tolist() == [0, 1]  # the completed rounds survived


# ---- one writer per file, and a file is replaced only once a run has started ---------

LONG = dict(rounds=100000, system={"checkpoint_every": 2})


def start_run(config, out, *extra):
    return subprocess.Popen([sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o",
                             str(out), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_rounds(path, n, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            with RunFile(path) as run:
                if len(run.rounds()["round"]) >= n:
                    return
        except Exception:
            pass
        time.sleep(0.02)
    raise AssertionError(f"{path}: fewer than {n} rounds after {timeout} s")


def stop(proc):
    proc.send_signal(signal.SIGUSR1)
    return proc.communicate(timeout=60)


@pytest.mark.slow
def test_force_never_takes_over_a_live_runs_file(tmp_path):
    config = write_config(tmp_path / "c.toml", **LONG)
    out = tmp_path / "live.h5"
    first = start_run(config, out)
    wait_rounds(out, 3, first)
    second = fedmpi(["run", "-q", str(config), "-o", str(out), "--force", "--set", "seed=9"])
    assert second.returncode == 2
    assert second.stderr.strip() == (f"fedmpi: results file {out} is being written by a live run "
                                     f"(pid {first.pid} on {socket.gethostname()}); stop that run "
                                     f"first, or choose another output with -o/--output")
    live_resume = fedmpi(["run", "--resume", str(out)])
    assert live_resume.returncode == 2 and "being written by a live run" in live_resume.stderr
    stop(first)
    with RunFile(out) as run:   # still the first run's file, intact
        assert run.config["seed"] == TINY["seed"] and run.status == "interrupted"
        assert run.attrs["writer"]["pid"] == first.pid


@pytest.mark.slow
def test_two_resumes_at_once_one_wins_the_other_gets_one_line(tmp_path):
    config = write_config(tmp_path / "c.toml", rounds=200)
    out = tmp_path / "r.h5"
    first = start_run(config, out)
    wait_rounds(out, 2, first)
    stop(first)
    cmd = [sys.executable, "-m", "fedmpi", "run", "-q", "--resume", str(out)]
    a, b = (subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for _ in range(2))
    results = sorted([(a.wait(timeout=300), a.stderr.read()), (b.wait(timeout=300), b.stderr.read())])
    (ok, _), (refused, err) = results
    assert ok == 0 and refused == 2, results
    assert err.count("\n") == 1 and "being written by a live run" in err
    with RunFile(out) as run:   # resumed once, by the winner (bitwise: tests/test_kill_resume.py)
        assert run.status == "completed" and run.rounds()["round"].tolist() == list(range(0, 201))
        assert len(run.attrs["resumes"]) == 1


@pytest.mark.slow
def test_force_keeps_the_old_file_when_the_new_run_fails_in_setup(tmp_path):
    config = write_config(tmp_path / "c.toml", rounds=1)
    out = tmp_path / "keep.h5"
    fedmpi(["run", "-q", str(config), "-o", str(out)], check=True)
    before = out.read_bytes()
    bad = fedmpi(["run", "-q", str(config), "-o", str(out), "--force", "--set", "data.dataset=cifar10",
                  "--set", f"data.data_dir={tmp_path / 'nowhere'}", "--set", "model.name=cnn"])
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "keep.h5"]   # no debris


@pytest.mark.slow
@needs_mpi
def test_force_keeps_the_old_file_when_the_new_run_fails_in_setup_under_mpirun(tmp_path):
    config = write_config(tmp_path / "c.toml", rounds=1)
    out = tmp_path / "keep.h5"
    fedmpi(["run", "-q", str(config), "-o", str(out)], check=True)
    before = out.read_bytes()
    bad = mpirun(3, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o", str(out), "--force",
                     "--set", "data.dataset=cifar10", "--set", f"data.data_dir={tmp_path / 'nowhere'}"],
                 check=False)
    assert bad.returncode == 2 and "fedmpi: " in bad.stderr
    assert out.read_bytes() == before


@pytest.mark.slow   # mpirun with several ranks, tens of seconds
@needs_mpi
def test_ranks_that_resolve_different_configs_stop_before_any_work(tmp_path):
    """Each rank reads the config itself: a file edited while the job started (or a
    stale copy on one node) gave rank 2 another learning rate, silently, or another
    model, and a traceback from a buffer of the wrong length. Rank 2's ``--set`` stands
    in for the edit: it reads what the others did not."""
    config = write_config(tmp_path / "c.toml", rounds=1)
    out = tmp_path / "keep.h5"
    fedmpi(["run", "-q", str(config), "-o", str(out)], check=True)
    before = out.read_bytes()
    edit = "--set train.lr=0.1 --set model.hidden=48"
    script = (f'extra=""; [ "$OMPI_COMM_WORLD_RANK" = 2 ] && extra="{edit}"; '
              f'exec {sys.executable} -m fedmpi run -q {config} -o {out} --force $extra')
    proc = mpirun(3, ["bash", "-c", script], check=False)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fedmpi:")]
    assert lines == ["fedmpi: rank 2 resolved another config than rank 0 (model.hidden = 48 there, "
                     "32 on rank 0; train.lr = 0.1 there, 0.05 on rank 0); every rank must read the "
                     "same one: was the config file edited while the job started? Nothing was run"]
    assert "Traceback" not in proc.stderr and out.read_bytes() == before


def _on_another_node(tmp_path, config, out, mount=None, env=""):
    """A real ``mpirun -n 3`` whose rank 2 plays the first rank of another node: its own
    host name and local rank 0; with ``mount = (file, over)`` its own copy of a data file
    at the same path (node-local scratch), through Linux namespaces; ``env``: its own
    environment variables (``NAME=value ...``). Each rank loads its own data."""
    swap = f"mount --bind {mount[0]} {mount[1]}; " if mount else ""
    run = f"{sys.executable} -m fedmpi run -q {config} -o {out}"
    script = (f'if [ "$OMPI_COMM_WORLD_RANK" = 2 ]; then exec env OMPI_COMM_WORLD_LOCAL_RANK=0 {env} '
              f'unshare --uts --mount bash -c "hostname node-b; {swap}exec {run}"; else exec {run}; fi')
    if subprocess.run(["unshare", "--uts", "--mount", "true"], capture_output=True).returncode:
        pytest.skip("no Linux namespaces here (unshare --uts --mount, as root)")
    return mpirun(3, ["bash", "-c", script], check=False,
                  env={"FEDMPI_NODE_SHARED": "0", "PYTHONPATH": str(tmp_path / "plugins")})


@pytest.mark.slow   # mpirun with several ranks, tens of seconds
@needs_mpi
def test_bad_input_on_one_node_alone_is_said_by_that_node(tmp_path):
    """A plugin that one node cannot import (its environment differs): that rank exited
    2 before MPI started, without a word (only rank 0 speaks for the job), and the job
    ended on mpirun's "exited with non-zero status" alone."""
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "fedmpi_site_plugin.py").write_text("SITE = 1\n")
    config = write_config(tmp_path / "c.toml", rounds=1, plugins=["fedmpi_site_plugin"])
    proc = _on_another_node(tmp_path, config, tmp_path / "run.h5", env="PYTHONPATH=")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fedmpi:")]
    assert lines == ["fedmpi: rank 2 on node-b: config field plugins: cannot import "
                     "'fedmpi_site_plugin' (No module named 'fedmpi_site_plugin')"], proc.stderr
    assert not (tmp_path / "run.h5").exists()


@pytest.mark.slow   # mpirun with several ranks, tens of seconds
@needs_mpi
def test_a_node_whose_copy_of_the_data_differs_stops_the_run_before_any_work(tmp_path):
    """Each node reads the data files itself: a stale copy on one node's scratch trained
    its clients on other data, silently. Rank 2 plays that node."""
    from test_data_arrays import tabular, write

    data, stale = write(tmp_path / "data.npz", **tabular(n_train=40)), tmp_path / "stale.npz"
    write(stale, **{**tabular(n_train=40), "y_train": (np.arange(40) + 1) % 3})
    base = {**TINY, "data": {"dataset": "arrays", "path": str(data)}, "model": {"name": "mlp"},
            "partition": {"kind": "iid"}}
    config = write_config(tmp_path / "c.toml", base, rounds=2, clients={"num": 4, "per_round": 4})
    same = _on_another_node(tmp_path, config, tmp_path / "same.h5")
    assert same.returncode == 0, same.stderr   # another host, the same bytes: it runs
    proc = _on_another_node(tmp_path, config, tmp_path / "stale.h5", mount=(stale, data))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fedmpi:")]
    assert len(lines) == 1 and lines[0].startswith(
        f"fedmpi: rank 2 on node-b loaded other data than rank 0 on {socket.gethostname()} "
        f"(data.path = {data}; SHA-256 "), proc.stderr
    assert lines[0].endswith("every node must read the same files: is a node's copy stale or "
                             "incomplete? Nothing was run")
    assert "Traceback" not in proc.stderr and not (tmp_path / "stale.h5").exists()


@pytest.mark.slow   # mpirun with several ranks, tens of seconds
@needs_mpi
def test_a_deterministic_run_over_two_kinds_of_cpu_says_so(tmp_path):
    """A partition of two CPU generations (AVX2 and AVX-512 nodes): the same software
    computes other last bits on each, so a deterministic run's bits depended on where each
    client trained, silently. Rank 2 plays the older node: torch's default kernels. The
    run goes on; rank 0 says so in one line, --quiet or not, and the file keeps each
    rank's kernels."""
    native = kernels(torch.device("cpu"))
    default = f"cpu DEFAULT on {cpu_model()}"
    if native == default:
        pytest.skip("this CPU runs torch's default kernels already")
    config = write_config(tmp_path / "c.toml", rounds=1, system={"deterministic": True})
    proc = _on_another_node(tmp_path, config, tmp_path / "run.h5", env="ATEN_CPU_CAPABILITY=default")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fedmpi:")]
    assert lines == [f"fedmpi: warning: system.deterministic, but the ranks run different "
                     f"kernels ({native}: ranks 0, 1; {default}: rank 2): a client's bits "
                     f"depend on where it trains, and this run is not bitwise that of another "
                     f"rank count; run on one kind of node (sbatch --constraint) for that"], proc.stderr
    with RunFile(tmp_path / "run.h5") as run:
        assert run.status == "completed"
        assert [r["kernels"] for r in run.attrs["ranks"]] == [native, native, default]


@pytest.mark.slow   # mpirun with several ranks, tens of seconds
@needs_mpi
@pytest.mark.parametrize("stale", ["fedmpi", "torch"])
def test_a_node_that_runs_other_software_stops_the_run_before_any_work(tmp_path, stale):
    """Each node runs its own environment: another torch on one node (another module
    loaded), or a stale copy of fedmpi that still says its version, gave other bits than
    one rank, silently. Rank 2 plays that node: its own copy of a file of the install."""
    import torch.version

    import fedmpi.runtime.rng

    config = write_config(tmp_path / "c.toml", rounds=1)
    if stale == "fedmpi":   # one line more in one module: the version number is the same
        real = Path(fedmpi.runtime.rng.__file__)   # the install the ranks import
        copy = tmp_path / "rng.py"
        copy.write_text(real.read_text() + "# an older checkout\n")
        want = "fedmpi's code "
    else:
        real = Path(torch.version.__file__)
        copy = tmp_path / "version.py"
        copy.write_text(real.read_text().replace(f"'{torch.__version__}'", "'2.13.0+cpu'"))
        want = f"torch 2.13.0+cpu there, {torch.__version__} on rank 0"
    assert copy.read_text() != real.read_text()
    proc = _on_another_node(tmp_path, config, tmp_path / "run.h5", mount=(copy, real))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fedmpi:")]
    assert len(lines) == 1 and lines[0].startswith(
        "fedmpi: rank 2 on node-b runs other software than rank 0 (") and want in lines[0], proc.stderr
    assert lines[0].endswith("every rank must run the same environment: is a node's install "
                             "stale, or another module loaded there? Nothing was run")
    assert "Traceback" not in proc.stderr and not (tmp_path / "run.h5").exists()


@pytest.mark.slow
def test_a_run_whose_file_is_replaced_stops_and_leaves_the_new_file_alone(tmp_path):
    config = write_config(tmp_path / "c.toml", **LONG)
    out, other = tmp_path / "run.h5", tmp_path / "other.h5"
    fedmpi(["run", "-q", str(write_config(tmp_path / "o.toml", rounds=1)), "-o", str(other)], check=True)
    proc = start_run(config, out)
    wait_rounds(out, 3, proc)
    os.replace(other, out)   # e.g. a user's `mv` over it
    replaced = out.read_bytes()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.strip() == (f"fedmpi: results file {out} was replaced by another process during "
                           f"this run; this run's results are not in it")
    assert out.read_bytes() == replaced


@pytest.mark.slow
def test_a_run_whose_file_is_removed_stops_with_one_line(tmp_path):
    """`rm run.h5` under a live run: at its next checkpoint the run stops with one line
    (it was a FileNotFoundError traceback), makes no new file, and leaves no lock."""
    proc = start_run(write_config(tmp_path / "c.toml", **LONG), tmp_path / "run.h5")
    wait_rounds(tmp_path / "run.h5", 3, proc)
    os.unlink(tmp_path / "run.h5")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and err == (
        f"fedmpi: results file {tmp_path / 'run.h5'} was removed by another process during this "
        f"run; its rounds went with it\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]


@pytest.mark.parametrize("closed", [">&- 2>&-", "2>&-", ">&- <&-"])
@pytest.mark.slow
def test_a_run_started_with_its_standard_descriptors_closed_keeps_its_file(tmp_path, closed):
    """Started with stdout or stderr closed, the lock file and the results file took
    descriptors 1 and 2, and a warning written to them below Python (MPI, HDF5, OpenMP)
    went over the results file's first bytes: exit 1, and a file nothing could read."""
    config = write_config(tmp_path / "c.toml", plugins=["toy_algorithms"],
                          algorithm={"name": "toy_chatty", "chat_round": 2}, rounds=4)
    out = tmp_path / "run.h5"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(["bash", "-c", f'exec "$0" -m fedmpi run -q "$1" -o "$2" {closed}',
                           sys.executable, str(config), str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with RunFile(out) as run:
        assert run.status == "completed" and run.rounds()["round"].tolist() == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "run.h5"]


@pytest.mark.slow
def test_divergence_names_the_round_as_progress_lines_count_it(tmp_path):
    config = write_config(tmp_path / "c.toml", rounds=3, train={"lr": 1e30, "grad_clip": 0.0})
    out = tmp_path / "nan.h5"
    proc = fedmpi(["run", str(config), "-o", str(out)])
    assert proc.returncode == 1
    assert "round    1/3" in proc.stdout
    assert "fedmpi: training diverged at round 1 (NaN/Inf loss or parameters)" in proc.stderr
    with RunFile(out) as run:
        assert run.status == "failed" and run.attrs["failed_round"] == 1
        assert run.rounds()["round"].tolist() == [0, 1]


# ---- one line, exit 2, for paths that cannot work --------------------------------------

def test_cuda_on_a_machine_without_cuda_is_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    config = write_config(tmp_path / "c.toml", rounds=1, system={"device": "cuda"})
    proc = fedmpi(["run", "-q", str(config), "-o", str(tmp_path / "x.h5")])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("fedmpi: config field system.device: 'cuda', but torch finds no CUDA")
    assert not (tmp_path / "x.h5").exists()


@pytest.mark.slow
@needs_mpi
def test_cuda_on_a_machine_without_cuda_is_one_line_under_mpirun(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    config = write_config(tmp_path / "c.toml", rounds=1, system={"device": "cuda:0"})
    proc = mpirun(3, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o",
                      str(tmp_path / "x.h5")], check=False)
    assert proc.returncode == 2
    assert proc.stderr.count("fedmpi: config field system.device: 'cuda:0'") == 1
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", ["resume-dir", "output-dir", "output-dir-force", "parent-is-file",
                                  "read-only", "resume-missing"])
def test_paths_that_cannot_work_are_one_line(tmp_path, case):
    config = write_config(tmp_path / "c.toml", rounds=1)
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    args, expected = {
        "resume-dir": (["--resume", str(tmp_path / "adir")], "is a directory"),
        "output-dir": ([str(config), "-o", str(tmp_path / "adir")], "is a directory"),
        "output-dir-force": ([str(config), "-o", str(tmp_path / "adir"), "--force"], "is a directory"),
        "parent-is-file": ([str(config), "-o", str(tmp_path / "afile" / "x.h5")], "is not a directory"),
        "read-only": ([str(config), "-o", "/proc/1/run.h5"], "cannot write in /proc/1"),
        "resume-missing": (["--resume", str(tmp_path / "none.h5")], "does not exist"),
    }[case]
    proc = fedmpi(["run", "-q", *args])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and expected in proc.stderr, proc.stderr
    assert (tmp_path / "adir").is_dir() and (tmp_path / "afile").read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output_directory_is_one_line(tmp_path):
    config = write_config(tmp_path / "c.toml", rounds=1)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    proc = fedmpi(["run", "-q", str(config), "-o", str(ro / "x.h5")])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "cannot write in" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("status", ["interrupted", "completed"])
def test_resume_of_a_truncated_file_says_what_is_readable(tmp_path, status):
    """A file cut short (a full disk, a copy that stopped): `--resume` used to answer
    'already completed' (exit 0) or die in a 'bad object header' traceback."""
    config = write_config(tmp_path / "c.toml", rounds=4, system={"checkpoint_every": 1})
    out = tmp_path / "cut.h5"
    if status == "completed":
        fedmpi(["run", "-q", str(config), "-o", str(out)], check=True)
    else:
        proc = start_run(config, out, "--set", "rounds=100000")
        wait_rounds(out, 4, proc)
        stop(proc)
    data = out.read_bytes()
    out.write_bytes(data[:len(data) * 3 // 4])
    cut = out.read_bytes()
    proc = fedmpi(["run", "-q", "--resume", str(out)], timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"fedmpi: results file {out} is damaged (truncated to "
                                  f"{len(cut):,} of {len(data):,} bytes) and cannot be resumed; "
                                  f"readable: its config")
    assert out.read_bytes() == cut   # nothing touched


# ---- full storage: a disk, a quota, `ulimit -f` -----------------------------------------

FILLS = dict(rounds=60, system={"checkpoint_every": 5, "deterministic": True})


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs of its own (root only, as the suite runs in CI)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory):
    d = tmp_path_factory.mktemp("fills")
    config = write_config(d / "c.toml", **FILLS)
    fedmpi(["run", "-q", str(config), "-o", str(d / "ref.h5")], check=True)
    return config, d / "ref.h5"


def _fill(disk, leave: int = 0) -> None:
    """A file that leaves ``leave`` bytes free on ``disk`` (0: to the brim)."""
    fs = os.statvfs(disk)
    size = max(fs.f_bavail * fs.f_frsize - leave, 0)
    subprocess.run(["dd", "if=/dev/zero", f"of={disk / 'fill'}", "bs=4k", f"count={size // 4096}"],
                   capture_output=True)


def _stopped_for_room(proc, out) -> int:
    """Exit 75 and one line saying so; the file interrupted at its checkpoint's round."""
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    assert "Traceback" not in err and err.count("fedmpi:") == 1, err
    assert "free for run.h5, less than the" in err and "checkpointed after round" in err, err
    with RunFile(out) as run:
        assert run.status == "interrupted" and "storage" in run.attrs["error"]
        assert run.attrs["interrupted_round"] == run.checkpoint().round == run.rounds()["round"][-1]
        return run.checkpoint().round


def _resumes_to_the_same_bits(out, reference) -> None:
    fedmpi(["run", "-q", "--resume", str(out)], check=True)
    with RunFile(out) as a, RunFile(reference) as b:
        assert a.status == "completed" and list(a.rounds()["round"]) == list(range(61))
        assert a.rounds()["test_acc"].tolist() == b.rounds()["test_acc"].tolist()
        assert (a.model() == b.model()).all()


@pytest.mark.slow
def test_a_filling_disk_stops_the_run_with_a_checkpoint_and_it_resumes(small_disk, never_stopped):
    """A checkpoint that finds the disk full can leave the file cut short, past resuming
    (HDF5 extends the file before it writes). Before the disk fills, the run checkpoints,
    says how much room it has and needs, and exits 75; with room again, it resumes."""
    config, reference = never_stopped
    out = small_disk / "run.h5"
    proc = start_run(config, out)
    wait_rounds(out, 5, proc)
    _fill(small_disk, leave=500_000)   # less than the 1 MiB margin the run keeps
    assert 4 <= _stopped_for_room(proc, out) < 60
    (small_disk / "fill").unlink()
    _resumes_to_the_same_bits(out, reference)


@pytest.mark.slow
def test_a_file_size_limit_stops_the_run_the_same_way(tmp_path, never_stopped):
    """`ulimit -f` (a batch system's file-size limit) counts as room too; no mount needed."""
    import resource

    config, reference = never_stopped
    out = tmp_path / "run.h5"
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1_300_000, 1_300_000))  # noqa: E731
    proc = subprocess.Popen([sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=limit)
    assert 0 < _stopped_for_room(proc, out) < 60
    _resumes_to_the_same_bits(out, reference)


def _start_on(ranks: int, config, out) -> subprocess.Popen:
    """`fedmpi run` of ``config`` into ``out``, alone (1) or under a real mpirun."""
    args = [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o", str(out)]
    if ranks > 1:
        args = [mpirun_path(), "-n", str(ranks), "--oversubscribe", "--bind-to", "none"] + args
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_every_line_on_stderr_is_one_write(monkeypatch):
    """mpirun forwards a rank's stderr write by write, and its own messages (MPI_ABORT's
    banner) go between them. Python's stderr writes through, so print() made two writes,
    the text and its newline: under load the full-disk line of an aborting rank came out
    glued to the banner ("...last readable checkpoint-------"). fedmpi says its lines
    through errors.warn, one write each; no print() to stderr is left in it."""
    import ast

    from fedmpi.errors import warn

    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    warn("fedmpi: one line")
    assert writes == ["fedmpi: one line\n"]
    prints = []
    for path in sorted((ROOT / "fedmpi").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print" and any(
                    ast.unparse(kw.value) == "sys.stderr" for kw in node.keywords if kw.arg == "file"):
                prints.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert prints == []


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, pytest.param(3, marks=needs_mpi)])
def test_a_disk_filled_at_once_is_one_line(tmp_path, small_disk, ranks):
    """Another process takes the last byte between two rounds: the next write fails. One
    line and exit 1, where the failure used to bring three chained HDF5 tracebacks (marking
    the file failed needs the disk too)."""
    config = write_config(tmp_path / "c.toml", rounds=100000, system={"checkpoint_every": 5})
    out = small_disk / "run.h5"
    proc = _start_on(ranks, config, out)
    wait_rounds(out, 5, proc)
    _fill(small_disk)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("fedmpi:")]
    assert lines == [f"fedmpi: cannot write {out}: no space left on device; free space (or "
                     f"choose another output), then run again: fedmpi run --resume FILE "
                     f"continues a run from its last readable checkpoint"], err


# 120 states of 23 kB: past the 1 MiB budget by round 4, all of them 2.8 MB on the 4 MB disk
SPILLS = dict(rounds=40, algorithm={"name": "scaffold"}, clients={"num": 120, "per_round": 20},
              data={**TINY["data"], "num_train": 1200}, model={"name": "cnn", "hidden": 256, "channels": [4, 8]},
              system={"checkpoint_every": 5, "deterministic": True, "state_memory_mb": 1})


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, pytest.param(3, marks=needs_mpi)])
def test_a_full_spill_disk_is_one_line_and_the_run_resumes_to_the_same_bits(tmp_path, small_disk, ranks):
    """SCAFFOLD's control variates past system.state_memory_mb spill into
    system.state_dir, here a disk another process fills mid-run. It was numpy's
    traceback, "OSError: 5786 requested and 2048 written", naming no file."""
    states = small_disk / "states"
    reference = tmp_path / "ref.h5"
    fedmpi(["run", "-q", str(write_config(tmp_path / "r.toml", **SPILLS)), "-o", str(reference)], check=True)
    spill_here = {**SPILLS["system"], "state_dir": str(states)}
    config = write_config(tmp_path / "c.toml", **{**SPILLS, "system": spill_here})
    out = tmp_path / "run.h5"
    proc = _start_on(ranks, config, out)
    wait_rounds(out, 6, proc)
    assert any(states.glob("fedmpi-state-*/*.bin"))   # it spills
    _fill(small_disk)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("fedmpi:")]
    assert len(lines) == 1 and lines[0].startswith(f"fedmpi: cannot write {states}/fedmpi-state-"), err
    assert lines[0].endswith(".bin: no space left on device; free space there (client states past "
                             "system.state_memory_mb spill into system.state_dir, or TMPDIR when it "
                             "is unset), then run again: fedmpi run --resume FILE continues a run "
                             "from its last readable checkpoint"), err
    assert list(states.iterdir()) == []   # the spill directory is removed, no partial file left
    (small_disk / "fill").unlink()
    fedmpi(["run", "-q", "--resume", str(out)], check=True)
    with RunFile(out) as a, RunFile(reference) as b:
        assert a.status == "completed" and list(a.rounds()["round"]) == list(range(41))
        assert a.rounds()["test_acc"].tolist() == b.rounds()["test_acc"].tolist()
        assert (a.model() == b.model()).all()


def test_no_room_for_even_the_lock_is_one_line_and_leaves_nothing(tmp_path, small_disk):
    config = write_config(tmp_path / "c.toml", rounds=2)
    _fill(small_disk)
    proc = fedmpi(["run", "-q", str(config), "-o", str(small_disk / "run.h5")])
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(f"fedmpi: cannot write {small_disk / '.run.h5.lock'}: no space "
                                  f"left on device;") and proc.stderr.count("\n") == 1, proc.stderr
    assert sorted(p.name for p in small_disk.iterdir()) == ["fill"]
