"""[tracking]: every /rounds row mirrored to TensorBoard event files and an MLflow run,
read back with their own readers (TensorBoard's EventAccumulator, MlflowClient); a
resumed run continues its MLflow run; a tracker that is missing, unreachable or broken
warns in one line and the run completes; off writes nothing."""

import hashlib
import math
import os
import sys

import numpy as np
import pytest

from conftest import fedmpi, mpirun, needs_mpi
from fedmpi import config
from fedmpi.comm import LocalComm
from fedmpi.results import open_run
from fedmpi.runtime import run_experiment
from fedmpi.runtime.observers import Observer
from fedmpi.runtime.observers.preemption import interrupt
from helpers import TINY, merged, write_config

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

TRACKED = merged(TINY, rounds=4, tracking={"tensorboard": True, "mlflow": True},
                 system={"checkpoint_every": 1, "deterministic": True})


def mlflow_runs(folder, experiment="tiny"):
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    return client, client.search_runs([found.experiment_id])


def finite_columns(rows: dict) -> dict:
    return {k: v for k, v in rows.items() if k != "round" and v.dtype.kind == "f"}


def test_rows_reach_tensorboard_and_mlflow_as_the_file_has_them(tmp_path):
    path = tmp_path / "run.h5"
    run_experiment(config.from_dict({**TRACKED, "output": str(path)}), LocalComm(), quiet=True)
    with open_run(path) as run:
        rows, digest = run.rounds(), hashlib.sha256(path.read_bytes()).hexdigest()
    events = EventAccumulator(str(tmp_path / "run.tb"), size_guidance={"scalars": 0})
    events.Reload()
    client, [mlrun] = mlflow_runs(tmp_path)
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "run"
    assert mlrun.data.params["train.lr"] == "0.05" and mlrun.data.params["rounds"] == "4"
    checked = 0
    for column, values in finite_columns(rows).items():
        steps = [int(r) for r, v in zip(rows["round"], values) if math.isfinite(v)]
        expected = [float(v) for v in values if math.isfinite(v)]
        if not steps:
            continue
        scalars = events.Scalars(f"rounds/{column}")
        assert [e.step for e in scalars] == steps, column
        assert np.array_equal(np.float32([e.value for e in scalars]), np.float32(expected)), column
        history = client.get_metric_history(mlrun.info.run_id, column)
        assert [(m.step, m.value) for m in history] == list(zip(steps, expected)), column
        checked += 1
    assert checked >= 8 and "test_acc" in rows
    [artifact] = client.list_artifacts(mlrun.info.run_id)
    copy = client.download_artifacts(mlrun.info.run_id, artifact.path, str(tmp_path / "dl"))
    assert hashlib.sha256(open(copy, "rb").read()).hexdigest() == digest   # the closed file


class StopAfter(Observer):
    """The preemption path at a chosen round, as a signal would take it."""

    def __init__(self, round_):
        self.round = round_

    def after_round(self, exp, record):
        if record.round == self.round and exp.stop is None:
            interrupt(exp, record.round, "stopped by the test")


def test_a_resumed_run_continues_its_mlflow_run(tmp_path):
    path = tmp_path / "run.h5"
    cfg = config.from_dict({**TRACKED, "output": str(path)})
    first = run_experiment(cfg, LocalComm(), quiet=True, observers=[StopAfter(2)])
    assert first.preempted
    client, [mlrun] = mlflow_runs(tmp_path)
    assert mlrun.info.status == "KILLED"
    run_experiment(cfg, LocalComm(), quiet=True, resume=True)
    client, runs = mlflow_runs(tmp_path)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "test_acc")
    with open_run(path) as run:
        rows = run.rounds()
    assert sorted({m.step for m in history}) == [int(r) for r in rows["round"]]
    last = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
    assert [last[int(r)] for r in rows["round"]] == [float(v) for v in rows["test_acc"]]


