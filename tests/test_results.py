"""Results file: real HDF5 files written, reopened, followed live, and left by a crash."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

from fedmpi.errors import UsageError
from fedmpi.results import SCHEMA_VERSION, ResultsWriter, RunFile, open_run
from fedmpi.results.schema import CLIENT_FIELDS, ROUND_FIELDS
from fedmpi.runtime.records import RANK_FIELDS

REPO = Path(__file__).resolve().parents[1]
GOLDEN_V1 = REPO / "tests" / "data" / "results-v1.h5"

CONFIG = {"algorithm": {"name": "fedavg", "lr": 0.1}, "data": {"dataset": "synthetic"},
          "model": {"name": "cnn"}, "rounds": 3, "clients": 2, "clients_per_round": 2}
PROVENANCE = {"git_commit": "abc123", "hostnames": ["node1", "node2"], "world_size": 3,
              "seed": 7, "torch_version": "2.3.0", "mpi_library": "Open MPI 4.1", "device": "cpu"}
LAYOUT = [("conv.weight", (2, 1, 3, 3), 0), ("conv.bias", (2,), 18), ("fc.weight", (3, 2), 20)]
N_PARAMS = 26
PARTITION = {"client_offsets": np.array([0, 3, 5]), "client_indices": np.array([4, 0, 2, 1, 3]),
             "class_counts": np.array([[2, 1], [0, 2]])}


def make_writer(path, force=False):
    return ResultsWriter.create(path, config=CONFIG, provenance=PROVENANCE,
                                round_fields=list(ROUND_FIELDS), client_fields=list(CLIENT_FIELDS),
                                layout=LAYOUT, partition=PARTITION, force=force)


def test_round_trip_values_dtypes_and_nan_fill(tmp_path):
    path = tmp_path / "run.h5"
    with make_writer(path) as writer:
        writer.append_round({"round": 1, "test_acc": 0.25, "fl_bytes_down": 1e6})
        writer.append_round({"round": 2, "train_loss": 1.5})
        writer.append_clients({"round": np.array([1, 1, 2]), "client": np.array([0, 1, 0]),
                               "train_loss": np.array([0.5, 0.25, 0.125])})
    with open_run(path) as run:
        rounds, clients = run.rounds(), run.clients()
        assert list(rounds) == list(ROUND_FIELDS)
        assert rounds["round"].tolist() == [1, 2] and rounds["round"].dtype == np.int64
        np.testing.assert_array_equal(rounds["test_acc"], [0.25, np.nan])
        assert rounds["train_loss"].dtype == np.float64 and rounds["train_loss"][1] == 1.5
        assert clients["client"].tolist() == [0, 1, 0]
        assert clients["rank"].tolist() == [-1, -1, -1]  # int columns fill with -1
        assert np.isnan(clients["seconds"]).all()


def test_root_attrs_hold_config_and_provenance(tmp_path):
    path = tmp_path / "run.h5"
    make_writer(path).close()
    with open_run(path) as run:
        attrs = run.attrs
        assert run.config == CONFIG and run.status == "running"
        assert attrs["schema_version"] == SCHEMA_VERSION and attrs["hostnames"] == ["node1", "node2"]
        assert attrs["world_size"] == 3 and attrs["created"].endswith("+00:00")
    with h5py.File(path, "r") as f:
        raw = f.attrs["config"]
        assert raw == json.dumps(CONFIG, sort_keys=True)
        assert f.attrs["config_hash"] == hashlib.sha256(raw.encode()).hexdigest()[:16]
        assert all(f[g].attrs["schema_version"] == 1 for g in ("partition", "rounds", "clients", "model"))
        assert f["rounds/time_wall"].attrs["units"] == "s"
        assert f["clients/bytes_up"].attrs["units"] == "bytes"


def test_every_column_with_a_unit_says_it(tmp_path):
    """The units the schema documents, as attributes: /ranks' seconds, the virtual
    clock's columns and /eval's had none."""
    path = tmp_path / "run.h5"
    with ResultsWriter.create(path, config=CONFIG, provenance=PROVENANCE,
                              round_fields=["round", "virtual_time", "n_available", "test_acc"],
                              client_fields=["round", "client", "vt_start", "vt_end"],
                              rank_fields=RANK_FIELDS, layout=LAYOUT, partition=PARTITION) as writer:
        writer.append_eval({"round": 1, "linear_acc": 0.5, "finetune_10pct_acc": 0.4, "seconds": 2.0})
    with h5py.File(path, "r") as f:
        units = {name: f[name].attrs.get("units") for name in (
            "rounds/virtual_time", "rounds/n_available", "rounds/test_acc", "rounds/round",
            "clients/vt_start", "clients/vt_end", "ranks/seconds_compute", "ranks/seconds_idle",
            "ranks/seconds_comm", "ranks/bytes_sent", "eval/linear_acc", "eval/finetune_10pct_acc",
            "eval/seconds", "eval/round")}
    assert units == {"rounds/virtual_time": "s", "rounds/n_available": "clients", "rounds/test_acc": "fraction",
                     "rounds/round": None, "clients/vt_start": "s", "clients/vt_end": "s",
                     "ranks/seconds_compute": "s", "ranks/seconds_idle": "s", "ranks/seconds_comm": "s",
                     "ranks/bytes_sent": "bytes", "eval/linear_acc": "fraction",
                     "eval/finetune_10pct_acc": "fraction", "eval/seconds": "s", "eval/round": None}


def test_partition_round_trip(tmp_path):
    path = tmp_path / "run.h5"
    make_writer(path).close()
    with open_run(path) as run:
        part = run.partition()
    assert part["client_indices"].tolist() == [4, 0, 2, 1, 3]
    assert part["client_sizes"].tolist() == [3, 2]  # derived from the offsets
    assert all(a.dtype == np.int64 for a in part.values())


def test_refuses_to_overwrite_and_leaves_file_untouched(tmp_path):
    path = tmp_path / "run.h5"
    path.write_bytes(b"an earlier run")
    with pytest.raises(UsageError, match="exists; pass --force"):
        make_writer(path)
    assert path.read_bytes() == b"an earlier run"


def test_bad_input_with_force_destroys_nothing(tmp_path):
    path = tmp_path / "run.h5"
    path.write_bytes(b"an earlier run")
    with pytest.raises(ValueError):
        ResultsWriter.create(path, config={}, provenance={"status": "x"}, round_fields=[],
                             client_fields=[], layout=[], partition={}, force=True)
    assert path.read_bytes() == b"an earlier run"


def test_force_overwrites_and_creates_parents(tmp_path):
    path = tmp_path / "deep" / "dir" / "run.h5"
    with make_writer(path) as writer:
        writer.append_round({"round": 1})
    make_writer(path, force=True).close()
    with open_run(path) as run:
        assert len(run.rounds()["round"]) == 0


def test_status_changes_with_extra_attrs(tmp_path):
    path = tmp_path / "run.h5"
    with make_writer(path) as writer:
        writer.append_round({"round": 1})
        writer.set_status("failed", failed_round=1, error="loss is NaN")
        writer.append_round({"round": 2})  # still appendable after leaving and re-entering SWMR
        with pytest.raises(ValueError):
            writer.set_status("exploded")
    with open_run(path) as run:
        assert run.status == "failed"
        assert run.attrs["failed_round"] == 1 and run.attrs["error"] == "loss is NaN"
        assert run.rounds()["round"].tolist() == [1, 2]


def test_exception_in_with_block_marks_run_failed(tmp_path):
    path = tmp_path / "run.h5"
    with pytest.raises(RuntimeError):
        with make_writer(path):
            raise RuntimeError("worker 3 died")
    with open_run(path) as run:
        assert run.status == "failed" and "worker 3 died" in run.attrs["error"]


def test_unknown_fields_and_ragged_client_rows_are_rejected(tmp_path):
    with make_writer(tmp_path / "run.h5") as writer:
        with pytest.raises(ValueError, match="accuracy"):
            writer.append_round({"accuracy": 0.5})
        with pytest.raises(ValueError):
            writer.append_clients({"round": np.array([1, 1]), "client": np.array([0])})
        with pytest.raises(ValueError):
            writer.append_round({"test_acc": 0.5, "round": 1.5})
        writer.append_round({"round": 1})
    with open_run(tmp_path / "run.h5") as run:  # the rejected rows left no trace
        assert {len(v) for v in run.rounds().values()} == {1}
        assert len(run.clients()["round"]) == 0


def test_layout_state_dict_round_trip(tmp_path):
    path = tmp_path / "run.h5"
    params = np.random.default_rng(0).standard_normal(N_PARAMS)
    with make_writer(path) as writer:
        writer.write_model(params)
        with pytest.raises(ValueError):
            writer.write_model(params[:-1], name="short")
    with open_run(path) as run:
        assert run.layout() == LAYOUT
        state = run.state_dict()
        assert run.model().dtype == np.float32
    assert {k: v.shape for k, v in state.items()} == {n: s for n, s, _ in LAYOUT}
    np.testing.assert_array_equal(state["fc.weight"], params[20:26].astype(np.float32).reshape(3, 2))


def test_missing_model_is_a_usage_error(tmp_path):
    path = tmp_path / "run.h5"
    make_writer(path).close()
    with open_run(path) as run, pytest.raises(UsageError, match="no model 'final'"):
        run.model()


READER = textwrap.dedent("""
    import sys
    from fedmpi.results import RunFile
    run = RunFile(sys.argv[1])
    for _ in sys.stdin:
        print(len(run.rounds()["round"]), flush=True)
