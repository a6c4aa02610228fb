"""What a newcomer meets in the first hour: a second `fedmpi run` with other --set values
gets its own file, the data are checked before the "exists" line, every run ends with a
summary, and a notebook can start a run without a shell (``fedmpi.run``)."""

import h5py
import pytest

import fedmpi
from fedmpi import config as cfg
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime.system import load_warning

from conftest import fedmpi as cli
from helpers import TINY, merged
from test_checkpoint import assert_same_run, reference_and_crash

SMALL = ["--set", "data.dataset=synthetic", "--set", "data.num_train=300", "--set",
         "data.num_test=100", "--set", "data.size=16", "--set", "clients.num=4", "--set",
         "clients.per_round=2", "--set", "rounds=1", "--set", "model.channels=[4, 8]",
         "--set", "model.hidden=16"]


def test_the_default_name_carries_a_digest_of_the_config():
    base = cfg.resolve()
    assert str(base.output_path()) == f"runs/default-fedavg-seed0-{base.digest()}.h5"
    assert len(base.digest()) == 8 and int(base.digest(), 16) >= 0
    assert cfg.resolve().digest() == base.digest()                      # same config, same name
    assert cfg.resolve(overrides=["rounds=2"]).digest() != base.digest()
    assert cfg.resolve(overrides=["train.lr=0.2"]).digest() != \
        cfg.resolve(overrides=["train.lr=0.3"]).digest()
    # a value set to what it already is names the same file; output is not part of it
    assert cfg.resolve(overrides=[f"train.lr={base.train.lr}"]).digest() == base.digest()
    assert cfg.resolve(overrides=["output=x/{digest}.h5"]).output_path().name == f"{base.digest()}.h5"
    with pytest.raises(UsageError, match=r"allowed: \{name\} \{algorithm\} \{dataset\} \{seed\} \{digest\}"):
        cfg.resolve(overrides=["output=runs/{nam}.h5"])


def test_a_model_option_added_later_leaves_existing_names_alone():
    """model.norm joined the CNN's options after files were named: at "none" (what those
    files ran) the default config keeps the name it had before (6bce8cc9, the digest
    fedmpi gave it then), so their --resume and --force still find them; another value
    names another file."""
    base = cfg.resolve()
    assert base.model.options["norm"] == "none" and base.digest() == "6bce8cc9"
    assert cfg.resolve(overrides=['model.norm="batch"']).digest() != base.digest()


@pytest.mark.slow
def test_a_second_run_with_other_values_gets_its_own_file_and_a_summary(tmp_path):
    first = cli(["run", *SMALL], cwd=tmp_path)
    second = cli(["run", *SMALL, "--set", "train.lr=0.2"], cwd=tmp_path)
    assert first.returncode == 0 and second.returncode == 0, second.stderr
    files = sorted((tmp_path / "runs").glob("default-fedavg-seed0-*.h5"))
    assert len(files) == 2
    for proc in (first, second):
        tail = proc.stdout.splitlines()[-3:]
        assert tail[0].startswith("completed: 1/1 rounds, final test_acc ") and "(best " in tail[0]
        assert tail[1].startswith("FL traffic: ") and " down, " in tail[1] and " up" in tail[1]
        assert tail[2].startswith("results: runs/default-fedavg-seed0-")
    with RunFile(files[0]) as run:   # the traffic printed is the file's
        total = int(run.rounds()["fl_bytes_down"].sum() + run.rounds()["fl_bytes_up"].sum())
    printed = [p for p in (first, second) if str(files[0].name) in p.stdout][0]
    assert f"({total} bytes)" in printed.stdout
    again = cli(["run", *SMALL], cwd=tmp_path)   # the same config: the same file, refused
    assert again.returncode == 2 and "exists; pass --force" in again.stderr


def test_a_missing_dataset_is_said_before_an_existing_file(tmp_path):
    out = tmp_path / "r.h5"
    out.write_bytes(b"")   # there, but the dataset's problem comes first
    proc = cli(["run", "--set", "data.dataset=cifar10", "-o", out])
    assert proc.returncode == 2
    assert proc.stderr == ("fedmpi: dataset 'cifar10' needs data_dir = the cifar-10-batches-py/ "
                           "folder or its parent (none given)\n")


def test_the_load_warning_says_runs_take_longer():
    import os
    real = os.getloadavg
    try:
        os.getloadavg = lambda: (9.0, 9.0, 9.0)
        assert "several times longer than on an idle machine" in load_warning(1, 2)
    finally:
        os.getloadavg = real


def _values(tmp_path, **sections):
    return merged(TINY, rounds=2, output=str(tmp_path / "r.h5"), **sections)


def test_fedmpi_run_from_python_returns_the_file(tmp_path):
    values = _values(tmp_path)
    path = fedmpi.run(values)
    assert path == tmp_path / "r.h5"
    with RunFile(path) as run:
        assert run.status == "completed" and run.rounds()["round"].tolist() == [0, 1, 2]
        assert run.config["train"]["lr"] == TINY["train"]["lr"]
    # overrides as a dict or as --set strings; output= names the file
    other = fedmpi.run(values, overrides={"train.lr": 0.02}, output=tmp_path / "b.h5")
    strings = fedmpi.run(values, overrides=["train.lr=0.02"], output=tmp_path / "c.h5")
    with RunFile(other) as b, RunFile(strings) as c:
        assert b.config["train"]["lr"] == 0.02
        assert_same_run(b, c)


def test_fedmpi_run_raises_what_the_command_line_prints(tmp_path):
    values = _values(tmp_path)
    (tmp_path / "r.h5").write_bytes(b"not ours")
    with pytest.raises(UsageError, match=r"^results file .*r.h5 exists and is not an HDF5 file"):
        fedmpi.run(values)
    assert (tmp_path / "r.h5").read_bytes() == b"not ours"
    with pytest.raises(UsageError, match="^config field train.lr: must be > 0, got -1"):
        fedmpi.run(values, overrides={"train.lr": -1}, output=tmp_path / "x.h5")
    with pytest.raises(UsageError, match="overrides='rounds=2': give a dict"):
        fedmpi.run(values, overrides="rounds=2")
    with pytest.raises(UsageError, match="^give a config file or --preset, not both"):
        fedmpi.run(values, preset="default")
    with pytest.raises(UsageError, match="resume= takes the config from the file"):
        fedmpi.run(values, resume=tmp_path / "r.h5")
    assert not (tmp_path / "x.h5").exists()


def test_fedmpi_run_resumes_an_interrupted_run_bitwise(tmp_path):
    ref, crashed = reference_and_crash(tmp_path)
    with h5py.File(crashed, "r+") as f:
        f.attrs["status"] = "interrupted"   # a Ctrl-C's file: no live writer to ask about
    assert fedmpi.run(resume=crashed) == crashed
    with RunFile(ref) as a, RunFile(crashed) as b:
        assert b.status == "completed"
        assert_same_run(a, b)
    assert fedmpi.run(resume=crashed) == crashed   # completed: nothing to do, nothing touched
