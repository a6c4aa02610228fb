"""tests/zygote.py, the fork server most single-process ``fedmpi`` commands of the suite run
from: a child of it must be the command a fresh interpreter runs, bar the imports."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from fedmpi.results import RunFile

import zygote
from conftest import FRESH, _zygote, fedmpi, mpirun, mpirun_path, needs_mpi
from helpers import descendants, write_config

PROBE = """\
import atexit, json, os, sys
atexit.register(lambda: print("atexit ran", flush=True))
what = sys.argv[1]
if what == "report":
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
                      "x": os.environ.get("ZYGOTE_X"), "stdin": sys.stdin.read(),
                      "name": __name__, "hash": hash("fedmpi")}))
elif what == "exit":
    print("unflushed", end="")   # a normal ending flushes it
    sys.exit(int(sys.argv[2]))
elif what == "raise":
    raise ValueError("boom")
elif what == "signal":
    os.kill(os.getpid(), int(sys.argv[2]))
elif what == "message":
    sys.exit("a message")
elif what == "h5open":   # left open at exit: the ending must still close the file
    import h5py
    f = h5py.File(sys.argv[2], "w", libver="latest")
    f["x"] = list(range(1000))
    sys.exit(5)
elif what == "sleep":
    import time
    time.sleep(60)
"""


@pytest.fixture
def probe(tmp_path):
    """``python -m zygote_probe ...``, importable through PYTHONPATH as a user's plug-in is."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "zygote_probe.py").write_text(PROBE)
    env = {"PYTHONPATH": str(tmp_path / "lib")}

    def run(*args, fresh=False, **kw):
        return fedmpi(args, module="zygote_probe", fresh=fresh, env=dict(env, **kw.pop("env", {})),
                      **kw)
    return run


@pytest.mark.parametrize("fresh", [False, True], ids=["zygote", "fresh"])
def test_the_child_gets_the_commands_argv_cwd_path_environment_and_no_stdin(probe, tmp_path, fresh):
    proc = probe("report", "a b", cwd=tmp_path, env={"ZYGOTE_X": "1"}, fresh=fresh)
    assert proc.returncode == 0, proc.stderr
    line, atexit_line = proc.stdout.splitlines()
    report = json.loads(line)
    del report["hash"]
    assert report == {"argv": ["report", "a b"], "cwd": str(tmp_path), "path0": str(tmp_path),
                      "x": "1", "stdin": "", "name": "__main__"}
    assert atexit_line == "atexit ran"


@pytest.mark.slow
def test_endings_are_those_of_a_fresh_interpreter(probe):
    cases = [("exit", "3"), ("exit", "0"), ("raise",), ("signal", "15"), ("signal", "2"),
             ("message",)]
    for case in cases:
        forked, fresh = probe(*case), probe(*case, fresh=True)
        assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), case
        assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:], case
    assert probe("exit", "3").returncode == 3 and probe("exit", "3").stdout == "unflushedatexit ran\n"
    assert probe("signal", "15").returncode == -15
    assert probe("message").stderr == "a message\n"


def test_an_hdf5_file_left_open_is_closed_as_at_a_fresh_ending(probe, tmp_path):
    for fresh in (False, True):
        path = tmp_path / f"{fresh}.h5"
        assert probe("h5open", path, fresh=fresh).returncode == 5
        with h5py.File(path, "r") as f:   # whole and closed: the superblock says so
            assert list(f["x"][()]) == list(range(1000))


def test_a_timeout_kills_the_child_and_the_server_serves_on(probe):
    with pytest.raises(subprocess.TimeoutExpired):
        probe("sleep", timeout=1)
    assert probe("exit", "4").returncode == 4


