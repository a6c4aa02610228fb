"""Checkpoint/resume: a resumed run ends bitwise equal (deterministic mode) to one that was
never interrupted, whether it stopped on a signal, was killed between checkpoints, or
is resumed with another number of ranks; and the file never grows per checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import torch

from fedmpi import __version__ as fedmpi_version
from fedmpi import config as cfgmod
from fedmpi.results import RunFile
from fedmpi.results import checkpoint as ckpt
from fedmpi.runtime import EXIT_PREEMPTED, run_experiment
from fedmpi.runtime.system import kernels
from fedmpi.comm import LocalComm
from fedmpi.data import load_dataset
from fedmpi.errors import UsageError

from conftest import fedmpi, mpirun, needs_mpi
from helpers import TINY, merged, write_config

METRICS = ("round", "train_loss", "test_loss", "test_acc", "fl_bytes_down", "fl_bytes_up",
           "update_norm")


def assert_same_run(a: RunFile, b: RunFile):
    for name in METRICS:
        assert np.array_equal(a.rounds()[name], b.rounds()[name], equal_nan=True), name
    for name in ("round", "client", "train_loss", "update_norm", "n_samples"):
        assert np.array_equal(a.clients()[name], b.clients()[name], equal_nan=True), name
    assert np.array_equal(a.model(), b.model())


def reference_and_crash(tmp_path, **sections):
    """A completed deterministic run, and a copy edited to look like it died after its
    last round was flushed (status running): resume must redo the rounds after the last
    checkpoint and reproduce them."""
    values = merged(TINY, rounds=5, system={"deterministic": True, "checkpoint_every": 2},
                    **sections)
    values["output"] = str(tmp_path / "ref.h5")
    run_experiment(cfgmod.from_dict(values), LocalComm(), quiet=True)
    crashed = tmp_path / "crashed.h5"
    crashed.write_bytes((tmp_path / "ref.h5").read_bytes())
    with h5py.File(crashed, "r+") as f:
        f.attrs["status"] = "running"
        del f["model/final"]
        assert f["checkpoint"].attrs["round"] == 4
    return tmp_path / "ref.h5", crashed


STATEFUL = {
    "fedavg": {},
    "scaffold": {},                                   # client control variates + server c
    "feddyn": {},                                     # client gradients + server h
    "moon": {"model": {"proj_dim": 8}},               # previous local models
    "fedacg": {},                                     # server momentum
    "fedmim": {},                                     # history of global models
    "fedadam": {},                                    # server Adam moments
    "fnrfl": {"data": {"public_size": 60}},           # two phases, selected clients
}


@pytest.mark.parametrize("name", sorted(STATEFUL))
def test_resume_after_a_crash_is_bitwise_the_uninterrupted_run(tmp_path, name):
    extra = STATEFUL[name]
    ref, crashed = reference_and_crash(tmp_path, algorithm={"name": name}, **extra)
    values = cfgmod.from_dict({**RunFile(crashed).config, "output": str(crashed)})
    exp = run_experiment(values, LocalComm(), quiet=True, resume=True)
    assert not exp.preempted and exp.start == 4
    with RunFile(ref) as a, RunFile(crashed) as b:
        # round 0 (the initial model) is kept from before the crash, not evaluated again
        assert b.status == "completed" and b.rounds()["round"].tolist() == [0, 1, 2, 3, 4, 5]
        assert b.ranks()["round"].tolist() == [0, 1, 2, 3, 4, 5]
        assert_same_run(a, b)
        assert [r["round"] for r in b.attrs["resumes"]] == [4]


def test_crash_before_the_first_checkpoint_keeps_the_one_round_zero(tmp_path):
    """Died with no checkpoint written: the resume starts from round 0, keeps the initial
    model's row, redoes rounds 1-5, and ends as the run that never stopped."""
    ref, crashed = reference_and_crash(tmp_path)
    with h5py.File(crashed, "r+") as f:
        del f["checkpoint"]
    values = cfgmod.from_dict({**RunFile(crashed).config, "output": str(crashed)})
    exp = run_experiment(values, LocalComm(), quiet=True, resume=True)
    assert exp.start == 0 and not exp.at_start
    with RunFile(ref) as a, RunFile(crashed) as b:
        assert b.status == "completed" and b.rounds()["round"].tolist() == [0, 1, 2, 3, 4, 5]
        assert b.ranks()["round"].tolist() == [0, 1, 2, 3, 4, 5]
        assert_same_run(a, b)


