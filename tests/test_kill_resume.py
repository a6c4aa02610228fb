"""Killed and stopped runs, for real: signals to the single process, to mpirun, to
jobs/mpirun.sh and to one rank, at start-up, mid-round, while a checkpoint is being
written and while the model is being evaluated. Every stopped run must leave a file that
`fedmpi run --resume` (fedmpi alone: no h5clear) continues to the same bits as a run
that was never stopped (deterministic mode), on 1 rank or under mpirun."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow   # real processes and signals: seconds each

from fedmpi import config as cfgmod
from fedmpi.comm import LocalComm
from fedmpi.results import RunFile, repair
from fedmpi.runtime import EXIT_PREEMPTED, run_experiment

from conftest import ROOT, fedmpi, mpirun, mpirun_path, needs_mpi
from helpers import SSL, TINY, descendants, merged, write_config

# ~15 ms a round on one process (~40 ms on 3 ranks here): the tests stop it at round 3 or
# 10, and 50 rounds later it would end by itself
LONG = dict(rounds=60, system={"deterministic": True, "checkpoint_every": 7})
SLOW = dict(plugins=["toy_algorithms"], rounds=10, eval={"every": 1, "batch_size": 200},
            system={"deterministic": True, "checkpoint_every": 2})
TESTS = {"PYTHONPATH": str(ROOT / "tests") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def slow_config(tmp_path, marker=None, seconds=0.3):
    """FedAvg whose evaluation (one test chunk, every round) sleeps ``seconds`` whenever
    ``marker`` is missing, and creates it: remove the marker, and the next evaluation is
    slow and announces itself."""
    name = "slow.toml" if marker else "slow-ref.toml"
    return write_config(tmp_path / name, **SLOW, algorithm={
        "name": "toy_slow_eval", "marker": str(marker or ""), "seconds": seconds if marker else 0.0})


@pytest.fixture(scope="module")
def slow_reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("slowref")
    cli(["run", "-q", str(slow_config(d)), "-o", str(d / "ref.h5")])
    return d / "ref.h5"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every stopped-and-resumed run must reproduce bit for bit."""
    values = merged(TINY, **LONG)
    values["output"] = str(tmp_path_factory.mktemp("ref") / "ref.h5")
    run_experiment(cfgmod.from_dict(values), LocalComm(), quiet=True)
    return Path(values["output"])


def assert_same_run(ref: Path, out: Path) -> None:
    with RunFile(ref) as a, RunFile(out) as b:
        assert b.status == "completed", b.attrs.get("error")
        for name in ("round", "train_loss", "test_loss", "test_acc", "fl_bytes_up", "update_norm"):
            assert np.array_equal(a.rounds()[name], b.rounds()[name], equal_nan=True), name
        for name in ("round", "client", "train_loss", "update_norm"):
            assert np.array_equal(a.clients()[name], b.clients()[name], equal_nan=True), name
        assert np.array_equal(a.model(), b.model())


def launch(tmp_path, ranks=1, config=None, extra=(), **popen):
    """`fedmpi run` of LONG in a subprocess (under mpirun when ranks > 1)."""
    config = config or write_config(tmp_path / "long.toml", **LONG)
    out = tmp_path / "run.h5"
    cmd = [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o", str(out), *extra]
    if ranks > 1:
        cmd = [mpirun_path(), "-n", str(ranks), "--oversubscribe", "--bind-to", "none"] + cmd
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **TESTS), **popen)
    return proc, out


def rounds_in(path) -> int:
    """Rounds done: the last row's round (round 0, the initial model, is not one)."""
    try:
        with RunFile(path) as run:
            done = run.rounds()["round"]
            return int(done[-1]) if len(done) else 0
    except Exception:   # not there yet, or being created
        return 0