""")


def _python(*args, **kw):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", *args], env=env, text=True, **kw)


def test_live_reader_in_another_process_follows_the_writer(tmp_path):
    """SWMR: a reader opened mid-run sees every flushed round, and does not block the writer."""
    path = tmp_path / "run.h5"
    writer = make_writer(path)
    writer.append_round({"round": 1})
    writer.flush()
    reader = _python(READER, str(path), stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def rounds_seen():
        reader.stdin.write("\n")
        reader.stdin.flush()
        return int(reader.stdout.readline())

    try:
        assert rounds_seen() == 1
        writer.append_round({"round": 2})
        writer.append_round({"round": 3})
        writer.flush()
        assert rounds_seen() == 3
        writer.write_model(np.zeros(N_PARAMS))
        writer.set_status("completed")
        writer.append_round({"round": 4})
        writer.flush()
        assert rounds_seen() == 4
    finally:
        writer.close()
        reader.stdin.close()
        reader.wait(timeout=10)
        reader.stdout.close()


def test_reader_in_same_process_while_writer_open(tmp_path):
    path = tmp_path / "run.h5"
    with make_writer(path) as writer:
        writer.append_round({"round": 1})
        with open_run(path) as run:
            assert run.rounds()["round"].tolist() == [1]
            writer.append_round({"round": 2})
            writer.set_status("completed")
            assert run.rounds()["round"].tolist() == [1, 2]


CRASH = textwrap.dedent("""
    import os, sys
    from fedmpi.results import ResultsWriter
    writer = ResultsWriter.create(sys.argv[1], config={}, provenance={}, round_fields=["round", "test_acc"],
                                  client_fields=["round"], layout=[], partition={})
    for r in (1, 2, 3):
        writer.append_round({"round": r, "test_acc": r / 10})
        writer.flush()
    writer.append_round({"round": 4, "test_acc": 0.4})  # appended, never flushed
    os._exit(1)