def test_a_resume_under_another_torch_says_so_and_records_its_versions(tmp_path, capsys):
    ref, crashed = reference_and_crash(tmp_path)
    with h5py.File(crashed, "r+") as f:
        f.attrs["torch_version"] = "1.13.0"
    values = cfgmod.from_dict({**RunFile(crashed).config, "output": str(crashed)})
    run_experiment(values, LocalComm(), quiet=True, resume=True)
    assert capsys.readouterr().err == (
        f"fedmpi: {crashed} was run under torch 1.13.0 and resumes under torch "
        f"{torch.__version__}: rounds after 4 may differ in their last bits from a run that "
        f"never stopped\n")
    with RunFile(crashed) as run:
        assert run.attrs["resumes"][-1]["torch_version"] == torch.__version__
        assert run.attrs["resumes"][-1]["fedmpi_version"] == fedmpi_version


def test_a_resume_on_other_kernels_says_so(tmp_path, capsys):
    """Another CPU generation (AVX2 against AVX-512) or GPU model computes other last bits
    with the same software: a job requeued onto another partition's nodes says so."""
    ref, crashed = reference_and_crash(tmp_path)
    with h5py.File(crashed, "r+") as f:
        ranks = json.loads(f.attrs["ranks"])
        assert [r["kernels"] for r in ranks] == [kernels(torch.device("cpu"))]
        f.attrs["ranks"] = json.dumps([{**r, "kernels": "cpu AVX2-elsewhere"} for r in ranks])
        f.attrs["torch_version"] = "1.13.0"
    values = cfgmod.from_dict({**RunFile(crashed).config, "output": str(crashed)})
    run_experiment(values, LocalComm(), quiet=True, resume=True)
    assert capsys.readouterr().err == (
        f"fedmpi: {crashed} was run under torch 1.13.0 with cpu AVX2-elsewhere kernels and "
        f"resumes under torch {torch.__version__} with {kernels(torch.device('cpu'))} kernels: "
        f"rounds after 4 may differ in their last bits from a run that never stopped\n")
    with RunFile(crashed) as run:   # the resume's own, for the next one to compare with
        assert run.attrs["resumes"][-1]["ranks"][0]["kernels"] == kernels(torch.device("cpu"))
    # a second stop and resume on these kernels: nothing to say
    with h5py.File(crashed, "r+") as f:
        f.attrs["status"] = "running"
        del f["model/final"]
    run_experiment(values, LocalComm(), quiet=True, resume=True)
    assert capsys.readouterr().err == ""
    # a file from before the kernels were recorded: nothing to compare with, nothing said
    old = tmp_path / "old.h5"
    old.write_bytes(crashed.read_bytes())
    with h5py.File(old, "r+") as f:
        f.attrs["status"] = "running"
        del f["model/final"]
        f.attrs["ranks"] = json.dumps([{k: v for k, v in r.items() if k != "kernels"} for r in ranks])
        f.attrs["resumes"], f.attrs["torch_version"] = "[]", str(torch.__version__)
    run_experiment(cfgmod.from_dict({**values.to_dict(), "output": str(old)}), LocalComm(),
                   quiet=True, resume=True)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("recorded, says", [("another", True), ("isa only", False)])
def test_a_resume_on_another_cpu_model_of_the_same_instruction_set_says_so(
        tmp_path, capsys, recorded, says):
    """Two AVX-512 CPUs of other models (an EPYC, a Xeon with AMX) compute other last bits
    with the same software, though torch dispatches both on AVX512: the model is part of the
    kernels. A file from before the model was recorded ("cpu AVX512") can only be compared
    by its instruction set: the same one resumes without a word."""
    ref, crashed = reference_and_crash(tmp_path)
    here = kernels(torch.device("cpu"))
    isa = here.split(" on ")[0]
    was = f"{isa} on Another CPU(R) 9000" if recorded == "another" else isa
    with h5py.File(crashed, "r+") as f:
        f.attrs["ranks"] = json.dumps([{**r, "kernels": was} for r in json.loads(f.attrs["ranks"])])
    values = cfgmod.from_dict({**RunFile(crashed).config, "output": str(crashed)})
    run_experiment(values, LocalComm(), quiet=True, resume=True)
    assert capsys.readouterr().err == (
        f"fedmpi: {crashed} was run under {was} kernels and resumes under {here} kernels: "
        f"rounds after 4 may differ in their last bits from a run that never stopped\n"
        if says else "")
    with RunFile(crashed) as run:
        assert run.status == "completed"
        assert run.attrs["resumes"][-1]["ranks"][0]["kernels"] == here


