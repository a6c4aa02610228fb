"""Damaged results files and dead runs: one line and an exit code, never a hang.

Every file here is a real one: a run made by ``run_experiment`` or a ``fedmpi run``
subprocess, then cut short, corrupted byte by byte, or left by a process that was
really killed (SIGKILL) while it wrote. Commands run as subprocesses with a timeout,
and ``watch`` called directly runs in a thread joined with one, so a hang fails the test
instead of hanging CI.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import pytest
from conftest import fedmpi
from helpers import TINY, merged, write_config
from test_analysis import cli_module, run_cli
from test_checkpoint import wait_for_rounds

from fedmpi import config as cfgmod
from fedmpi.analysis import watch as watch_mod
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.results import ResultsWriter, RunFile, liveness, repair
from fedmpi.results.schema import CLIENT_FIELDS, ROUND_FIELDS
from fedmpi.runtime import run_experiment

HOST = socket.gethostname()
FAST = 30   # seconds: every command here answers in about one; a hang is what this catches


@pytest.fixture(scope="module")
def completed(tmp_path_factory) -> Path:
    """A real 3-round TINY run, completed (run in this process: no second torch start-up)."""
    path = tmp_path_factory.mktemp("completed") / "done.h5"
    values = merged(TINY, output=str(path), system={"threads": 1})
    run_experiment(cfgmod.from_dict(values), LocalComm(), quiet=True)
    return path


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A real `fedmpi run` followed by a real `fedmpi watch`, killed with SIGKILL after a
    few rounds: (results file, the run's pid, the watcher's exit code, stdout, stderr,
    seconds from the kill to the watcher's exit)."""
    directory = tmp_path_factory.mktemp("killed")
    config = write_config(directory / "slow.toml", rounds=100000, system={"threads": 1})
    out = directory / "live.h5"
    watcher = subprocess.Popen(_cli("watch") + [str(out), "--wait", "--interval", "0.2"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = subprocess.Popen([sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_rounds(out, 5)
        run.kill()
        run.wait()         # reaped: a zombie's pid still answers kill(pid, 0)
        killed_at = time.monotonic()
        stdout, stderr = watcher.communicate(timeout=FAST)
        waited = time.monotonic() - killed_at
    finally:
        for proc in (run, watcher):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out, run.pid, watcher.returncode, stdout, stderr, waited


# ---- files cut short, corrupt bytes, a writer killed outside SWMR ---------------------

@pytest.mark.parametrize("keep", [0.05, 0.2, 0.5, 0.9])
def test_a_truncated_file_is_one_line_and_exit_2_for_every_command(completed, tmp_path, keep):
    """Before: report/plot/watch on a cut file hung for minutes (SWMR reads retry) or
    quietly reported what the first bytes held."""
    data = completed.read_bytes()
    cut = tmp_path / "cut.h5"
    cut.write_bytes(data[:int(len(data) * keep)])
    says = (f"results file {cut} is damaged (truncated to {int(len(data) * keep):,} of {len(data):,} "
            f"bytes); fedmpi run --resume {cut} says what can be recovered")
    for args in (["report", cut], ["plot", cut, "-o", tmp_path / "a.png"], ["watch", "--once", cut],
                 ["watch", cut]):
        proc = run_cli(args, timeout=FAST)
        assert proc.returncode == 2 and proc.stderr == f"fedmpi: {says}\n", (args, proc.stderr)
    assert not (tmp_path / "a.png").exists()
    with pytest.raises(UsageError) as err:   # in this process only once it cannot hang
        RunFile(cut)
    assert str(err.value) == says


def test_a_file_short_only_while_it_is_written_is_read(completed, tmp_path):
    """The re-check: a writer extending the file a moment after the first look is no damage."""
    data = completed.read_bytes()
    growing = tmp_path / "growing.h5"
    growing.write_bytes(data[:len(data) // 2])

    def finish():
        time.sleep(0.05)
        with open(growing, "ab") as f:
            f.write(data[len(data) // 2:])

    writer = threading.Thread(target=finish)
    writer.start()
    try:
        with RunFile(growing) as run:
            assert run.status == "completed" and run.rounds()["round"].tolist() == [0, 1, 2, 3]
    finally:
        writer.join()


def _corrupt(source: Path, target: Path, obj: str) -> Path:
    """A copy of ``source`` with one byte of ``obj``'s object header flipped (its checksum
    then fails): the damage a bad disk or a bad copy does."""
    with h5py.File(source, "r", swmr=repair.inspect(source).flags & 0b100 != 0) as f:
        address = h5py.h5o.get_info(f[obj].id).addr
    data = bytearray(source.read_bytes())
    assert data[address:address + 4] == b"OHDR"
    data[address + 20] ^= 0xFF
    target.write_bytes(bytes(data))
    return target


@pytest.mark.parametrize("obj", ["rounds", "rounds/train_loss"])
def test_corrupt_bytes_are_one_line_not_a_traceback_or_a_hang(completed, tmp_path, obj):
    """Before: SWMR read of a flipped header byte retried for minutes (over 60 s here)."""
    bad = _corrupt(completed, tmp_path / "corrupt.h5", obj)
    for args in (["report", bad], ["watch", "--once", bad]):
        proc = run_cli(args, timeout=FAST)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"fedmpi: results file {bad} cannot be read (")
    with RunFile(bad) as run:   # the root and its attributes are intact
        assert run.status == "completed"
        with pytest.raises(UsageError, match=f"^results file {bad} cannot be read \\(.*checksum"):
            run.rounds()


def test_a_corrupt_file_of_a_killed_run_is_read_without_swmr(killed, tmp_path):
    """A file a SWMR writer held when it was killed is opened SWMR only while the writer
    may live: a dead one's file is read plainly, so corruption fails at once there too."""
    bad = _corrupt(killed[0], tmp_path / "corrupt.h5", "rounds/train_loss")
    assert repair.inspect(bad).open_for_write   # by a dead process (in SWMR unless in a checkpoint)
    proc = run_cli(["report", bad], timeout=FAST)
    assert proc.returncode == 2 and proc.stderr.startswith(f"fedmpi: results file {bad} cannot be read (")


def _kill_inside_edit(path: Path) -> int:
    """A real writer process resumes ``path`` and is SIGKILLed in ``edit()`` (outside
    SWMR, as during a checkpoint), leaving the consistency flags set; returns its pid."""
    code = ("import os, signal, sys\n"
            "from fedmpi.results import ResultsWriter, liveness\n"
            "w = ResultsWriter.resume(sys.argv[1], 3, writer=liveness.identity())\n"
            "with w.edit() as f:\n"
            "    f.attrs['note'] = 'half-way through a checkpoint'\n"
            "    f.flush()\n"
            "    print(os.getpid(), flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                          timeout=FAST)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return int(proc.stdout)


def test_a_writer_killed_outside_swmr_leaves_a_file_that_is_still_read(completed, tmp_path):
    """Before: 'cannot be opened (... already open for write ...)', exit 2."""
    path = tmp_path / "flags.h5"
    path.write_bytes(completed.read_bytes())
    pid = _kill_inside_edit(path)
    assert repair.inspect(path).flags == 0b001
    for swmr in (True, False):
        with pytest.raises(OSError, match="open for"):
            h5py.File(path, "r", swmr=swmr)
    before = path.read_bytes()
    with RunFile(path) as run:
        assert run.status == "running" and run.attrs["writer"]["pid"] == pid
        assert run.attrs["note"] == "half-way through a checkpoint"
        assert run.rounds()["round"].tolist() == [0, 1, 2, 3] and len(run.clients()["round"]) == 15
    assert path.read_bytes() == before   # read through a view: the file is never touched
    report = run_cli(["report", path], timeout=FAST)
    assert report.returncode == 0, report.stderr
    assert f"crashed: the file says running, but its writer (pid {pid} on {HOST}) is gone" in report.stdout
    watch = run_cli(["watch", "--once", path], timeout=FAST)
    assert watch.returncode == 1, watch.stderr
    assert watch.stdout.splitlines()[-1] == (
        f"crashed after 3/3 rounds: its writer (pid {pid} on {HOST}) is gone and the file still "
        f"says running; continue with: fedmpi run --resume {path}")


def test_a_file_a_notebook_holds_open_for_writing_is_refused_and_left_alone(completed, tmp_path):
    """h5py.File(F, "a") in another process sets the flags a dead writer leaves, and the
    run's recorded writer is gone: evaluate and resume took that for a crash and put a
    "clean copy" in the file's place, under the live holder. Readers showed HDF5's lock
    error."""
    path = tmp_path / "held.h5"
    path.write_bytes(completed.read_bytes())
    holder = subprocess.Popen([sys.executable, "-c", "import sys, h5py\n"
                               "f = h5py.File(sys.argv[1], 'a'); print('open', flush=True)\n"
                               "sys.stdin.read(); f.close()", str(path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "open\n"
        assert repair.inspect(path).open_for_write and liveness.held_for_writing(path)
        inode = path.stat().st_ino
        for command in (["report", path], ["watch", "--once", path], ["evaluate", path],
                        ["run", "--resume", path]):
            proc = fedmpi(command, timeout=FAST)
            assert proc.returncode == 2 and proc.stderr == (
                f"fedmpi: results file {path} is held open for writing by another process "
                f"(an h5py.File(..., 'a') in a notebook?); close it there and run again\n"), command
            assert path.stat().st_ino == inode   # not replaced under its holder
    finally:
        holder.communicate("", timeout=FAST)
    assert not liveness.held_for_writing(path)
    report = run_cli(["report", path], timeout=FAST)
    assert report.returncode == 0 and "completed" in report.stdout, report.stderr


@pytest.mark.slow
def test_report_and_plot_skip_damaged_files_in_a_directory(completed, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    data = completed.read_bytes()
    (runs / "a-good.h5").write_bytes(data)
    (runs / "b-cut.h5").write_bytes(data[:len(data) // 3])
    _corrupt(completed, runs / "c-corrupt.h5", "rounds")
    (runs / "d-crashed.h5").write_bytes(data)
    _kill_inside_edit(runs / "d-crashed.h5")
    skipped = [f"fedmpi: skipping {runs / 'b-cut.h5'}: results file {runs / 'b-cut.h5'} is damaged",
               f"fedmpi: skipping {runs / 'c-corrupt.h5'}: results file {runs / 'c-corrupt.h5'} cannot be read"]
    for args in (["report", runs], ["report", f"{runs}/*.h5"], ["plot", runs, "-o", tmp_path / "a.png"]):
        proc = run_cli(args, timeout=FAST)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stderr.splitlines()
        assert len(lines) == 2 and all(line.startswith(s) for line, s in zip(lines, skipped)), lines
    table = run_cli(["report", runs, "--format", "markdown"], timeout=FAST).stdout
    assert "| fedavg | completed | 1 |" in table and "| fedavg | crashed | 1 |" in table  # a, d
    named = run_cli(["report", runs / "a-good.h5", runs / "b-cut.h5"], timeout=FAST)
    assert named.returncode == 2 and named.stderr.count("\n") == 1 and "b-cut.h5 is damaged" in named.stderr
    strict = run_cli(["report", runs, "--strict"], timeout=FAST)
    assert strict.returncode == 2 and strict.stderr.count("\n") == 1


# ---- `fedmpi watch` on a dead run ---------------------------------------------------

def test_watch_exits_1_within_seconds_when_the_followed_run_is_killed(killed):
    """Before: a SIGKILLed run's file says "running" for ever, and watch polled for ever."""
    out, pid, code, stdout, stderr, waited = killed
    assert code == 1, stderr
    assert waited < 10
    with RunFile(out) as run:
        assert run.status == "running" and run.attrs["writer"]["pid"] == pid
        done = int(run.rounds()["round"][-1])
    lines = [line for line in stdout.splitlines() if line != f"waiting for {out}"]
    assert lines[0] == f"watching {out}: fedavg on synthetic, 100000 rounds, running"
    # round 0 (the initial model's evaluation), then every trained round
    assert [line.split()[1] for line in lines[1:-1]] == [f"{r}/100000" for r in range(0, done + 1)]
    assert lines[-1] == (f"crashed after {done}/100000 rounds: its writer (pid {pid} on {HOST}) is "
                         f"gone and the file still says running; continue with: fedmpi run --resume {out}")
    again = run_cli(["watch", "--once", out], timeout=FAST)
    assert again.returncode == 1 and again.stdout.splitlines()[-1] == lines[-1]


def _running_file(path: Path, writer, wall: float = 2.0, rounds: int = 3) -> Path:
    """A file of a run still "running", by the real ResultsWriter, recording ``writer``
    the way the runtime does (None: recorded no writer, as before fedmpi recorded one)."""
    provenance = {"world_size": 1} if writer is None else {"world_size": 1, "writer": writer}
    config = {"algorithm": {"name": "fedavg"}, "seed": 0, "rounds": rounds}
    with ResultsWriter.create(path, config=config, provenance=provenance,
                              round_fields=list(ROUND_FIELDS), client_fields=list(CLIENT_FIELDS),
                              layout=[], partition={}) as w:
        for r in range(1, rounds + 1):
            w.append_round({"round": r, "test_acc": 0.1 * r, "train_loss": 1.0 / r, "time_wall": wall})
            w.flush()
    return path


def _exited_writer() -> dict:
    """The writer record of a real process that has exited: its pid no longer exists."""
    code = "import json; from fedmpi.results import liveness; print(json.dumps(liveness.identity()))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=FAST, check=True)
    writer = json.loads(proc.stdout)
    assert liveness.state(writer) == liveness.GONE
    return writer


@pytest.mark.parametrize("case", ["exited", "pid reused"])
def test_watch_on_a_file_whose_writer_is_gone_exits_1_at_once(tmp_path, case):
    writer = _exited_writer() if case == "exited" else {**liveness.identity(), "start": "another-boot:1"}
    path = _running_file(tmp_path / "r.h5", writer)
    started = time.monotonic()
    proc = run_cli(["watch", path, "--interval", "60"], timeout=FAST)
    assert proc.returncode == 1 and time.monotonic() - started < FAST / 2, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"watching {path}: fedavg on ?, 3 rounds, running" and len(lines) == 5
    assert lines[-1] == (f"crashed after 3/3 rounds: its writer (pid {writer['pid']} on {HOST}) is gone "
                         f"and the file still says running; continue with: fedmpi run --resume {path}")


def test_report_tables_and_sweeps_call_a_file_whose_writer_is_gone_crashed(tmp_path):
    """Before: `fedmpi report` of a SIGKILLed run said "status running", as the file
    does, and the tables grouped it with live runs; only `watch` told it was dead."""
    dead, other = _exited_writer(), {"host": "elsewhere.invalid", "pid": 4711, "start": "x:1"}
    runs = tmp_path / "runs"
    runs.mkdir()
    writers = {"dead": dead, "live": liveness.identity(), "other": other, "none": None}
    paths = {name: _running_file(runs / f"{name}.h5", writer) for name, writer in writers.items()}
    old = time.time() - 9000   # 2.5 h: shown as such for the next 3 min
    os.utime(paths["other"], (old, old))
    lines = {name: run_cli(["report", path], timeout=FAST).stdout.splitlines()[1] for name, path in paths.items()}
    assert lines["dead"].startswith(
        f"status       crashed: the file says running, but its writer (pid {dead['pid']} on {HOST}) is gone; "
        f"continue with: fedmpi run --resume {paths['dead']} (created ")
    assert lines["live"].startswith(f"status       running (pid {os.getpid()} on {HOST}) (created ")
    assert lines["other"].startswith("status       running as the file says, last changed 2.5 h ago; its writer "
                                     f"(pid 4711 on elsewhere.invalid) cannot be checked from {HOST} (created ")
    assert lines["none"].startswith("status       running as the file says, last changed ")
    assert "; it records no writer to check (created " in lines["none"]
    from fedmpi.analysis import load, runs_table
    assert {Path(row["run"]).stem: row["status"] for row in runs_table(load(runs))} == {
        "dead": "crashed", "live": "running", "other": "running", "none": "running"}
    table = run_cli(["report", runs], timeout=FAST)
    assert table.returncode == 0 and "crashed  1" in table.stdout and "running  3" in table.stdout, table.stdout
    with RunFile(paths["dead"]) as run:
        assert run.status == "running"   # the file itself is not changed
    sweep = tmp_path / "s.toml"
    sweep.write_text(f'name = "s"\nconfig = "c.toml"\noutdir = "{tmp_path}"\n[grid]\nseed = [0]\n')
    write_config(tmp_path / "c.toml", rounds=3, seed=0)
    cell = tmp_path / "s" / "seed=0.h5"
    cell.parent.mkdir()
    _running_file(cell, dead)
    listed = run_cli(["sweep", sweep], timeout=FAST, module="fedmpi")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[-1].split()[:3] == ["0", "crashed", "seed=0"], listed.stdout


@pytest.mark.parametrize("writer, who", [
    ({"host": "elsewhere.invalid", "pid": 4711, "start": "x:1"},
     f"its writer (pid 4711 on elsewhere.invalid) cannot be checked from {HOST}"),
    (None, "the file records no writer to check"),
])
def test_watch_presumes_an_unverifiable_writer_dead_after_a_long_stall(tmp_path, monkeypatch, writer, who):
    """The rule: no new round for max(30 x median round time, _STALL_MIN) seconds."""
    monkeypatch.setattr(watch_mod, "_STALL_MIN", 0.1)
    path = _running_file(tmp_path / "r.h5", writer, wall=0.02)        # 30 x 0.02 s: 0.6 s
    os.utime(path)                      # the stall is counted from the file's last change
    code, lines, seconds = _follow(path, interval=0.05)
    assert code == 1 and 0.6 - 0.3 <= seconds
    assert len(lines) == 5   # header, 3 rounds, the verdict: nothing while waiting
    assert lines[-1].startswith("presumed crashed after 3/3 rounds: no new round for ")
    assert lines[-1].endswith(f"(the limit: 30 x the median round time, at least 0 s) and {who}; "
                              f"if it is gone, continue with: fedmpi run --resume {path}")
    monkeypatch.setattr(watch_mod, "_STALL_MIN", 0.5)
    os.utime(_running_file(tmp_path / "fast.h5", writer, wall=0.001))   # 30 x 0.001 s < 0.5 s
    code, lines, seconds = _follow(tmp_path / "fast.h5", interval=0.05)
    assert code == 1 and 0.5 - 0.3 <= seconds and lines[-1].startswith("presumed crashed after 3/3")
    old = time.time() - 3600                                          # untouched for an hour
    os.utime(path, (old, old))
    code, lines, seconds = _follow(path, interval=5)
    assert code == 1 and seconds < 2 and "no new round for 60.0 min" in lines[-1]


def test_a_live_writer_is_never_presumed_dead_and_timeout_ends_the_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(watch_mod, "_STALL_MIN", 0.01)
    path = _running_file(tmp_path / "r.h5", liveness.identity(), wall=0.001)   # this process: alive
    code, lines, seconds = _follow(path, interval=0.05, timeout=0.8)
    assert code == 124 and 0.8 <= seconds
    assert lines[-1] == "timeout: no new round within 0.8 s, after 3/3 rounds (the run itself is left alone)"


@pytest.mark.slow
def test_watch_timeout_on_the_command_line(tmp_path):
    path = _running_file(tmp_path / "r.h5", liveness.identity())   # alive: this test's process
    started = time.monotonic()
    proc = run_cli(["watch", path, "--timeout", "1", "--interval", "0.2"], timeout=FAST)
    assert proc.returncode == 124 and time.monotonic() - started >= 1, proc.stderr
    assert proc.stdout.splitlines()[-1] == ("timeout: no new round within 1 s, after 3/3 rounds "
                                            "(the run itself is left alone)")
    missing = tmp_path / "queued.h5"
    proc = run_cli(["watch", missing, "--wait", "--timeout", "0.5", "--interval", "0.2"], timeout=FAST)
    assert proc.returncode == 124 and proc.stdout.splitlines() == [
        f"timeout: {missing} did not become readable within 0.5 s"]
    assert proc.stderr == f"fedmpi: waiting for {missing} to appear...\n"
    for value, says in (("0", "--timeout 0: seconds must be a finite number > 0"),
                        ("-1", "--timeout -1: seconds must be"), ("nan", "--timeout nan: seconds must be"),
                        ("inf", "--timeout inf: seconds must be"), ("1e999", "--timeout 1e999: seconds must be"),
                        ("soon", "--timeout 'soon': expected a number")):
        proc = run_cli(["watch", path, f"--timeout={value}"], timeout=FAST)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
    proc = run_cli(["watch", path, "--interval", "inf"], timeout=FAST)
    assert proc.returncode == 2 and "--interval inf: seconds must be a finite number > 0" in proc.stderr
    # a poll reads the file: --interval 1e-9 spun a core that the run it watched needed
    for value in ("1e-9", "0.09"):
        proc = run_cli(["watch", path, "--interval", value], timeout=FAST)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"--interval {value}: give at least 0.1 s" in proc.stderr


def _follow(path, **options) -> tuple[int, list[str], float]:
    """``watch(path, **options)`` in a thread joined with a timeout, so a watch that never
    ends fails the test: (exit code, lines, seconds)."""
    lines, result = [], []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: result.append(watch_mod.watch(path, echo=lines.append, **options)),
                              daemon=True)
    thread.start()
    thread.join(FAST)
    assert not thread.is_alive(), f"watch({path}) still polling after {FAST} s: {lines}"
    return result[0], lines, time.monotonic() - started


def _cli(command) -> list[str]:
    return [sys.executable, "-m", cli_module(command), command]


def test_read_errors_name_the_file_and_bugs_still_raise(completed, tmp_path):
    bad = _corrupt(completed, tmp_path / "clients.h5", "clients")
    code = ("import sys\nfrom fedmpi.results import RunFile\n"
            "with RunFile(sys.argv[1]) as run:\n    run.clients()\n")
    proc = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True,
                          timeout=FAST)   # first where a hang fails the test instead of stalling it
    assert proc.returncode == 1 and proc.stderr.splitlines()[-1].startswith(
        f"fedmpi.errors.UsageError: results file {bad} cannot be read (")
    with RunFile(bad) as run:
        assert run.rounds()["round"].tolist() == [0, 1, 2, 3]
        with pytest.raises(UsageError, match=f"^results file {bad} cannot be read"):
            run.clients()
        with pytest.raises(TypeError):
            run._columns(None)     # a bug is not a damaged file: only HDF5's read errors are
