"""The command line as a user meets it: real subprocesses, real files."""

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from fedmpi import streams
from fedmpi.errors import UsageError, out_of_memory
from fedmpi.results import RunFile
from fedmpi.results.writer import refuse_foreign
from fedmpi.runtime.runfile import command_line

from conftest import ROOT, fedmpi, mpirun, needs_mpi
from helpers import TINY, write_config


def assert_usage_error(proc, *words):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedmpi: "), proc.stderr
    for word in words:
        assert word in lines[0]


@pytest.mark.parametrize("args,field", [
    (["--set", "train.lr=-1"], "train.lr"),
    (["--set", "clients.per_round=500"], "clients.per_round"),
    (["--set", "algorithm.name=nope"], "algorithm.name"),
    (["--preset", "missing"], "preset"),
    (["/no/such/file.toml"], "/no/such/file.toml"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, field):
    proc = fedmpi(["run", *args, "-o", str(tmp_path / "x.h5")])
    assert_usage_error(proc, field)
    assert not (tmp_path / "x.h5").exists()


@pytest.mark.slow
@pytest.mark.parametrize("stdout", ["pipe-and-stderr", "full-disk"])
def test_a_closed_stdout_does_not_stop_the_run(tmp_path, stdout):
    """`fedmpi run exp.toml 2>&1 | head -2`: the reader goes away after two lines; stdout on
    a full disk (/dev/full): every write fails. The run completes, exit 0, and says once
    on stderr (where it can) how to follow it."""
    config, out = write_config(tmp_path / "c.toml", rounds=40), tmp_path / "r.h5"
    with open("/dev/full", "w") as full:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedmpi", "run", str(config), "-o", str(out)], text=True,
            stdout=full if stdout == "full-disk" else subprocess.PIPE,
            stderr=subprocess.STDOUT if stdout == "pipe-and-stderr" else subprocess.PIPE)
    if stdout == "pipe-and-stderr":
        head = [proc.stdout.readline() for _ in range(2)]
        proc.stdout.close()
        assert head[0].startswith("rank  role")
    err = "" if stdout == "pipe-and-stderr" else proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err
    with RunFile(out) as run:
        assert run.status == "completed" and run.rounds()["round"][-1] == 40
    if stdout == "full-disk":   # a busy node adds its load warning (tests/test_threads.py)
        said = [line for line in err.splitlines() if not line.startswith("fedmpi: warning: load average")]
        assert said == [f"fedmpi: stdout cannot be written (no space left on device); the run "
                        f"goes on without progress lines; follow it with: fedmpi watch {out}"], err


def test_a_stream_whose_reader_is_gone_takes_every_later_write(capsys):
    """`fedmpi run exp.toml | head -2`, in one process: the write that finds the pipe
    closed points the descriptor at /dev/null, says so once, and never raises."""
    read, write = os.pipe()
    os.close(read)
    stream = streams._Unbreakable(os.fdopen(write, "w"), "stdout", "the run goes on")
    for _ in range(3):
        stream.write("round\n")
        stream.flush()
    assert stream.gone and os.path.samefile(f"/proc/self/fd/{write}", os.devnull)
    assert capsys.readouterr().err == ("fedmpi: stdout was closed (broken pipe); the run "
                                       "goes on\n")
    stream.close()


@pytest.mark.slow
def test_output_into_a_full_disk_is_one_line_without_resume_advice():
    """`fedmpi config > /dev/full`: one line; no `--resume` advice for a command that has
    no run to resume."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "fedmpi", "config"], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr == (
        "fedmpi: cannot write the output: no space left on device; free space, or send it "
        "elsewhere\n")


def test_out_of_memory_is_one_line(tmp_path):
    """A model too large for the memory (or ulimit -v, or a GPU): one line, exit 1, no
    results file; torch's CPU and GPU errors and MemoryError are told apart from others.
    3.2 PB: beyond any address space, whatever the kernel's overcommit policy."""
    out = tmp_path / "r.h5"
    proc = fedmpi(["run", str(write_config(tmp_path / "c.toml")), "-o", str(out),
                   "--set", "model.hidden=100000000000000"])
    assert proc.returncode == 1 and proc.stderr == (
        "fedmpi: out of memory: cannot allocate 3200000.0 GB; a smaller model, eval.batch_size or "
        "system.client_group needs less (a run goes on from its last checkpoint with fedmpi "
        "run --resume FILE)\n")
    assert not out.exists()
    gpu = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                                 "total capacity of 79.10 GiB of which 1.02 GiB is free.")
    assert out_of_memory(gpu) == "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert out_of_memory(MemoryError()) == "cannot allocate memory"
    try:
        try:
            raise MemoryError("numpy")
        except MemoryError as exc:
            raise RuntimeError("while loading") from exc
    except RuntimeError as chained:
        assert out_of_memory(chained) == "cannot allocate memory (numpy)"
    assert out_of_memory(RuntimeError("shape mismatch")) is None
    # torch that cannot even be loaded under the address-space limit
    limited = subprocess.run(["bash", "-c", 'ulimit -v 1500000 && exec "$0" -m fedmpi run "$1"',
                              sys.executable, str(tmp_path / "c.toml")],
                             capture_output=True, text=True, timeout=120)
    assert limited.returncode == 1, limited.stderr
    assert limited.stderr.startswith("fedmpi: out of memory: cannot load lib")   # libtorch_cpu.so
    assert limited.stderr.endswith(" (the address space is limited to 1.4 GiB: ulimit -v); "
                                   "raise the limit\n") and limited.stderr.count("\n") == 1