def flip_byte(path, dataset: str, at: int = 5) -> None:
    """A bit rot, or a write that never reached the disk: one byte of a dataset's data
    changed in the file itself, past HDF5 (which keeps no checksum of raw data)."""
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as raw:
        raw.seek(offset + at)
        byte = raw.read(1)
        raw.seek(offset + at)
        raw.write(bytes([byte[0] ^ 0x10]))


def test_a_damaged_checkpoint_falls_back_to_the_other_slot_then_to_round_0(tmp_path, capsys):
    """The newest slot's bytes changed: the resume takes the slot before it (round 2) and
    still ends bitwise the run that never stopped; with both damaged, round 0."""
    ref, crashed = reference_and_crash(tmp_path, algorithm={"name": "scaffold"})
    pristine = crashed.read_bytes()
    with h5py.File(crashed, "r") as f:
        current = int(f["checkpoint"].attrs["current"])
    flip_byte(crashed, f"checkpoint/slot{current}/server/x")
    values = cfgmod.from_dict({**RunFile(crashed).config, "output": str(crashed)})
    assert run_experiment(values, LocalComm(), quiet=True, resume=True).start == 2
    assert capsys.readouterr().err == (
        f"fedmpi: {crashed}: the checkpoint after round 4 is damaged (its CRC-32 does not "
        f"match what was written); resuming from the one after round 2\n")
    with RunFile(ref) as a, RunFile(crashed) as b:
        assert b.status == "completed" and b.rounds()["round"].tolist() == [0, 1, 2, 3, 4, 5]
        assert_same_run(a, b)
    with h5py.File(crashed, "r") as f:   # the next checkpoint went over the damaged slot
        assert [ckpt._check(f[f"checkpoint/slot{k}"])[1] for k in (0, 1)] == [None, None]

    crashed.write_bytes(pristine)   # now a client's state in the older slot as well
    flip_byte(crashed, f"checkpoint/slot{current}/server/x")
    with h5py.File(crashed, "r+") as f:
        f[f"checkpoint/slot{1 - current}/clients/c_i"][0, 0] += 1.0
    assert run_experiment(values, LocalComm(), quiet=True, resume=True).start == 0
    assert capsys.readouterr().err.endswith("the checkpoint after round 2 is damaged (its "
                                            "CRC-32 does not match what was written); "
                                            "resuming from round 0\n")
    with RunFile(ref) as a, RunFile(crashed) as b:
        assert b.rounds()["round"].tolist() == [0, 1, 2, 3, 4, 5]
        assert_same_run(a, b)


def test_a_slot_without_a_digest_is_read_as_before(tmp_path):
    """Files written before the digest: nothing to check against."""
    server = {"x": np.arange(4, dtype=np.float32)}
    with h5py.File(tmp_path / "c.h5", "w") as f:
        ckpt.write(f, 3, server, [(7, {"s": np.ones(2, np.float32)})], {"s": 2}, 10)
        del f["checkpoint/slot0"].attrs["crc32"]
        f["checkpoint/slot0/server/x"][0] = 9.0
        got = ckpt.read(f)
        assert got.round == 3 and got.skipped == [] and got.server["x"][0] == 9.0