def test_tracking_off_writes_nothing_beside_the_file(tmp_path):
    path = tmp_path / "run.h5"
    run_experiment(config.from_dict({**TINY, "output": str(path)}), LocalComm(), quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.h5"]


def test_an_unreachable_server_warns_once_and_the_run_completes(tmp_path):
    write_config(tmp_path / "c.toml", tracking={"mlflow": True, "mlflow_uri": "http://127.0.0.1:9"})
    proc = fedmpi(["run", "c.toml", "-o", "run.h5", "-q"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "tracking" in line]
    assert len(lines) == 1 and "tracking with MLflow failed" in lines[0]
    assert "http://127.0.0.1:9: no server answers" in lines[0]
    with open_run(tmp_path / "run.h5") as run:
        assert run.status == "completed"


def test_a_missing_tracker_warns_once_and_the_others_go_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)   # import wandb -> ImportError
    path = tmp_path / "run.h5"
    values = merged(TINY, tracking={"tensorboard": True, "wandb": True})
    with _stderr(monkeypatch) as said:
        run_experiment(config.from_dict({**values, "output": str(path)}), LocalComm(), quiet=True)
    assert len(said) == 1 and "W&B failed" in said[0] and "fedmpi[wandb]" in said[0]
    assert (tmp_path / "run.tb").is_dir()
    with open_run(path) as run:
        assert run.status == "completed"


class _stderr:
    """fedmpi's warnings of the block, one string each."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.lines = monkeypatch, []

    def __enter__(self):
        import fedmpi.runtime.observers.tracking as tracking
        self.monkeypatch.setattr(tracking, "warn", self.lines.append)
        return self.lines

    def __exit__(self, *exc):
        return False


def test_bad_tracking_fields_are_refused_in_one_line(tmp_path):
    for values, says in ((
            {"tensorboard_dir": "tb"}, "tracking.tensorboard_dir: is set but tracking.tensorboard is false"),
            ({"mlflow_uri": "http://x"}, "tracking.mlflow_uri: is set but no tracker is on"),
            ({"mlflow": "yes"}, "tracking.mlflow")):
        write_config(tmp_path / "c.toml", tracking=values)
        proc = fedmpi(["run", "c.toml", "-o", "run.h5"], cwd=tmp_path)
        assert proc.returncode == 2 and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert not (tmp_path / "run.h5").exists()


@pytest.mark.slow
@needs_mpi
def test_under_mpirun_rank_0_alone_tracks(tmp_path):
    write_config(tmp_path / "c.toml", **{k: v for k, v in TRACKED.items() if k in ("tracking", "rounds")})
    proc = mpirun(3, [sys.executable, "-m", "fedmpi", "run", str(tmp_path / "c.toml"), "-q",
                      "-o", str(tmp_path / "run.h5")], timeout=300)
    assert proc.returncode == 0, proc.stderr
    client, [mlrun] = mlflow_runs(tmp_path)
    assert len(os.listdir(tmp_path / "run.tb")) == 1   # one writer: rank 0's
    with open_run(tmp_path / "run.h5") as run:
        acc = run.rounds()["test_acc"]
    history = client.get_metric_history(mlrun.info.run_id, "test_acc")
    assert [m.value for m in history] == [float(v) for v in acc]


def test_wandb_offline_run_holds_the_rows(tmp_path, monkeypatch):
    """W&B's offline run, keyed by the results path, under the results folder; its
    record file holds every evaluated accuracy (W&B no longer ships a Python reader of
    its records: the JSON values are looked up in the file)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    path = tmp_path / "run.h5"
    values = merged(TINY, tracking={"wandb": True})
    run_experiment(config.from_dict({**values, "output": str(path)}), LocalComm(), quiet=True)
    run_id = hashlib.sha1(str(path.absolute()).encode()).hexdigest()[:16]
    [record] = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    data = record.read_bytes()
    with open_run(path) as run:
        acc = run.rounds()["test_acc"]
    assert b"test_acc" in data
    for value in acc[np.isfinite(acc)]:
        assert repr(float(value)).encode() in data
