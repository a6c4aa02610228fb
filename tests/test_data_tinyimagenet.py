"""Tiny-ImageNet loader on a fixture in the real tiny-imagenet-200/ layout, built by
tools/make_tinyimagenet_fixture.py."""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedmpi.data import tinyimagenet
from fedmpi.data.sources import available_datasets, load_dataset
from fedmpi.errors import UsageError

FIXTURE = Path(__file__).parent / "data" / "tiny-imagenet-200-fixture"
SORTED_WNIDS = ["n01443537", "n01629819", "n01641577"]  # wnids.txt lists them in another order
VAL_WNIDS = ["n01629819", "n01443537", "n01641577", "n01443537", "n01641577", "n01629819"]


def load(data_dir=FIXTURE, **options):
    return load_dataset("tiny_imagenet", data_dir=str(data_dir), **options)


def pixels(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.asarray(Image.open(path).convert("RGB")).transpose(2, 0, 1).copy())


@pytest.fixture
def copy(tmp_path):
    """A writable copy of the fixture as <tmp>/tiny-imagenet-200."""
    root = tmp_path / "tiny-imagenet-200"
    shutil.copytree(FIXTURE, root)
    return root


def test_shapes_dtypes_and_labels_from_sorted_wnids_and_annotations():
    ds = load(cache_dir="")
    assert ds.train_x.shape == (12, 3, 64, 64) and ds.test_x.shape == (6, 3, 64, 64)
    assert ds.train_x.dtype == ds.test_x.dtype == torch.uint8
    assert ds.train_y.dtype == ds.test_y.dtype == torch.int64
    assert ds.train_y.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert ds.test_y.tolist() == [SORTED_WNIDS.index(w) for w in VAL_WNIDS] == [1, 0, 2, 0, 2, 1]
    assert ds.num_classes == 3 and (ds.in_channels, ds.image_size) == (3, 64)
    assert ds.modality == "image" and ds.groups is None and ds.source == str(FIXTURE)
    expected_mean = (ds.train_x.double() / 255).mean(dim=(0, 2, 3))
    assert np.allclose(ds.mean, expected_mean.numpy(), atol=1e-9)


def test_pixels_are_the_files_in_class_then_k_order():
    ds = load(cache_dir="")
    for k, wnid in enumerate(SORTED_WNIDS):
        for j in range(4):
            path = FIXTURE / "train" / wnid / "images" / f"{wnid}_{j}.JPEG"
            assert torch.equal(ds.train_x[4 * k + j], pixels(path))
    assert torch.equal(ds.test_x[3], pixels(FIXTURE / "val" / "images" / "val_3.JPEG"))
    gray = ds.train_x[4 + 2]  # n01629819_2.JPEG is a grayscale JPEG: three equal channels
    assert Image.open(FIXTURE / "train" / "n01629819" / "images" / "n01629819_2.JPEG").mode == "L"
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])


def test_parent_folder_and_available_datasets(copy):
    assert torch.equal(load(copy.parent, cache_dir="").train_x, load(cache_dir="").train_x)
    assert dict(available_datasets(str(copy.parent)))["tiny_imagenet"] == str(copy)
    assert dict(available_datasets(str(FIXTURE)))["tiny_imagenet"] == str(FIXTURE)
    assert dict(available_datasets(str(copy / "train")))["tiny_imagenet"] is None


def test_second_load_reads_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = load(cache_dir=str(cache))
    files = sorted(os.listdir(cache))
    assert len(files) == 1 and files[0].startswith("tiny_imagenet-") and files[0].endswith(".npz")

    def no_decoding(paths):
        raise AssertionError("decoded although the cache is current")

    monkeypatch.setattr(tinyimagenet, "decode", no_decoding)
    second = load(cache_dir=str(cache))
    for field in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(first, field), getattr(second, field))
    assert second.mean == first.mean and second.std == first.std