def test_the_command_line_is_recorded_whatever_its_bytes(monkeypatch):
    """`fedmpi run $'\\xfe.toml'` (a config file named in another encoding) failed at the
    end of setup: the results file could not store the command as text."""
    monkeypatch.setattr(sys, "argv", ["fedmpi", "run", "\udcfe.toml", "-o", "r.h5"])
    assert command_line() == "fedmpi run \\xfe.toml -o r.h5"


def test_a_removed_working_directory_is_one_line(tmp_path):
    """A job started in a directory that was removed meanwhile (torch's MKL would die
    loading its libraries, exit 2 with a line about libtorch_cpu.so)."""
    config = write_config(tmp_path / "c.toml")
    gone = tmp_path / "gone"
    gone.mkdir()
    proc = subprocess.run(["bash", "-c", 'cd "$1" && rmdir "$1" && exec "$2" -m fedmpi run "$3"',
                           "-", str(gone), sys.executable, str(config)],
                          capture_output=True, text=True, timeout=120)
    assert_usage_error(proc, "the current directory no longer exists")
    assert list(tmp_path.iterdir()) == [config]


def test_existing_results_are_never_overwritten(tmp_path):
    out = tmp_path / "keep.h5"
    out.write_bytes(b"precious")
    config = write_config(tmp_path / "c.toml")
    assert_usage_error(fedmpi(["run", str(config), "-o", str(out)]), "--force")
    assert out.read_bytes() == b"precious"