""")


def test_rounds_survive_a_crash_before_close(tmp_path):
    path = tmp_path / "run.h5"
    crashed = _python(CRASH, str(path))
    assert crashed.wait(timeout=30) == 1
    with open_run(path) as run:
        assert run.status == "running"
        np.testing.assert_allclose(run.rounds()["test_acc"], [0.1, 0.2, 0.3])


def test_rejects_hdf5_file_that_is_not_a_run(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["x"] = 1
    with pytest.raises(UsageError, match=f"{path} is not a fedmpi results file"):
        RunFile(path)


def test_rejects_missing_and_non_hdf5_files(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        RunFile(tmp_path / "nope.h5")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UsageError, match="is not an HDF5 file"):
        RunFile(tmp_path / "notes.txt")


def test_rejects_newer_schema(tmp_path):
    path = tmp_path / "run.h5"
    make_writer(path).close()
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(UsageError, match="schema_version 2"):
        RunFile(path)


def test_schema_v1_file_from_a_real_run_still_reads():
    """tests/data/results-v1.h5: `fedmpi run` of the tiny test config (2 rounds, seed 5,
    deterministic) as schema version 1 wrote it. Keep it; add a file per new version."""
    with open_run(GOLDEN_V1) as run:
        assert run.status == "completed" and run.attrs["schema_version"] == 1
        assert run.config["algorithm"]["name"] == "fedavg" and run.config["seed"] == 5
        rounds = run.rounds()
        assert rounds["round"].tolist() == [1, 2]
        d = run.attrs["num_params"]
        assert rounds["fl_bytes_up"].tolist() == [5 * d * 4] * 2
        assert len(run.clients()["client"]) == 10
        sd = run.state_dict()
        assert sd["body.0.weight"].shape == (4, 1, 5, 5) and sd["classifier.bias"].shape == (10,)
        assert sum(v.size for v in sd.values()) == d == run.model().size
        assert run.partition()["client_sizes"].sum() == 600


@pytest.mark.parametrize("edit", ["set_status", "write_model"])
def test_a_writer_whose_file_was_replaced_never_opens_the_new_one(tmp_path, edit):
    """A user's `mv` over a live run's file: the writer's next edit used to open the new
    file for writing before it saw the inode differ, and opening r+ writes the superblock's
    flags, so the replacement's bytes changed under a reader that looked at that moment."""
    path, other = tmp_path / "run.h5", tmp_path / "other.h5"
    make_writer(other).close()
    writer = make_writer(path)
    os.replace(other, path)
    replaced = path.read_bytes()
    os.utime(path, ns=(1, 1))   # a write would move the time; an open for reading does not
    call = {"set_status": lambda: writer.set_status("failed"),
            "write_model": lambda: writer.write_model(np.zeros(N_PARAMS))}[edit]
    with pytest.raises(RuntimeError, match="was replaced by another process during this run"):
        call()
    assert path.read_bytes() == replaced and os.stat(path).st_mtime_ns == 1
    writer.close()
    assert path.read_bytes() == replaced and os.stat(path).st_mtime_ns == 1