def test_changed_file_invalidates_the_cache(copy, tmp_path):
    cache = tmp_path / "cache"
    before = load(copy, cache_dir=str(cache))
    images = copy / "val" / "images"
    shutil.copyfile(images / "val_1.JPEG", images / "val_3.JPEG")
    os.utime(images / "val_3.JPEG", ns=(1, 1))  # a different mtime even if the size matches
    after = load(copy, cache_dir=str(cache))
    assert len(list(cache.glob("*.npz"))) == 2
    assert torch.equal(after.test_x[3], before.test_x[1])
    assert not torch.equal(after.test_x[3], before.test_x[3])


def test_default_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDMPI_CACHE", str(tmp_path / "env-cache"))
    load()
    assert len(list((tmp_path / "env-cache").glob("tiny_imagenet-*.npz"))) == 1


def test_unreadable_cache_is_rebuilt(tmp_path):
    cache = tmp_path / "cache"
    good = load(cache_dir=str(cache))
    (path,) = cache.glob("*.npz")
    path.write_bytes(b"truncated")
    with pytest.warns(UserWarning, match="unreadable cache"):
        again = load(cache_dir=str(cache))
    assert torch.equal(again.train_x, good.train_x)
    assert load(cache_dir=str(cache)).test_y.tolist() == good.test_y.tolist()  # rewritten


def test_failed_cache_write_leaves_no_file_and_still_loads(tmp_path, monkeypatch):
    def disk_full(f, **arrays):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", disk_full)
    with pytest.warns(UserWarning, match="cannot write the Tiny-ImageNet cache"):
        ds = load(cache_dir=str(tmp_path))
    assert ds.train_x.shape == (12, 3, 64, 64) and os.listdir(tmp_path) == []


def test_missing_data_dir_and_bad_option():
    with pytest.raises(UsageError, match="needs data_dir = the tiny-imagenet-200/ folder.*none given"):
        load_dataset("tiny_imagenet")
    with pytest.raises(UsageError, match=r"no wnids.txt in .*tests/data or its tiny-imagenet-200/"):
        load(FIXTURE.parent)
    with pytest.raises(UsageError, match="data.cache_dir=3"):
        load(cache_dir=3)


def test_bad_layouts_name_the_path(copy):
    (copy / "val" / "images" / "val_5.JPEG").unlink()
    with pytest.raises(UsageError, match=r"val/images/val_5.JPEG: listed in val_annotations.txt"):
        load(copy, cache_dir="")
    annotations = copy / "val" / "val_annotations.txt"
    annotations.write_text("val_0.JPEG\tn99999999\t0\t0\t1\t1\n")
    with pytest.raises(UsageError, match=r"val_annotations.txt line 1: expected <file> TAB <wnid"):
        load(copy, cache_dir="")
    annotations.unlink()
    with pytest.raises(UsageError, match=r"val/val_annotations.txt: missing"):
        load(copy, cache_dir="")
    shutil.rmtree(copy / "train" / "n01443537" / "images")
    with pytest.raises(UsageError, match=r"train/n01443537/images: missing folder"):
        load(copy, cache_dir="")
    (copy / "wnids.txt").write_text("n01443537\nn01443537\n")
    with pytest.raises(UsageError, match="wnids.txt: needs distinct WordNet ids"):
        load(copy, cache_dir="")


def test_odd_image_files_name_the_path(copy):
    bad = copy / "train" / "n01641577" / "images" / "n01641577_1.JPEG"
    bad.write_bytes(b"not a jpeg")
    with pytest.raises(UsageError, match=r"n01641577_1.JPEG: not a readable image"):
        load(copy, cache_dir="")
    Image.new("RGB", (32, 32)).save(bad)
    with pytest.raises(UsageError, match=r"n01641577_1.JPEG: image is 32x32, expected 64x64"):
        load(copy, cache_dir="")
    for image in (copy / "train" / "n01641577" / "images").iterdir():
        image.unlink()
    with pytest.raises(UsageError, match=r"train/n01641577/images: no .JPEG images"):
        load(copy, cache_dir="")
