"""LEAF's files (fedmpi.data.leaf) on fixtures in LEAF's exact format written by
tools/leaf_fixtures.py from real data: the arrays against the JSON, the users as natural
clients, each user's own test samples as its local test split, the digest cache, every
damaged-shard refusal in one line, and runs bitwise on 1 and 3 ranks."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, fedmpi, needs_mpi
from fedmpi.data import load_dataset, words
from fedmpi.data.shakespeare import encode
from fedmpi.errors import UsageError
from fedmpi.results import open_run
from helpers import TINY, assert_same_on_ranks, run_file

sys.path.insert(0, str(ROOT / "tools"))
import leaf_fixtures  # noqa: E402

KINDS = ("femnist", "shakespeare", "celeba", "sent140")
TEXT = ("shakespeare", "sent140")


@pytest.fixture(scope="module")
def leaf(tmp_path_factory):
    root = tmp_path_factory.mktemp("leaf")
    return {kind: leaf_fixtures.WRITERS[kind](root / kind, users=6, per_user=12, per_shard=4)
            for kind in KINDS}


def shards(folder: Path, split: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((folder / split).glob("*.json"))]


def config(kind, folder, **more):
    return {**TINY, "data": {"dataset": f"leaf_{kind}", "data_dir": str(folder)},
            "partition": {"kind": "natural"}, "clients": {"num": 6, "per_round": 3},
            "model": {"name": "lstm", "hidden": 32} if kind in TEXT else TINY["model"],
            "system": {**TINY["system"], "deterministic": True}, **more}


@pytest.mark.parametrize("kind", KINDS)
def test_arrays_are_the_shards_users_and_samples(leaf, kind):
    ds = load_dataset(f"leaf_{kind}", str(leaf[kind]))
    train, test = shards(leaf[kind], "train"), shards(leaf[kind], "test")
    users = [u for s in train for u in s["users"]]
    assert ds.group_names == users
    ys = [y for s in train for u in s["users"] for y in s["user_data"][u]["y"]]
    n = len(ys)
    held = ds.held_out.numpy()
    assert not held[:n].any() and held[n:].all()
    owners = np.repeat(np.arange(len(users)), [s["num_samples"][i] for s in train
                                               for i in range(len(s["users"]))])
    assert np.array_equal(ds.groups.numpy()[:n], owners)
    test_ys = [y for s in test for u in s["users"] for y in s["user_data"][u]["y"]]
    if kind == "shakespeare":
        ys, test_ys = encode("".join(ys)), encode("".join(test_ys))
    assert np.array_equal(ds.train_y.numpy()[:n], ys)
    assert np.array_equal(ds.test_y.numpy(), test_ys)
    assert np.array_equal(ds.train_y.numpy()[n:], ds.test_y.numpy())  # every tester trains
    first = train[0]["user_data"][users[0]]["x"][0]
    if kind == "femnist":   # LEAF's grey / 255, as uint8 round(255 x); white paper stays 1.0
        assert np.array_equal(ds.train_x[0, 0].numpy().ravel(), np.rint(np.array(first) * 255))
        assert ds.train_x.float().mean() > 128
    elif kind == "shakespeare":
        assert np.array_equal(ds.train_x[0].numpy(), encode(first))
    elif kind == "sent140":   # LEAF's ids of x[4] over the train tweets' 10,000 commonest tokens
        tweets = [r[4] for s in train for u in s["users"] for r in s["user_data"][u]["x"]]
        vocab = words.built_vocabulary(tweets, 10000)
        assert ds.vocab_size == ds.in_channels == len(vocab) + 1 and ds.num_classes == 2
        assert np.array_equal(ds.train_x[0].numpy(), words.leaf_ids([first[4]], vocab, 25)[0])
    else:
        assert tuple(ds.train_x.shape[1:]) == (3, 84, 84)
    assert f"LEAF shards sha256 " in ds.source


def test_each_natural_client_is_scored_on_its_own_leaf_test_samples(leaf, tmp_path):
    values = config("femnist", leaf["femnist"], eval={"every": 1, "clients": "all"})
    ds = load_dataset("leaf_femnist", str(leaf["femnist"]))
    test = shards(leaf["femnist"], "test")
    with run_file(tmp_path, "run", values) as run:
        part, scores = run.partition(), run.client_eval()
    for c, user in enumerate(ds.group_names):
        ids = part["local_test_indices"][part["local_test_offsets"][c]:part["local_test_offsets"][c + 1]]
        mine = next(s["user_data"][user] for s in test if user in s["user_data"])
        assert np.array_equal(ds.train_y.numpy()[ids], mine["y"])
        assert np.array_equal(ds.train_x.numpy()[ids].reshape(len(ids), -1),
                              np.rint(np.array(mine["x"]) * 255))
        trained = part["client_indices"][part["client_offsets"][c]:part["client_offsets"][c + 1]]
        assert not ds.held_out.numpy()[trained].any()
    assert np.array_equal(np.unique(scores["client"]), np.arange(6))
    assert set(scores["n_test"]) == {1}   # 12 a user, LEAF's 10% -> 1 test sample each


def test_the_cache_is_keyed_by_the_shards_digest(leaf, tmp_path):
    import shutil
    folder = tmp_path / "f"
    shutil.copytree(leaf["femnist"], folder, ignore=shutil.ignore_patterns(".fedmpi-cache"))
    first = load_dataset("leaf_femnist", str(folder))
    [cache] = (folder / ".fedmpi-cache").iterdir()
    again = load_dataset("leaf_femnist", str(folder))
    assert np.array_equal(first.train_x.numpy(), again.train_x.numpy())
    assert again.group_names == first.group_names and again.source == first.source
    shard = sorted((folder / "train").glob("*.json"))[0]
    data = json.loads(shard.read_text())
    user = data["users"][0]
    data["user_data"][user]["y"][0] = (data["user_data"][user]["y"][0] + 1) % 10
    shard.write_text(json.dumps(data))
    changed = load_dataset("leaf_femnist", str(folder))
    assert changed.source != first.source and len(list((folder / ".fedmpi-cache").iterdir())) == 2
    assert changed.train_y[0] == (first.train_y[0] + 1) % 10


def _damage(folder: Path, how):
    shard = sorted((folder / "train").glob("*.json"))[0]
    data = json.loads(shard.read_text())
    user = data["users"][0]
    if how == "truncated":
        shard.write_text(json.dumps(data)[:200])
    elif how == "no user_data":
        del data["user_data"]
    elif how == "user without data":
        del data["user_data"][user]
    elif how == "num_samples":
        data["num_samples"][0] += 1
    elif how == "label":
        data["user_data"][user]["y"][0] = 70
    elif how == "pixels":
        data["user_data"][user]["x"][0] = data["user_data"][user]["x"][0][:700]
    elif how == "twice":
        other = sorted((folder / "train").glob("*.json"))[1]
        more = json.loads(other.read_text())
        more["users"][0] = user
        more["user_data"][user] = more["user_data"].pop(json.loads(other.read_text())["users"][0])
        other.write_text(json.dumps(more))
    if how not in ("truncated", "twice"):
        shard.write_text(json.dumps(data))
    return shard


def test_leaf_words_ids_and_vocabularies_by_hand():
    assert words.leaf_tokens("I can't go, ok?! x_1") == ["I", "can't", "go", ",", "ok", "?", "!", "x_1"]
    assert words.built_vocabulary(["b a a", "c b a", "d"], 2) == ["a", "b"]   # a 3, b 2; c, d 1
    assert words.built_vocabulary(["d c"], 5) == ["c", "d"]                   # ties by the token
    assert words.leaf_ids(["b a zz", "a " * 9], ["a", "b"], 4).tolist() == [[1, 0, 2, 2], [0, 0, 0, 0]]


def test_sent140_with_leafs_glove_vocabulary_and_its_own_cache(leaf, tmp_path):
    import shutil
    folder = tmp_path / "s"
    shutil.copytree(leaf["sent140"], folder, ignore=shutil.ignore_patterns(".fedmpi-cache"))
    glove = ["the", "and", ",", "I", "to", "."]
    (tmp_path / "embs.json").write_text(json.dumps({"vocab": glove, "emba": [[0.5] * 3] * 6}))
    ds = load_dataset("leaf_sent140", str(folder), vocab_file=str(tmp_path / "embs.json"),
                      max_words=10)
    first = shards(folder, "train")[0]
    tweet = first["user_data"][first["users"][0]]["x"][0][4]
    assert ds.vocab_size == 7 and ds.train_x.shape[1] == 10
    assert ds.train_x[0].tolist() == [glove.index(t) if t in glove else 6
                                      for t in (words.leaf_tokens(tweet) + [""] * 10)[:10]]
    small = load_dataset("leaf_sent140", str(folder), vocab_size=20)
    assert small.vocab_size == 21 and int(small.train_x.max()) == 20
    assert len(list((folder / ".fedmpi-cache").iterdir())) == 2   # one per vocabulary
    assert torch.equal(load_dataset("leaf_sent140", str(folder), vocab_size=20).train_x, small.train_x)


@pytest.mark.parametrize("how, says", [
    ("row", "each x must be a tweet's row with its text at x[4]"),
    ("label", "label 2 is outside 0..1"),
    ("word label", "each y must be an integer label"),
    ("vocab missing", "config field data.vocab_file:"),
    ("vocab bad", "LEAF's embs.json holds \"vocab\", a list of distinct words"),
    ("vocab_size", "config field data.vocab_size: an integer in 1.."),
    ("max_words", "config field data.max_words: an integer in 1..1000"),
])
def test_bad_sent140_input_is_one_line(leaf, tmp_path, how, says):
    import shutil
    folder = tmp_path / "s"
    shutil.copytree(leaf["sent140"], folder, ignore=shutil.ignore_patterns(".fedmpi-cache"))
    shard = sorted((folder / "train").glob("*.json"))[0]
    data = json.loads(shard.read_text())
    user = data["users"][0]
    options = {}
    if how == "row":
        data["user_data"][user]["x"][0] = data["user_data"][user]["x"][0][:4]
    elif how == "label":
        data["user_data"][user]["y"][0] = 2
    elif how == "word label":
        data["user_data"][user]["y"][0] = "positive"
    elif how == "vocab missing":
        options["vocab_file"] = str(tmp_path / "no-embs.json")
    elif how == "vocab bad":
        (tmp_path / "embs.json").write_text(json.dumps({"emba": []}))
        options["vocab_file"] = str(tmp_path / "embs.json")
    elif how == "max_words":
        options["max_words"] = 2 ** 63
    else:
        options["vocab_size"] = 0
    shard.write_text(json.dumps(data))
    with pytest.raises(UsageError) as error:
        load_dataset("leaf_sent140", str(folder), **options)
    assert says in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("how, says", [
    ("truncated", "is not valid JSON"),
    ("no user_data", "not a LEAF shard (it needs users, num_samples and user_data)"),
    ("user without data", "is listed in users but has no x and y in user_data"),
    ("num_samples", "samples, num_samples says"),
    ("label", "label 70 is outside 0..61"),
    ("pixels", "each x must be 784 values in [0, 1]"),
    ("twice", "is also in"),
])
def test_a_damaged_shard_is_one_line_naming_the_file(leaf, tmp_path, how, says):
    import shutil
    folder = tmp_path / "f"
    shutil.copytree(leaf["femnist"], folder, ignore=shutil.ignore_patterns(".fedmpi-cache"))
    shard = _damage(folder, how)
    with pytest.raises(UsageError, match="LEAF file") as error:
        load_dataset("leaf_femnist", str(folder))
    assert says in str(error.value) and "\n" not in str(error.value)
    assert not list((folder / ".fedmpi-cache").glob("*"))   # a failed build leaves nothing
    if how != "twice":
        assert str(shard) in str(error.value)
    proc = fedmpi(["run", "--set", "data.dataset=leaf_femnist", "--set", f"data.data_dir={folder}",
                   "--set", "partition.kind=natural", "--set", "clients.num=4",
                   "--set", "clients.per_round=2", "-o", "x.h5"],
                  cwd=tmp_path)
    assert proc.returncode == 2 and says in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "x.h5").exists()


def test_missing_folders_and_images_are_one_line(leaf, tmp_path):
    for folder, says in ((tmp_path, "is not a LEAF data/ folder"),):
        with pytest.raises(UsageError, match=says):
            load_dataset("leaf_femnist", str(folder))
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    with pytest.raises(UsageError, match="holds no .json shard"):
        load_dataset("leaf_femnist", str(tmp_path))
    import shutil
    celeba = tmp_path / "c"
    shutil.copytree(leaf["celeba"], celeba, ignore=shutil.ignore_patterns(".fedmpi-cache"))
    (celeba / "raw/img_align_celeba/000001.jpg").unlink()
    with pytest.raises(UsageError, match="000001.jpg cannot be read"):
        load_dataset("leaf_celeba", str(celeba))
    proc = fedmpi(["datasets", "--data-dir", str(leaf["femnist"].parent / "femnist")])
    assert proc.returncode == 0


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("kind", KINDS)
def test_a_leaf_run_on_three_ranks_is_the_single_process_run(leaf, tmp_path, kind):
    values = config(kind, leaf[kind], rounds=2, eval={"every": 1, "clients": "all"})
    assert_same_on_ranks(tmp_path, values, 3, columns=("test_acc", "train_loss"), client_eval=True)
    with open_run(tmp_path / "n3.h5") as run:
        assert run.status == "completed"