def test_checkpoint_slots_alternate_and_the_file_does_not_grow(tmp_path):
    path = tmp_path / "c.h5"
    with h5py.File(path, "w") as f:
        f.create_group("rounds")
    sizes, rng = {"c": 50_000}, np.random.default_rng(0)
    grown = []
    for k in range(1, 9):
        states = [(c, {"c": rng.random(50_000, dtype=np.float32)}) for c in (3, 7, 11)[: 1 + k % 3]]
        with h5py.File(path, "r+") as f:
            ckpt.write(f, k, {"x": np.full(50_000, k, np.float32), "t": np.int64(k)}, iter(states),
                       sizes, num_clients=20)
        grown.append(path.stat().st_size)
        with h5py.File(path, "r") as f:
            got = ckpt.read(f)
            assert got.round == k and f["checkpoint"].attrs["current"] == (k + 1) % 2
            assert np.all(got.server["x"] == k) and got.server["t"] == k
            back = list(got.states())
            assert [c for c, _ in back] == [c for c, _ in states]
            assert all(np.array_equal(s["c"], t["c"]) for (_, s), (_, t) in zip(back, states))
    # both slots have held 3 clients by k = 5: from then on everything is reused in place
    assert grown[-1] <= grown[4] * 1.01 and grown[-1] < 2.2 * 4 * 200_000 * 2


@pytest.mark.slow
def test_signal_checkpoints_exits_75_and_resume_completes(tmp_path):
    """A real SIGUSR1 to a real `fedmpi run`: the SLURM preemption path on one process."""
    config = write_config(tmp_path / "c.toml", rounds=40, system={"deterministic": True,
                                                                  "checkpoint_every": 0})
    out = tmp_path / "sig.h5"
    proc = subprocess.Popen([sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o", str(out)],
                            stderr=subprocess.PIPE, text=True)
    wait_for_rounds(out, 2)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "resume with: fedmpi run --resume" in err
    with RunFile(out) as run:
        stopped = run.attrs["interrupted_round"]
        assert run.status == "interrupted" and run.checkpoint().round == stopped < 40
        assert run.rounds()["round"].tolist() == list(range(stopped + 1))   # and round 0
    resumed = fedmpi(["run", "-q", "--resume", str(out)], check=True)
    assert resumed.returncode == 0
    fedmpi(["run", "-q", str(config), "-o", str(tmp_path / "ref.h5")], check=True)
    with RunFile(tmp_path / "ref.h5") as a, RunFile(out) as b:
        assert b.status == "completed"
        assert_same_run(a, b)
    again = fedmpi(["run", "--resume", str(out)])
    assert again.returncode == 0 and "already completed" in again.stdout


@pytest.mark.slow
def test_resume_refuses_other_arguments_and_missing_files(tmp_path):
    config = write_config(tmp_path / "c.toml", rounds=1)
    bad = fedmpi(["run", str(config), "--resume", str(tmp_path / "x.h5")])
    assert bad.returncode == 2 and "--resume FILE takes the config from FILE" in bad.stderr
    missing = fedmpi(["run", "--resume", str(tmp_path / "nothing.h5")])
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    run_experiment(cfgmod.from_dict(merged(TINY, rounds=1, output=str(tmp_path / "a.h5"))),
                   LocalComm(), quiet=True)
    exists = fedmpi(["run", str(config), "-o", str(tmp_path / "a.h5")])
    assert exists.returncode == 2 and "--resume" in exists.stderr


def ours(cfg) -> str:
    return load_dataset(cfg.data.dataset, cfg.data.data_dir, seed=cfg.seed,
                        **cfg.data.options).sha256()


def test_resume_refuses_data_that_changed_since_the_run(tmp_path):
    """The file records the data's SHA-256. Features changed with the labels kept (the
    partition alone would not tell): the resume is one line, exit 2, the file untouched.
    The run's own data resume it; a file from before the digest has nothing to compare."""
    rng = np.random.default_rng(0)
    arrays = {"x_train": rng.normal(size=(300, 6)).astype(np.float32),
              "y_train": rng.integers(0, 3, 300), "x_test": rng.normal(size=(60, 6)).astype(np.float32),
              "y_test": rng.integers(0, 3, 60)}
    data = tmp_path / "d.npz"
    np.savez(data, **arrays)
    values = merged(TINY, rounds=4, system={"checkpoint_every": 2})
    values.update(data={"dataset": "arrays", "path": str(data)},
                  model={"name": "mlp", "hidden": [8]}, output=str(tmp_path / "ref.h5"))
    run_experiment(cfgmod.from_dict(values), LocalComm(), quiet=True)
    crashed, old = tmp_path / "crashed.h5", tmp_path / "old.h5"
    crashed.write_bytes((tmp_path / "ref.h5").read_bytes())
    with h5py.File(crashed, "r+") as f:
        f.attrs["status"] = "running"
        del f["model/final"]
        recorded = f.attrs["dataset_sha256"]
    old.write_bytes(crashed.read_bytes())
    with h5py.File(old, "r+") as f:
        del f.attrs["dataset_sha256"]

    np.savez(data, **{**arrays, "x_train": arrays["x_train"] * 2})
    before = crashed.read_bytes()
    resume = cfgmod.from_dict({**RunFile(crashed).config, "output": str(crashed)})
    with pytest.raises(UsageError) as bad:   # fedmpi run --resume: this line, exit 2
        run_experiment(resume, LocalComm(), quiet=True, resume=True)
    assert str(bad.value) == (f"--resume {crashed}: the 'arrays' data differ from the run's "
                              f"(sha256 {recorded[:12]}..., now {ours(resume)[:12]}...; "
                              f"was data.path = {data} changed?)")
    assert crashed.read_bytes() == before and not list(tmp_path.glob(".crashed*"))
    older = cfgmod.from_dict({**RunFile(old).config, "output": str(old)})
    assert run_experiment(older, LocalComm(), quiet=True, resume=True).start == 2

    np.savez(data, **arrays)
    assert run_experiment(resume, LocalComm(), quiet=True, resume=True).start == 2
    with RunFile(tmp_path / "ref.h5") as a, RunFile(crashed) as b:
        assert_same_run(a, b)
        assert b.status == "completed" and b.attrs["dataset_sha256"] == recorded


@pytest.mark.slow
@needs_mpi
def test_mpirun_preemption_and_resume_on_another_rank_count(tmp_path):
    """SIGUSR1 to mpirun reaches every rank; the run resumes on 3 ranks after 2, and the
    result is bitwise the single-process one."""
    config = write_config(tmp_path / "c.toml", rounds=40, system={"deterministic": True,
                                                                  "checkpoint_every": 0})
    out = tmp_path / "mpi.h5"
    from conftest import mpirun_path
    cmd = [mpirun_path(), "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
           "-m", "fedmpi", "run", "-q", str(config), "-o", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ))
    wait_for_rounds(out, 2)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    mpirun(3, [sys.executable, "-m", "fedmpi", "run", "-q", "--resume", str(out)])
    fedmpi(["run", "-q", str(config), "-o", str(tmp_path / "ref.h5")], check=True)
    with RunFile(tmp_path / "ref.h5") as a, RunFile(out) as b:
        assert b.status == "completed" and b.attrs["resumes"][0]["world_size"] == 3
        assert_same_run(a, b)


