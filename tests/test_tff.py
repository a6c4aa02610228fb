"""TensorFlow Federated's HDF5 files (fedmpi.data.tff) on fixtures in TFF's layout written
by tools/tff_fixtures.py: the arrays against the files, each client's own test examples
as its local test split, one-line refusals naming the file, runs bitwise on 1 and 3 ranks."""

import shutil
import sys

import h5py
import numpy as np
import pytest
import torch

from conftest import ROOT, needs_mpi
from fedmpi.data import load_dataset, words
from fedmpi.data.shakespeare import encode
from fedmpi.errors import UsageError
from helpers import TINY, assert_same_on_ranks, run_file

sys.path.insert(0, str(ROOT / "tools"))
import tff_fixtures  # noqa: E402

KINDS = ("emnist", "cifar100", "shakespeare", "stackoverflow")
STEMS = {"emnist": "fed_emnist", "cifar100": "fed_cifar100", "shakespeare": "shakespeare",
         "stackoverflow": "stackoverflow"}
MODELS = {"shakespeare": {"name": "lstm", "hidden": 32},
          "stackoverflow": {"name": "lstm", "embed_dim": 16, "hidden": 32, "layers": 1, "fc": 16,
                            "pad_id": 0}}


@pytest.fixture(scope="module")
def tff(tmp_path_factory):
    root = tmp_path_factory.mktemp("tff")
    folders = {kind: tff_fixtures.WRITERS[kind](root / kind) for kind in KINDS}
    tff_fixtures.write_emnist(root / "emnist", digits=True)
    return folders


def examples(path):
    with h5py.File(path, "r") as h5:
        return {name: {k: v[()] for k, v in group.items()} for name, group in h5["examples"].items()}


def config(kind, folder, **more):
    data = {"dataset": f"tff_{kind}", "data_dir": str(folder)}
    if kind == "stackoverflow":
        data["vocab_size"] = 100
    return {**TINY, "data": data,
            "partition": {"kind": "natural"}, "clients": {"num": 8, "per_round": 3},
            "model": MODELS.get(kind, TINY["model"]),
            "system": {**TINY["system"], "deterministic": True}, **more}


def test_emnist_is_the_files_pixels_and_labels(tff):
    ds = load_dataset("tff_emnist", str(tff["emnist"]))
    train, test = (examples(tff["emnist"] / f"fed_emnist_{s}.h5") for s in ("train", "test"))
    assert ds.group_names == sorted(train) and ds.num_classes == 62
    x = np.concatenate([c["pixels"] for c in train.values()])
    n = len(x)
    assert np.array_equal(ds.train_x.numpy()[:n, 0], np.rint(x.astype(np.float64) * 255))
    assert np.array_equal(ds.train_y.numpy()[:n], np.concatenate([c["label"] for c in train.values()]))
    assert np.array_equal(ds.test_y.numpy(), np.concatenate([c["label"] for c in test.values()]))
    assert ds.held_out.numpy()[n:].all() and not ds.held_out.numpy()[:n].any()
    assert "sha256" in ds.source
    assert load_dataset("tff_emnist", str(tff["emnist"]), only_digits=True).num_classes == 10


def test_cifar100_test_clients_are_others_and_shakespeare_is_windows(tff):
    ds = load_dataset("tff_cifar100", str(tff["cifar100"]))
    train = examples(tff["cifar100"] / "fed_cifar100_train.h5")
    first = train[sorted(train)[0]]["image"][0]
    assert np.array_equal(ds.train_x[0].numpy(), first.transpose(2, 0, 1))
    assert not ds.held_out.any() and (ds.test_groups == -1).all()
    sh = load_dataset("tff_shakespeare", str(tff["shakespeare"]))
    train = examples(tff["shakespeare"] / "shakespeare_train.h5")
    text = " ".join(s.decode() for s in train[sorted(train)[0]]["snippets"])
    assert np.array_equal(sh.train_x[0].numpy(), encode(text[:80]))
    assert int(sh.train_y[0]) == int(encode(text[80])[0])
    assert np.array_equal(sh.train_x[1].numpy(), encode(text[8:88]))   # stride 8


def test_each_client_is_scored_on_its_own_test_examples(tff, tmp_path):
    values = config("emnist", tff["emnist"], eval={"every": 1, "clients": "all"})
    ds = load_dataset("tff_emnist", str(tff["emnist"]))
    test = examples(tff["emnist"] / "fed_emnist_test.h5")
    with run_file(tmp_path, "run", values) as run:
        part = run.partition()
    for c, name in enumerate(ds.group_names):
        ids = part["local_test_indices"][part["local_test_offsets"][c]:part["local_test_offsets"][c + 1]]
        assert np.array_equal(ds.train_y.numpy()[ids], test[name]["label"])


