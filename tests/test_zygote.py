"""tests/zygote.py, the fork server most single-process ``fedmpi`` commands of the suite run
from: a child of it must be the command a fresh interpreter runs, bar the imports."""

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest

from fedmpi.results import RunFile

from conftest import _zygote, fedmpi
from helpers import write_config

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