def wait_for_rounds(path, n, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with RunFile(path) as run:
                if len(run.rounds()["round"]) >= n:
                    return
        except Exception:  # not created yet, or mid-creation
            pass
        time.sleep(0.05)
    raise AssertionError(f"{path} never reached {n} rounds")


def test_checkpoint_growth_counts_only_what_the_next_slot_lacks(tmp_path):
    """What the storage guard reserves for a checkpoint: both slots filled in place, the
    next one adds nothing until a client without a row gets a state."""
    server = {"x": np.zeros(10, np.float32)}            # 40 bytes
    states = lambda ids: [(c, {"s": np.ones(3, np.float32)}) for c in ids]  # noqa: E731
    with h5py.File(tmp_path / "c.h5", "w") as f:
        assert ckpt.growth(f, 40, 2, 12) == 40 + 2 * 12
        ckpt.write(f, 1, server, states([1, 2]), {"s": 3}, 10)   # slot 0
        assert ckpt.growth(f, 40, 2, 12) == 40 + 2 * 12          # slot 1 still empty
        ckpt.write(f, 2, server, states([1, 2]), {"s": 3}, 10)   # slot 1
        assert ckpt.growth(f, 40, 2, 12) == 0                    # slot 0 holds both
        assert ckpt.growth(f, 40, 5, 12) == 3 * 12
        f.flush()
        before = os.path.getsize(tmp_path / "c.h5")
        for t in range(3, 9):
            ckpt.write(f, t, server, states([1, 2]), {"s": 3}, 10)
        f.flush()
        assert os.path.getsize(tmp_path / "c.h5") == before      # in place: no growth