def test_a_start_up_variable_gets_a_fresh_interpreter(probe):
    """PYTHONHASHSEED, read as an interpreter starts: the server's children cannot honour
    it, so the command runs fresh (and hashes as a fresh interpreter with it does)."""
    expected = subprocess.run([sys.executable, "-c", "print(hash('fedmpi'))"], text=True,
                              capture_output=True, env={"PYTHONHASHSEED": "123"}).stdout
    proc = probe("report", env={"PYTHONHASHSEED": "123"})
    assert json.loads(proc.stdout.splitlines()[0])["hash"] == int(expected)
    assert _zygote().alive()


@pytest.mark.slow
def test_a_forked_run_writes_the_bits_a_fresh_one_writes(tmp_path):
    config = write_config(tmp_path / "c.toml", rounds=2)
    outputs = {}
    for fresh in (False, True):
        outputs[fresh] = tmp_path / f"{fresh}.h5"
        proc = fedmpi(["run", "-q", config, "-o", outputs[fresh]], fresh=fresh, check=True)
        assert proc.stdout == "" and proc.stderr == ""
    with RunFile(outputs[False]) as a, RunFile(outputs[True]) as b:
        assert np.array_equal(a.model(), b.model())
        for name in ("test_acc", "test_loss", "train_loss", "fl_bytes_down", "fl_bytes_up", "update_norm"):
            assert np.array_equal(a.rounds()[name], b.rounds()[name], equal_nan=True), name
    # a bad config: the same one line and exit code either way
    bad = [fedmpi(["run", tmp_path / "missing.toml"], fresh=fresh) for fresh in (False, True)]
    assert bad[0].returncode == bad[1].returncode == 2 and bad[0].stderr == bad[1].stderr
    assert sys.executable in bad[0].args


# ---- mpirun's ranks, forked from the rank zygote (conftest.mpirun) -----------------------

RANK_PROBE = """\
import json, os, signal, sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
total = comm.allreduce(comm.Get_rank() + 1)
parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
what = sys.argv[1]
if what == "report":
    print(json.dumps({"rank": comm.Get_rank(), "size": comm.Get_size(), "total": total,
                      "forked": "zygote.py --ranks" in parent, "argv": sys.argv[1:],
                      "cwd": os.getcwd(), "x": os.environ.get("ZYGOTE_X")}), flush=True)
    print(f"rank {comm.Get_rank()} to stderr", file=sys.stderr, flush=True)
elif what == "exit":
    sys.exit(int(sys.argv[2]) if comm.Get_rank() == 1 else 0)
elif what == "wait":   # for a signal; says its pid first
    def got(signum, frame):
        print(f"rank {comm.Get_rank()} got {signum}", flush=True)
        sys.exit(0)   # MPI_Finalize on the way out, as a rank must
    signal.signal(signal.SIGUSR1, got)
    print(json.dumps({"pid": os.getpid()}), flush=True)
    time.sleep(60)
"""


@pytest.fixture
def rank_probe(tmp_path):
    script = tmp_path / "rank_probe.py"
    script.write_text(RANK_PROBE)
    return script


def _reports(stdout: str) -> list:
    return sorted((json.loads(line) for line in stdout.splitlines() if line.startswith("{")),
                  key=lambda r: r.get("rank", 0))


@pytest.mark.slow
@needs_mpi
@pytest.mark.skipif(FRESH, reason="FEDMPI_TESTS_FRESH=1: no rank is forked")
def test_forked_ranks_are_the_ranks_a_fresh_mpirun_starts(rank_probe, tmp_path):
    """Forked or fresh, a rank gets its argv, working directory, environment, MPI world
    and descriptors; a variable read at start-up (OMP_NUM_THREADS) gets fresh ranks."""
    runs = {how: mpirun(3, [sys.executable, str(rank_probe), "report", "a b"], fresh=how == "fresh",
                        env={"ZYGOTE_X": "1"})
            for how in ("forked", "fresh")}
    forked, fresh = (_reports(runs[how].stdout) for how in ("forked", "fresh"))
    assert [r.pop("forked") for r in forked] == [True] * 3   # the server's children
    assert [r.pop("forked") for r in fresh] == [False] * 3   # prted's
    assert forked == fresh == [{"rank": r, "size": 3, "total": 6, "argv": ["report", "a b"],
                                "cwd": os.getcwd(), "x": "1"} for r in range(3)]
    assert sorted(runs["forked"].stderr.split("\n")) == sorted(runs["fresh"].stderr.split("\n"))
    started = mpirun(2, [sys.executable, str(rank_probe), "report"], env={"OMP_NUM_THREADS": "1"})
    assert [r["forked"] for r in _reports(started.stdout)] == [False, False]