def test_force_overwrites_results_files_only(tmp_path):
    """`-o exp.toml --force` (the config itself), a dataset, notes: never overwritten. An
    empty file and a results file, whole or cut short, may be."""
    config = write_config(tmp_path / "c.toml")
    before = config.read_bytes()
    assert_usage_error(fedmpi(["run", str(config), "-o", str(config), "--force"]),
                       f"results file {config} exists and is not an HDF5 file; --force "
                       f"overwrites fedmpi results files only")
    assert config.read_bytes() == before
    data = tmp_path / "data.h5"
    with h5py.File(data, "w") as f:
        f["x_train"] = np.zeros(3)
    with pytest.raises(UsageError, match="is an HDF5 file but not a fedmpi results file"):
        refuse_foreign(data)
    run = tmp_path / "run.h5"
    run.write_bytes((ROOT / "tests/data/results-v1.h5").read_bytes())
    (tmp_path / "cut.h5").write_bytes(run.read_bytes()[:4000])
    (tmp_path / "empty.h5").write_bytes(b"")
    for name in ("run.h5", "cut.h5", "empty.h5", "absent.h5"):
        refuse_foreign(tmp_path / name)
    # no file at all: `-o /dev/null --force` as root replaced the device with an HDF5 file
    # (checked on the library call only: the command line gets a named pipe, so that a
    # regression can't take /dev/null from the machine)
    with pytest.raises(UsageError, match="exists and is a character device, not a file"):
        refuse_foreign("/dev/null")
    os.mkfifo(tmp_path / "pipe")
    assert_usage_error(fedmpi(["run", str(config), "-o", str(tmp_path / "pipe"), "--force"]),
                       f"results file {tmp_path / 'pipe'} exists and is a named pipe, not a file")
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode)