def wait_until(predicate, what: str, timeout: float = 120, proc=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended before {what}: {proc.returncode}\n{proc.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def resume(out: Path, ranks: int = 1) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "fedmpi", "run", "-q", "--resume", str(out)]
    if ranks > 1:
        return mpirun(ranks, args, env=TESTS)
    return cli(args[3:])


def cli(args) -> subprocess.CompletedProcess:
    """`fedmpi ARGS` with the test plug-ins importable; fails the test unless it exits 0."""
    proc = fedmpi(args, env=TESTS)
    assert proc.returncode == 0, f"fedmpi {' '.join(args)} -> {proc.returncode}\n{proc.stderr}"
    return proc


def status(path):
    with RunFile(path) as run:
        return run.status, run.attrs


# ---- kill -9: nothing can be caught; the file must still resume ----------------------

@pytest.mark.parametrize("ranks", [1, pytest.param(3, marks=needs_mpi)])
def test_sigkill_mid_round_resumes_with_fedmpi_alone(tmp_path, reference, ranks):
    """The writer dies with the file open in SWMR mode: HDF5's consistency flags stay set,
    and before this fix `--resume` died with 'file is already open for write'."""
    proc, out = launch(tmp_path, ranks)
    wait_until(lambda: rounds_in(out) >= 10, "10 rounds", proc=proc)
    victim = proc.pid if ranks == 1 else _rank_pids(proc.pid)[0]   # rank 0 under mpirun
    os.kill(victim, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert repair.inspect(out).open_for_write          # what h5clear -s would have cleared
    st, attrs = status(out)
    assert st == "running"
    with RunFile(out) as run:
        done, ckpt = int(run.rounds()["round"][-1]), run.checkpoint().round
        assert done - ckpt < 7 + 1                      # checkpoint_every bounds the loss
    resume(out, ranks)
    assert_same_run(reference, out)
    assert not repair.inspect(out).open_for_write


def kill_a_worker_and_resume(tmp_path, values: dict, after: int, ranks: int) -> None:
    """``values`` run once whole (one process), then under ``mpirun -n 3`` with a worker
    killed (SIGKILL) after ``after`` rounds, then resumed on ``ranks``: the same bits."""
    config = write_config(tmp_path / "killed.toml", base=values)
    ref = tmp_path / "killed-ref.h5"
    cli(["run", "-q", str(config), "-o", str(ref)])
    proc, out = launch(tmp_path, 3, config)
    wait_until(lambda: rounds_in(out) >= after, f"{after} rounds", proc=proc)
    os.kill(_rank_pids(proc.pid)[1], signal.SIGKILL)   # a worker, mid-round
    proc.communicate(timeout=60)
    assert proc.returncode != 0 and rounds_in(out) < values["rounds"]
    resume(out, ranks)
    assert_same_run(ref, out)


@needs_mpi
@pytest.mark.parametrize("model,rounds,after", [({"name": "2nn", "hidden": [16]}, 24, 10),
                                                (TINY["model"], 12, 5)])
def test_sigkill_of_a_grouped_run_resumes_to_the_same_bits(tmp_path, model, rounds, after):
    """Client groups (system.client_group) under mpirun, killed mid-round: SCAFFOLD's
    client state and the groups of the 2NN and of the CNN (their hand-written
    gradients), resumed on 2 ranks, give the bits of a single process that was never
    stopped. (The CNN's rounds are slower: half as many leave the kill as much time.)"""
    values = merged(TINY, **LONG, algorithm={"name": "scaffold"})
    values.update(rounds=rounds, model=dict(model))
    values["system"] = {**values["system"], "client_group": 2}
    kill_a_worker_and_resume(tmp_path, values, after=after, ranks=2)


@needs_mpi
def test_sigkill_of_a_fedu2_run_resumes_to_the_same_bits(tmp_path):
    """FedU^2 under mpirun (EUA's Gram path, its transpose sent between the two workers),
    a worker killed mid-run, resumed on 4 ranks (three workers own other runs of blocks):
    the bits of a single process that was never stopped."""
    values = merged(SSL, rounds=16, algorithm={"name": "fedu2"})
    values["system"] = {**values["system"], "checkpoint_every": 3}
    kill_a_worker_and_resume(tmp_path, values, after=7, ranks=4)


def test_sigkill_while_a_checkpoint_is_written(tmp_path, reference):
    """Frozen (SIGSTOP) at a moment the writer is outside SWMR, which it is only to write a
    checkpoint here, then killed: the slot being written is torn, the current one is not."""
    proc, out = launch(tmp_path)
    wait_until(lambda: rounds_in(out) >= 3, "3 rounds", proc=proc)
    for _ in range(2000):
        sb = repair.inspect(out)
        if sb.flags == 1:                               # open for writing, not SWMR
            os.kill(proc.pid, signal.SIGSTOP)
            if repair.inspect(out).flags == 1:
                break
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.001)
    else:
        pytest.fail("never caught the writer outside SWMR")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    link = tmp_path / "latest.h5"   # resumed through a link: the file it names is repaired
    link.symlink_to(out.name)
    resumed = resume(link)
    assert f"{out.resolve()} was left open by a writer that died" in resumed.stderr
    assert_same_run(reference, out)
    assert link.is_symlink()


@pytest.mark.parametrize("ranks", [1, pytest.param(3, marks=needs_mpi)])
def test_sigkill_during_evaluation(tmp_path, slow_reference, ranks):
    marker = tmp_path / "evaluating"
    marker.touch()   # fast until the test removes it
    proc, out = launch(tmp_path, ranks, slow_config(tmp_path, marker))
    wait_until(lambda: rounds_in(out) >= 3, "3 rounds", proc=proc)
    marker.unlink()
    wait_until(marker.exists, "the next evaluation", proc=proc)
    os.kill(proc.pid if ranks == 1 else _rank_pids(proc.pid)[0], signal.SIGKILL)
    proc.communicate(timeout=60)
    assert status(out)[0] == "running"
    resume(out, ranks)
    assert_same_run(slow_reference, out)


@needs_mpi
def test_sigkill_of_one_worker_ends_the_job_and_resumes(tmp_path, reference):
    proc, out = launch(tmp_path, 3)
    wait_until(lambda: rounds_in(out) >= 10, "10 rounds", proc=proc)
    start = time.monotonic()
    os.kill(_rank_pids(proc.pid)[2], signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode != 0 and time.monotonic() - start < 30   # no hang
    resume(out, 2)
    assert_same_run(reference, out)


def test_sigkill_at_start_up_leaves_no_file_and_no_debris(tmp_path):
    config = write_config(tmp_path / "c.toml", **LONG)
    out = tmp_path / "run.h5"
    proc, _ = launch(tmp_path, config=config)
    time.sleep(0.5)   # importing torch: long before the file is created
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert not out.exists()
    cli(["run", "-q", str(config), "-o", str(out), "--set", "rounds=2"])
    assert status(out)[0] == "completed"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


# ---- signals that can be caught: checkpoint, `interrupted`, exit 75 ------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_stop_signals_to_the_single_process_checkpoint_and_exit_75(tmp_path, reference, sig):
    proc, out = launch(tmp_path)
    wait_until(lambda: rounds_in(out) >= 10, "10 rounds", proc=proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, err
    st, attrs = status(out)
    assert st == "interrupted" and attrs["interrupted_round"] == rounds_in(out)
    resume(out)
    assert_same_run(reference, out)


def test_an_ignored_hang_up_stays_ignored(tmp_path, reference):
    """Under `nohup` (SIGHUP ignored when fedmpi starts) a hang-up does not stop the run:
    it completes, exit 0, the same bits as the reference."""
    proc, out = launch(tmp_path, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    wait_until(lambda: rounds_in(out) >= 10, "10 rounds", proc=proc)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert_same_run(reference, out)


def test_second_ctrl_c_stops_at_once(tmp_path):
    marker = tmp_path / "evaluating"
    proc, out = launch(tmp_path, config=slow_config(tmp_path, marker, seconds=1.0))
    wait_until(marker.exists, "the first evaluation", proc=proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("fedmpi: stopped by a second Ctrl-C;")
    st, attrs = status(out)
    assert st == "interrupted" and "KeyboardInterrupt" in attrs["error"]


@pytest.mark.parametrize("ranks", [1, pytest.param(3, marks=needs_mpi)])
def test_signal_during_start_up_stops_before_the_first_round(tmp_path, reference, ranks):
    proc, out = launch(tmp_path, ranks)
    pids = [proc.pid] if ranks == 1 else _rank_pids(proc.pid, ranks)
    # `fedmpi run` listens from its first line; torch being mapped means it is past that
    # and still in start-up (imports, data, model: seconds before the file exists)
    wait_until(lambda: all(_loaded(pid, "libtorch") for pid in pids), "torch loading", proc=proc)
    proc.send_signal(signal.SIGUSR1)   # mpirun passes USR1 on to every rank
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "stopped during start-up, at round 0" in err
    st, attrs = status(out)
    assert st == "interrupted" and attrs["interrupted_round"] == 0
    with RunFile(out) as run:
        assert len(run.rounds()["round"]) == 0   # not even round 0: the resume evaluates it
    resume(out, ranks)
    assert_same_run(reference, out)


def test_signal_during_the_initial_evaluation_stops_after_round_zero(tmp_path, slow_reference):
    """The first evaluation (round 0, the initial model) is slow here: a signal during it
    ends the run after its row; the resume keeps that one row and trains from round 1."""
    marker = tmp_path / "evaluating"
    proc, out = launch(tmp_path, config=slow_config(tmp_path, marker, seconds=1.0))
    wait_until(marker.exists, "the initial evaluation", proc=proc)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "stopped after evaluating the initial model (round 0)" in err
    st, attrs = status(out)
    assert st == "interrupted" and attrs["interrupted_round"] == 0
    with RunFile(out) as run:
        assert run.rounds()["round"].tolist() == [0] and run.ranks()["round"].tolist() == [0]
        assert run.checkpoint() is None and len(run.clients()["round"]) == 0
    resume(out)
    assert_same_run(slow_reference, out)   # "round" included: one round 0, then 1..10


@needs_mpi
def test_sigterm_to_mpirun_mid_round_leaves_a_resumable_file(tmp_path, slow_reference):
    """OpenMPI's mpirun answers TERM by giving the ranks SIGTERM and, about 0.25 s later,
    SIGKILL: a round that needs longer (1 s here) is lost. The file keeps every flushed
    round and a checkpoint at most checkpoint_every rounds old, and resumes to the same bits."""
    marker = tmp_path / "evaluating"
    marker.touch()
    proc, out = launch(tmp_path, 3, slow_config(tmp_path, marker, seconds=1.0))
    wait_until(lambda: rounds_in(out) >= 3, "3 rounds", proc=proc)
    marker.unlink()
    wait_until(marker.exists, "an evaluation", proc=proc)   # the round ends 1 s from now
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0 and time.monotonic() - start < 10
    with RunFile(out) as run:
        assert run.status == "running"
        assert int(run.rounds()["round"][-1]) - run.checkpoint().round <= 2
    resume(out, 3)
    assert_same_run(slow_reference, out)


@needs_mpi
def test_sigterm_to_mpirun_between_short_rounds(tmp_path, reference):
    """Rounds shorter than mpirun's grace usually end in time: then the ranks checkpoint
    (interrupted); under load they may not (running). Both resume to the same bits."""
    proc, out = launch(tmp_path, 3)
    wait_until(lambda: rounds_in(out) >= 10, "10 rounds", proc=proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    with RunFile(out) as run:
        assert run.status in ("running", "interrupted")
        assert int(run.rounds()["round"][-1]) - run.checkpoint().round <= 7
    resume(out, 3)
    assert_same_run(reference, out)


@needs_mpi
@pytest.mark.parametrize("how", ["term", "ctrl-c"])
def test_mpirun_sh_turns_term_and_ctrl_c_into_a_checkpoint(tmp_path, reference, how):
    """jobs/mpirun.sh is the way to stop an mpirun job gracefully: TERM to the script, or
    Ctrl-C at its terminal (INT to its process group), becomes USR1 for mpirun."""
    config = write_config(tmp_path / "long.toml", **LONG)
    out = tmp_path / "run.h5"
    proc = subprocess.Popen([str(ROOT / "jobs/mpirun.sh"), str(config), "2", "-q", "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            env=dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}"
                                                      f"{os.environ['PATH']}", **TESTS))
    wait_until(lambda: rounds_in(out) >= 10, "10 rounds", proc=proc)
    if how == "term":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, err
    st, attrs = status(out)
    assert st == "interrupted" and attrs["interrupted_round"] == rounds_in(out)
    resume(out, 3)
    assert_same_run(reference, out)


def _loaded(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _rank_pids(mpirun_pid: int, n: int = 3) -> list[int]:
    """The ranks' pids in rank order: mpirun's children, each with its rank in its environ."""
    ranks = {}
    deadline = time.time() + 30
    while time.time() < deadline and len(ranks) < n:
        for pid in descendants(mpirun_pid):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                    ranks[int(item.split(b"=")[1])] = pid
        time.sleep(0.05)
    return [ranks[r] for r in sorted(ranks)]
