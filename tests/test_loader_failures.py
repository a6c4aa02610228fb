"""A dataset that cannot be loaded is the user's input, not fedmpi's crash: a plugin
loader that raises when called (its file missing on a node) and an .npz whose array
header claims more than the file holds are one line and exit 2, with no results file."""

import zipfile

import numpy as np
import pytest

from fedmpi.data import load_dataset
from fedmpi.errors import UsageError

from conftest import fedmpi
from helpers import TINY, write_config

# TINY without its data and model: each test names its own dataset (tabular: an MLP)
BASE = {k: v for k, v in TINY.items() if k not in ("data", "model")}

PLUGIN = '''
import fedmpi.data


@fedmpi.data.register("on_node_disk", modality="tabular")
def load(data_dir=None, seed=0):
    open("/nonexistent/fedmpi-test/shard.npz", "rb")
'''


def test_a_plugin_loader_that_raises_is_one_line_naming_the_dataset(tmp_path):
    (tmp_path / "node_plugin.py").write_text(PLUGIN)
    config = write_config(tmp_path / "c.toml", BASE, plugins=["node_plugin"], rounds=1,
                          data={"dataset": "on_node_disk"}, model={"name": "mlp"})
    out = tmp_path / "r.h5"
    proc = fedmpi(["run", config, "-o", out], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("fedmpi: dataset 'on_node_disk': its loader node_plugin.load raised "
                           "FileNotFoundError: [Errno 2] No such file or directory: "
                           "'/nonexistent/fedmpi-test/shard.npz'\n")
    assert not out.exists()


def _npz_claiming(path, rows_claimed):
    """A real np.savez file, with x_train's .npy header rewritten to claim more rows."""
    rng = np.random.default_rng(0)
    arrays = {"x_train": rng.normal(size=(120, 5)).astype(np.float32),
              "y_train": rng.integers(0, 3, 120), "x_test": rng.normal(size=(40, 5)).astype(np.float32),
              "y_test": rng.integers(0, 3, 40)}
    np.savez(path, **arrays)
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    old = "(120, 5)".encode()
    new = f"({rows_claimed}, 5)".encode()
    header_end = members["x_train.npy"].index(b"\n") + 1
    body = members["x_train.npy"][:header_end - 1].replace(old, new).rstrip(b" ")
    body += b" " * (header_end - 1 - len(body))   # numpy's padding: the header keeps its length
    members["x_train.npy"] = body + b"\n" + members["x_train.npy"][header_end:]
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def test_an_npz_whose_header_claims_a_huge_shape_is_a_damaged_file(tmp_path):
    path = _npz_claiming(tmp_path / "d.npz", 10 ** 12)
    with pytest.raises(UsageError) as err:
        load_dataset("arrays", path=str(path))
    assert str(err.value) == (f"{path}: array 'x_train' is damaged: its header claims shape "
                              f"(1000000000000, 5) of float32 (18.2 TiB) but the file holds "
                              f"2.3 KiB of it; is data.path a complete copy?")
    # the command line: one line, exit 2, no file (it was "out of memory ... 18.2 TiB", exit 1)
    config = write_config(tmp_path / "c.toml", BASE, rounds=1, data={"dataset": "arrays", "path": str(path)},
                          model={"name": "mlp"})
    proc = fedmpi(["run", config, "-o", tmp_path / "r.h5"])
    assert proc.returncode == 2 and proc.stderr.startswith("fedmpi: ") and \
        proc.stderr.count("\n") == 1 and "is damaged" in proc.stderr, proc.stderr
    assert not (tmp_path / "r.h5").exists()


def test_an_npz_whose_header_claims_fewer_rows_than_it_holds_is_damaged_too(tmp_path):
    path = _npz_claiming(tmp_path / "d.npz", 119)   # 4 bytes * 5 left over
    with pytest.raises(UsageError, match=r"array 'x_train' is damaged: its header claims shape "
                                         r"\(119, 5\) of float32 \(2.3 KiB\) but the file holds"):
        load_dataset("arrays", path=str(path))


def test_the_header_check_is_also_the_config_time_check(tmp_path):
    """`fedmpi config` reads only x_train's header (the modality): the same line."""
    path = _npz_claiming(tmp_path / "d.npz", 10 ** 12)
    proc = fedmpi(["config", "--set", "data.dataset=arrays", "--set", f"data.path={path}",
                   "--set", "model.name=mlp"])
    assert proc.returncode == 2 and "array 'x_train' is damaged" in proc.stderr, proc.stderr


def test_an_unchanged_npz_still_loads(tmp_path):
    path = _npz_claiming(tmp_path / "d.npz", 120)
    assert load_dataset("arrays", path=str(path)).train_x.shape == (120, 5)



def test_an_npz_holding_one_array_twice_is_refused(tmp_path):
    import warnings

    path = _npz_claiming(tmp_path / "d.npz", 120)
    with zipfile.ZipFile(path) as archive:
        y = archive.read("y_train.npy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # zipfile warns of the duplicate name: the point
        with zipfile.ZipFile(path, "a") as archive:
            archive.writestr("y_train.npy", y)
    with pytest.raises(UsageError, match=r"d.npz: holds the array 'y_train' twice \(two members "
                                         r"of one name in the zip\); each array once$"):
        load_dataset("arrays", path=str(path))
