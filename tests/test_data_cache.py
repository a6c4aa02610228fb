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
    """The Dataset as built from the shards in memory, never cached."""
    return leaf.load("leaf_femnist", "femnist", str(folder))


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


def test_a_second_writer_leaves_the_first_ones_cache(femnist, tmp_path):
    """Two builders of one cache: the folder that lands first stays; the other's rename is
    refused, it maps the first one's, and no temporary folder is left."""
    path = tmp_path / "cache" / "ds"

    def racing(folder):   # another writer finishes the same cache while this one builds
        assert cache.keep(path, lambda f: parsed(femnist)).mapped_from == str(path)
        (folder / "marker").write_text("this writer's")
        return parsed(femnist)
    got = cache.keep(path, racing)
    assert got.mapped_from == str(path) and not (path / "marker").exists()   # the first one's
    assert [p.name for p in path.parent.iterdir()] == ["ds"]   # no temporary folder left
    assert got.sha256() == parsed(femnist).sha256()


@pytest.mark.parametrize("kind", ["emnist", "cifar100", "shakespeare", "stackoverflow"])
def test_tff_files_stream_into_the_cache_one_client_at_a_time(tmp_path, kind):
    """A TFF dataset is written into the cache client by client (natural.Builder: each
    client's samples appended to the .npy files, the header last) and is the in-memory
    build bit for bit, channel statistics included; a build that fails leaves no folder."""
    import tff_fixtures
    from fedmpi.data import tff

    folder = tff_fixtures.WRITERS[kind](tmp_path / kind)
    options = {"vocab_size": 50} if kind == "stackoverflow" else {}
    name, stem = f"tff_{kind}", tff.FILES[kind]
    mapped = load_dataset(name, str(folder), **options)
    assert mapped.mapped_from
    classes = {"emnist": 62, "cifar100": 100, "shakespeare": 0, "stackoverflow": 54}[kind]
    memory = tff.load(name, kind, str(folder), classes, **options)
    assert memory.mapped_from is None and mapped.sha256() == memory.sha256()
    for field in cache.TENSORS:
        assert torch.equal(getattr(mapped, field), getattr(memory, field)), field
    assert (mapped.mean, mapped.std, mapped.group_names) == (memory.mean, memory.std,
                                                              memory.group_names)
    if kind == "emnist":   # channel_stats of the train file's samples
        from fedmpi.data.sources import channel_stats
        own = ~memory.held_out
        assert channel_stats(memory.train_x[own]) == (memory.mean, memory.std)
    broken = tmp_path / "broken"
    broken.mkdir()
    for split in ("train", "test"):
        (broken / f"{stem}_{split}.h5").write_bytes(b"not HDF5" * 8)
    if kind == "stackoverflow":
        (broken / "stackoverflow.word_count").write_text((folder / "stackoverflow.word_count").read_text())
    with pytest.raises(Exception, match="is not a readable HDF5 file"):
        load_dataset(name, str(broken), **options)
    assert not list((broken / ".fedmpi-cache").iterdir())


def test_two_processes_building_one_cache_at_once_agree(tmp_path):
    """Two real processes load the same TFF files at the same moment: both finish, with
    the same arrays, one cache folder and no temporary folder left."""
    import subprocess
    import tff_fixtures

    folder = tff_fixtures.write_emnist(tmp_path / "emnist", clients=40, per_client=30)
    probe = ("import sys; from fedmpi.data import load_dataset; "
             "ds = load_dataset('tff_emnist', sys.argv[1]); print(ds.sha256(), bool(ds.mapped_from))")
    procs = [subprocess.Popen([sys.executable, "-c", probe, str(folder)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and outs[0][1] == "True"
    assert len([p for p in (folder / ".fedmpi-cache").iterdir()]) == 1


def test_a_build_killed_outright_leaves_a_folder_the_next_build_removes(femnist):
    """A temporary folder named for a process that is gone (killed mid-build) goes at the
    next build on the host; one of a live process stays."""
    import os
    import socket
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    host = socket.gethostname()
    ds = load_dataset("leaf_femnist", str(femnist))
    path = cache.Path(ds.mapped_from)
    dead = path.parent / f".{path.name}.{host}.{gone.pid}-abc123"
    live = path.parent / f".{path.name}.{host}.{os.getpid()}-def456"
    for folder in (dead, live):
        folder.mkdir()
        (folder / "train_x.npy").write_bytes(b"half")
    import shutil
    shutil.rmtree(path)   # the cache must be built again: the stale folder is found then
    load_dataset("leaf_femnist", str(femnist))
    assert not dead.exists() and live.exists()