def test_stackoverflow_posts_are_tffs_ids_as_next_word_windows(tff):
    folder = tff["stackoverflow"]
    ds = load_dataset("tff_stackoverflow", str(folder), vocab_size=30, max_words=6)
    counted = (folder / "stackoverflow.word_count").read_text().split()
    vocab = counted[0:60:2]                       # the 30 commonest words, in the file's order
    assert ds.num_classes == ds.in_channels == 34 and ds.vocab_size is None
    train = examples(folder / "stackoverflow_train.h5")
    post = train[sorted(train)[0]]["tokens"][0].decode().split(" ")
    ids = [32] + [vocab.index(w) + 1 if w in vocab else 31 for w in post[:6]] + \
        ([33] if len(post) < 6 else [])          # TFF: bos 32, words 1..30, oov 31, eos 33
    for j in range(1, len(ids)):                  # position j: the ids before it -> ids[j]
        assert ds.train_x[j - 1].tolist() == (ids[:j] + [0] * 6)[:6]
        assert int(ds.train_y[j - 1]) == ids[j]
    n_train = sum(len(words.tff_post_ids(t.decode(), dict.fromkeys(vocab, 0), 6)) - 1
                  for c in train.values() for t in c["tokens"])
    assert int((~ds.held_out).sum()) == n_train and "stackoverflow.word_count sha256" in ds.source


def test_stackoverflow_max_clients_reads_the_first_clients_and_their_test_posts(tff):
    folder = tff["stackoverflow"]
    full = load_dataset("tff_stackoverflow", str(folder), vocab_size=30)
    some = load_dataset("tff_stackoverflow", str(folder), vocab_size=30, max_clients=3)
    assert some.group_names == full.group_names[:3]
    mine = (full.test_groups >= 0) & (full.test_groups < 3)
    assert torch.equal(some.test_x, full.test_x[mine]) and torch.equal(some.test_y, full.test_y[mine])
    assert torch.equal(some.train_x[~some.held_out], full.train_x[(full.groups < 3) & ~full.held_out])


@pytest.mark.parametrize("how, says", [
    ("no counts", "has no stackoverflow.word_count (TFF's word counts"),
    ("bad counts", "line 2 is not 'word count'"),
    ("few counts", "data.vocab_size asks for"),
    ("vocab_size", "config field data.vocab_size: an integer in 1.."),
    ("other task", "has no tokens (features: label, pixels)"),
    ("bytes", "tokens are not UTF-8 text"),
    ("max_clients", "config field data.max_clients: an integer in 0..2147483648 (0: every client)"),
])
def test_bad_stackoverflow_input_is_one_line(tff, tmp_path, how, says):
    folder = tmp_path / "so"
    shutil.copytree(tff["stackoverflow"], folder)
    counts = folder / "stackoverflow.word_count"
    options = {"vocab_size": 30}
    if how == "no counts":
        counts.unlink()
    elif how == "bad counts":
        counts.write_text("the 10\nand\n")
    elif how == "few counts":
        options["vocab_size"] = 100000
    elif how == "vocab_size":
        options["vocab_size"] = 0
    elif how == "max_clients":
        options["max_clients"] = 2 ** 63
    elif how == "bytes":
        with h5py.File(folder / "stackoverflow_train.h5", "r+") as h5:
            group = h5["examples"][sorted(h5["examples"])[0]]
            del group["tokens"]
            group.create_dataset("tokens", data=np.array([b"\xff\xfe the"], dtype="S6"))
            for key in [k for k in group if k != "tokens"]:
                del group[key]
    else:
        shutil.copy(tff["emnist"] / "fed_emnist_train.h5", folder / "stackoverflow_train.h5")
    with pytest.raises(UsageError) as error:
        load_dataset("tff_stackoverflow", str(folder), **options)
    assert says in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("how, says", [
    ("other task", "has no pixels (features: coarse_label, image, label); a file of another task?"),
    ("label", "labels must be integers in 0..61"),
    ("empty", "has no examples, or features of unequal lengths"),
    ("unequal", "has no examples, or features of unequal lengths"),
    ("missing", "has no fed_emnist_train.h5 and fed_emnist_test.h5"),
    ("not hdf5", "is not a readable HDF5 file"),
])
def test_bad_files_are_one_line_naming_the_file(tff, tmp_path, how, says):
    folder = tmp_path / "f"
    shutil.copytree(tff["emnist"], folder)
    path = folder / "fed_emnist_train.h5"
    if how == "other task":
        shutil.copy(tff["cifar100"] / "fed_cifar100_train.h5", path)
    elif how == "missing":
        path.unlink()
    elif how == "not hdf5":
        path.write_bytes(b"not an HDF5 file" * 10)
    else:
        with h5py.File(path, "r+") as h5:
            group = h5["examples"][sorted(h5["examples"])[0]]
            labels = group["label"][()]
            del group["label"]
            if how == "label":
                labels[0] = 70
            group.create_dataset("label", data=labels[:0] if how == "empty" else
                                 labels[:-1] if how == "unequal" else labels)
            if how == "empty":
                pixels = group["pixels"][()]
                del group["pixels"]
                group.create_dataset("pixels", data=pixels[:0])
    with pytest.raises(UsageError) as error:
        load_dataset("tff_emnist", str(folder))
    assert says in str(error.value) and "\n" not in str(error.value)
    if how not in ("missing",):
        assert str(path) in str(error.value)


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("kind", KINDS)
def test_a_tff_run_on_three_ranks_is_the_single_process_run(tff, tmp_path, kind):
    values = config(kind, tff[kind], rounds=2, eval={"every": 1, "clients": "all"})
    assert_same_on_ranks(tmp_path, values, 3, columns=("test_acc", "train_loss"), client_eval=True)