@pytest.mark.slow
@needs_mpi
def test_bad_input_under_mpirun_exits_2_before_mpi_work(tmp_path):
    proc = mpirun(3, [sys.executable, "-m", "fedmpi", "run", "--set", "rounds=-2",
                      "-o", str(tmp_path / "x.h5")], check=False, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("fedmpi: config field rounds") == 1
    assert not (tmp_path / "x.h5").exists()
    # click's own errors too: they were four lines of usage from every rank
    proc = mpirun(3, [sys.executable, "-m", "fedmpi", "run", "--nope"], check=False, timeout=120)
    assert proc.returncode == 2
    said = [line for line in proc.stderr.splitlines() if "nope" in line]
    assert len(said) == 1 and said[0].startswith("fedmpi: run: no such option '--nope'"), said


@pytest.mark.slow
@needs_mpi
def test_one_process_commands_under_mpirun_are_done_once(tmp_path):
    """`srun fedmpi report` in a job of 3 tasks: each rank printed the report, wrote the
    figure over the others' and listed the sweep; launcher rank 0 alone does it now."""
    config = write_config(tmp_path / "c.toml", rounds=2)
    out = tmp_path / "run.h5"
    fedmpi(["run", "-q", str(config), "-o", str(out)], check=True)
    report = mpirun(3, [sys.executable, "-m", "fedmpi", "report", str(out)], timeout=300)
    assert report.stdout.count(f"file         {out}") == 1, report.stdout
    plot = mpirun(3, [sys.executable, "-m", "fedmpi", "plot", str(out), "-o", str(tmp_path / "p.png")])
    assert plot.stdout.count("wrote") == 1 and (tmp_path / "p.png").stat().st_size > 0
    count = mpirun(3, [sys.executable, "-m", "fedmpi", "sweep", str(config), "--count"])
    assert count.stdout == "1\n"


@pytest.mark.parametrize("args, says", [
    (["run", "--nope"], "run: no such option '--nope'"),
    (["run", "--quite"], "run: no such option '--quite'. Did you mean '--quiet'? "
                         "(see python -m fedmpi run --help)"),
    (["run", "--set"], "run: option '--set' requires an argument (see python -m fedmpi run --help)"),
    (["run", "a.toml", "b.toml"], "run: got unexpected extra argument (b.toml) "
                                  "(see python -m fedmpi run --help)"),
    (["report"], "report: missing argument 'FILES_OR_DIRS...' (see python -m fedmpi report --help)"),
    (["watch", "--interval"], "watch: option '--interval' requires an argument "
                              "(see python -m fedmpi watch --help)"),
    (["sweep", "s.toml", "--cell"], "sweep: option '--cell' requires an argument "
                                    "(see python -m fedmpi sweep --help)"),
    (["runn"], "no such command 'runn'. Did you mean 'run'? (see python -m fedmpi --help)"),
    (["--nope"], "no such option '--nope' (see python -m fedmpi --help)"),
])
def test_command_line_errors_are_one_line(args, says):
    """An unknown option or command, a missing argument: click printed four lines (usage,
    hint, a blank, the error), once per rank under mpirun."""
    assert_usage_error(fedmpi(args, timeout=60), says)


@pytest.mark.slow
def test_run_report_config_algorithms(tmp_path):
    config = write_config(tmp_path / "c.toml")
    out = tmp_path / "r.h5"
    proc = fedmpi(["run", str(config), "-o", str(out), "--set", "rounds=2"], check=True)
    assert "round    0/2  initial model  test_acc" in proc.stdout
    assert "round    2/2" in proc.stdout and f"results: {out}" in proc.stdout
    report = fedmpi(["report", str(out)], check=True).stdout
    assert "fedavg" in report and "completed" in report
    again = fedmpi(["run", str(config), "-o", str(out), "--set", "rounds=1", "--force", "-q"], check=True)
    assert again.stdout == ""
    with RunFile(out) as run:
        assert run.rounds()["round"].tolist() == [0, 1]
    shown = fedmpi(["config", "--set", "algorithm.name=fedprox", "--set", "algorithm.mu=0.1"], check=True).stdout
    assert "[algorithm]" in shown and "mu = 0.1" in shown
    algos = fedmpi(["algorithms"], check=True).stdout
    assert "fedavg" in algos and "algorithm.mu = 0.01" in algos
    assert "default" in fedmpi(["presets"], check=True).stdout


def test_report_rejects_a_file_that_is_not_a_run(tmp_path):
    bad = tmp_path / "notes.h5"
    bad.write_text("hello")
    assert_usage_error(fedmpi(["report", str(bad)]), str(bad))


@pytest.mark.slow
@needs_mpi
@pytest.mark.skipif(not __import__("pathlib").Path("/usr/share/datasets/fashion-mnist").is_dir(),
                    reason="Fashion-MNIST (Debian dataset-fashion-mnist) not installed")
def test_fashion_mnist_under_mpirun(tmp_path):
    base = dict(TINY, data={"dataset": "fashion_mnist"})
    config = write_config(tmp_path / "fm.toml", base, rounds=2, clients={"num": 20, "per_round": 4},
                          model={"hidden": 128, "channels": [16, 32]},
                          train={"batch_size": 50, "lr": 0.05})
    mpirun(3, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o", str(tmp_path / "fm.h5")],
           timeout=600)
    with RunFile(tmp_path / "fm.h5") as run:
        assert run.status == "completed" and run.attrs["world_size"] == 3
        assert run.partition()["client_sizes"].sum() == 60000
        assert run.rounds()["test_acc"][-1] > 0.5


@pytest.mark.slow
@needs_mpi
def test_jobs_mpirun_launcher(tmp_path):
    import os
    import subprocess

    from conftest import ROOT

    config = write_config(tmp_path / "c.toml", rounds=1)
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    script = str(ROOT / "jobs/mpirun.sh")
    for workers in ("0", "two", "1.5", "+2"):
        proc = subprocess.run(["bash", script, str(config), workers, "-o", str(tmp_path / "x.h5")],
                              capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 2 and proc.stderr == (
            f"jobs/mpirun.sh: WORKERS={workers}: must be a whole number >= 1 (worker ranks "
            f"beside the server)\n"), proc.stderr
    assert not (tmp_path / "x.h5").exists()
    # WORKERS left out, options at once: one worker per core (-o was read as WORKERS, and
    # the script died with "o: unbound variable")
    proc = subprocess.run(["bash", script, str(config), "-q", "-o", str(tmp_path / "j.h5")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    with RunFile(tmp_path / "j.h5") as run:
        assert run.attrs["world_size"] == len(os.sched_getaffinity(0)) + 1
        assert run.status == "completed"


@pytest.mark.slow
def test_partition_preview_prints_statistics_and_draws_the_heatmap(tmp_path):
    """`fedmpi partition` shows the split a run would use, without training."""
    out = fedmpi(["partition", "--preset", "default", "--set", "partition.kind=pathological",
                  "--set", "partition.n=2", "--set", "partition.noise=0.2",
                  "--plot", str(tmp_path / "h.png")], check=True).stdout
    assert "partition    pathological" in out and " n=2" in out and "classes per client    mean 2.00  min 2  max 2" in out
    assert "noise        level: std 0..0.2" in out and "label skew, EMD" in out
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = write_config(tmp_path / "c.toml", dict(TINY, partition={"kind": "pathological", "n": 2}),
                          clients={"num": 12, "per_round": 4})
    fedmpi(["run", "-q", str(config), "-o", str(tmp_path / "r.h5")], check=True)
    from fedmpi.data.heterogeneity import format_summary, summary
    with RunFile(tmp_path / "r.h5") as run:  # the preview's numbers are the run's split
        stats = format_summary(summary(run.partition()["class_counts"]))
    assert stats in fedmpi(["partition", str(config)], check=True).stdout
    bad = fedmpi(["partition", "--preset", "default", "--set", "partition.kind=pathological",
                  "--set", "partition.n=11"])
    assert bad.returncode == 2 and "partition.n" in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_figure_files_that_cannot_be_written_are_one_line(tmp_path):
    """`--plot run.h5` or `--plot exp.toml` (a slip of the results or config file) ended in
    matplotlib's traceback, as did a missing folder or a pipe; `fedmpi plot -o` had the
    same answers already (tests/test_plot_watch.py). Now one line, and the file named keeps
    its bytes."""
    pytest.importorskip("matplotlib")
    from fedmpi import config as fconfig
    from fedmpi.preview import preview

    config = write_config(tmp_path / "c.toml")
    text = config.read_bytes()
    pipe = tmp_path / "p.png"
    os.mkfifo(pipe)
    values = fconfig.from_dict(TINY)
    for path, says in ((config, ": the name must end in a format matplotlib writes, e.g. .png"),
                       (tmp_path / "r.h5", ": the name must end in a format"),
                       (tmp_path / "no" / "h.png", f"cannot be written ({tmp_path / 'no'} is not a folder)"),
                       (config / "h.png", f"cannot be written ({config} is not a folder)"),
                       (pipe, "cannot be written (File or stream is not seekable.)")):
        if path.suffix == ".h5":
            path.write_bytes(b"\x89HDF\r\n\x1a\n")
        with pytest.raises(UsageError, match=f"^heatmap file {re.escape(str(path))} ?{re.escape(says)}"):
            preview(values, plot=path)
    assert (tmp_path / "r.h5").read_bytes() == b"\x89HDF\r\n\x1a\n" and pipe.is_fifo()
    assert config.read_bytes() == text


@pytest.mark.slow
def test_algorithms_lists_a_plugin_and_names_a_bad_one():
    here = str(Path(__file__).parent)   # `python -m` imports from its working directory
    listed = fedmpi(["algorithms", "--plugin", "toy_algorithms"], check=True, cwd=here)
    assert "\ntoy_probe  (" in listed.stdout and "\nfedavg  (" in listed.stdout
    assert_usage_error(fedmpi(["algorithms", "--plugin", "no_such_plugin"]), "plugins",
                       "no_such_plugin")
    # one method's parameters without paging through 22 (`algorithms fedprox` was refused)
    one = fedmpi(["algorithms", "toy_probe", "fedprox", "toy_probe", "--plugin", "toy_algorithms"],
                 check=True, cwd=here).stdout
    heads = [line.split()[0] for line in one.splitlines() if not line.startswith(" ")]
    assert heads == ["toy_probe", "fedprox"] and "    algorithm.mu = 0.01" in one
    assert_usage_error(fedmpi(["algorithms", "fedprx"]), "algorithm 'fedprx' does not exist "
                       "(did you mean 'fedprox'?); choose from apfl, ditto, fedacg, fedadam, fedala,")