@pytest.mark.slow
@needs_mpi
def test_a_forked_ranks_exit_status_is_mpiruns(rank_probe):
    forked, fresh = (mpirun(2, [sys.executable, str(rank_probe), "exit", "3"], check=False,
                            fresh=how) for how in (False, True))
    assert forked.returncode == fresh.returncode == 3


@pytest.mark.slow
@needs_mpi
def test_forked_mpi_runs_write_the_bits_fresh_ones_write(tmp_path):
    config = write_config(tmp_path / "c.toml", rounds=2)
    outputs = {fresh: tmp_path / f"{fresh}.h5" for fresh in (False, True)}
    for fresh, out in outputs.items():
        mpirun(3, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o", str(out)], fresh=fresh)
    with RunFile(outputs[False]) as a, RunFile(outputs[True]) as b:
        assert a.attrs["world_size"] == b.attrs["world_size"] == 3
        assert np.array_equal(a.model(), b.model())
        for name in ("test_acc", "train_loss", "fl_bytes_up", "update_norm"):
            assert np.array_equal(a.rounds()[name], b.rounds()[name], equal_nan=True), name


@pytest.mark.slow
@needs_mpi
def test_a_signal_to_the_stub_reaches_the_rank_and_a_killed_stub_takes_it_along(rank_probe):
    """mpirun signals the processes it started, the stubs: one they can catch is passed on
    to the forked rank; SIGKILL, which a stub cannot pass on, ends the rank all the same."""
    from conftest import _rank_zygote

    server = _rank_zygote()
    if server is None:
        pytest.skip("the rank zygote cannot start here (see the warning)")
    env = dict(os.environ, **{zygote.RANK_SOCKET: server.path})
    cmd = [mpirun_path(), "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
           zygote.RANK_STUB, str(rank_probe), "wait"]
    for signum in (signal.SIGUSR1, signal.SIGKILL):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        ranks = [json.loads(proc.stdout.readline())["pid"] for _ in range(2)]
        stubs = [pid for pid in descendants(proc.pid) if zygote.RANK_STUB.encode() in _cmdline(pid)]
        assert len(stubs) == 2 and not set(stubs) & set(ranks)
        for stub in stubs:
            os.kill(stub, signum)
        out, _ = proc.communicate(timeout=60)
        deadline = time.time() + 10
        while time.time() < deadline and any(_alive(pid) for pid in ranks):
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in ranks), signum
        if signum == signal.SIGUSR1:
            assert proc.returncode == 0 and sorted(out.splitlines()) == ["rank 0 got 10", "rank 1 got 10"]
        else:
            assert proc.returncode != 0
    assert server.alive()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    """Running, not a zombie (a killed rank waits for the server to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@needs_mpi
def test_the_rank_server_serves_on_after_requests_that_are_not_whole(rank_probe):
    """A stub that dies mid-request (or anything else on its socket) costs no rank."""
    import socket

    from conftest import _rank_zygote

    server = _rank_zygote()
    if server is None:
        pytest.skip("the rank zygote cannot start here (see the warning)")
    for payload in (None, b"", b"not json", b'{"argv": ["x"]}'):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(server.path)
            if payload is not None:
                sock.send(payload)
                sock.recv(4096)   # an answer, or the end of the connection
    assert server.alive()
    report = _reports(mpirun(2, [sys.executable, str(rank_probe), "report"]).stdout)
    assert [r["forked"] for r in report] == ([False, False] if FRESH else [True, True])
