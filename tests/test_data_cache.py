"""Datasets parsed once and mapped afterwards (fedmpi.data.cache): the mapped arrays are
the parsed ones bit for bit, the files really are mapped (the kernel's map of this
process lists them), a second load parses nothing, a damaged cache is rebuilt, a cache
that cannot be written leaves the Dataset in memory, and two writers do not mix."""

import sys

import numpy as np
import pytest
import torch

from conftest import ROOT
from fedmpi.data import cache, leaf, load_dataset

sys.path.insert(0, str(ROOT / "tools"))
import leaf_fixtures  # noqa: E402


@pytest.fixture()
def femnist(tmp_path):
    return leaf_fixtures.write_femnist(tmp_path / "femnist", users=6, per_user=12, per_shard=4)


def parsed(folder):
    """The Dataset as built from the shards, never cached."""
    a = leaf.load("femnist", str(folder))
    return leaf.natural_dataset("leaf_femnist", a, 62, False,
                                f"{folder} (LEAF shards sha256 {a['digest']})")


def test_a_mapped_dataset_is_the_parsed_one_and_is_mapped(femnist):
    ds = load_dataset("leaf_femnist", str(femnist))
    assert ds.mapped_from and ds.mapped_from.startswith(str(femnist / ".fedmpi-cache"))
    maps = open("/proc/self/maps").read()
    assert f"{ds.mapped_from}/train_x.npy" in maps      # the kernel maps the file
    plain = parsed(femnist)
    assert plain.mapped_from is None and ds.sha256() == plain.sha256()
    for name in cache.TENSORS:
        assert torch.equal(getattr(ds, name), getattr(plain, name)), name
    for name in cache.META:
        assert getattr(ds, name) == getattr(plain, name), name


def test_a_second_load_parses_nothing_and_a_damaged_cache_is_rebuilt(femnist, monkeypatch):
    first = load_dataset("leaf_femnist", str(femnist))
    calls = []
    monkeypatch.setattr(leaf, "load", lambda *a, **k: calls.append(1) or pytest.fail("parsed"))
    again = load_dataset("leaf_femnist", str(femnist))
    assert not calls and again.mapped_from == first.mapped_from
    monkeypatch.undo()
    with open(f"{first.mapped_from}/train_x.npy", "r+b") as f:   # cut short
        f.truncate(200)
    rebuilt = load_dataset("leaf_femnist", str(femnist))
    assert rebuilt.sha256() == parsed(femnist).sha256() and rebuilt.mapped_from


def test_without_a_writable_cache_the_dataset_stays_in_memory(femnist, monkeypatch):
    monkeypatch.setattr(cache, "root", lambda folder: None)
    ds = load_dataset("leaf_femnist", str(femnist))
    assert ds.mapped_from is None and ds.sha256() == parsed(femnist).sha256()
    assert not (femnist / ".fedmpi-cache").exists()


def test_a_second_writer_leaves_the_first_ones_cache(femnist):
    ds = load_dataset("leaf_femnist", str(femnist))
    path = cache.Path(ds.mapped_from)
    before = sorted(p.name for p in path.parent.iterdir())
    assert cache._store(path, parsed(femnist)) is False     # the folder is there: not replaced
    assert sorted(p.name for p in path.parent.iterdir()) == before   # no temporary folder left
    assert np.array_equal(np.load(path / "train_y.npy"), ds.train_y.numpy())
