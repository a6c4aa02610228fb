"""Private layers (fedmpi.runtime.partial; FedPer, LG-FedAvg, FedRep, FedBABU, FedBN): only
the shared coordinates travel and are counted, each client keeps and is scored on its
own private values, an empty private set is FedAvg bit for bit, the global model's
private part stays the initial model's, 1 and 3 ranks and a resume give the same bits,
and what the methods cannot take is refused in one line."""

import re

import numpy as np
import pytest
import torch

from fedmpi import config as cfg
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.models import build_model
from fedmpi.results import RunFile
from fedmpi.runtime.partial import SharedMask

from conftest import fedmpi, needs_mpi
from helpers import TINY, assert_same_on_3_ranks, merged, run_and_resume, run_file

SPLIT = merged(TINY, partition={**TINY["partition"], "local_test": 0.25},
               eval={**TINY["eval"], "clients": "all"})
DETERMINISTIC = {**TINY["system"], "deterministic": True}
# TINY's CNN on 16x16x3 synthetic images, 10 classes: the body 1,200 values, the head
# (classifier: 32 x 10 + 10) 330
D, HEAD = 1530, 330


def method(name, base=SPLIT, **params):
    return merged(base, algorithm={"name": name, **params})


def initial_model(values) -> np.ndarray:
    """The run's initial model x^0, in the standard order the files hold."""
    from fedmpi import algorithms
    from fedmpi.comm import LocalComm
    from fedmpi.runtime.world import build_world

    c = cfg.from_dict(values)
    alg = algorithms.build(c.algorithm.name, c.algorithm.params)
    return build_world(c, LocalComm(), alg, run=False).flat.params.numpy()


def test_fedper_without_private_layers_is_fedavg_bit_for_bit(tmp_path):
    with run_file(tmp_path, "fedper", method("fedper", private=[])) as a, \
            run_file(tmp_path, "fedavg", SPLIT) as b:
        assert np.array_equal(a.model(), b.model())
        for name in ("test_acc", "test_loss", "fl_bytes_up", "fl_bytes_down"):
            assert np.array_equal(a.rounds()[name], b.rounds()[name]), name
        assert np.array_equal(a.client_eval()["accuracy"], b.client_eval()["accuracy"])


@pytest.mark.parametrize("name, private, shared", [
    ("fedper", HEAD, D - HEAD), ("lg_fedavg", D - HEAD, HEAD), ("fedrep", HEAD, D - HEAD),
    ("fedbabu", HEAD, D - HEAD)])
def test_only_the_shared_values_travel_and_the_ledger_counts_them(tmp_path, name, private, shared):
    with run_file(tmp_path, name, method(name)) as r:
        clients, attrs = r.clients(), r.attrs
        assert set(clients["bytes_up"]) == {4 * shared} and set(clients["bytes_down"]) == {4 * shared}
        assert attrs["num_params"] == D and attrs["shared_params"] == shared
        assert attrs["private_params"] == private


def test_a_top_k_codec_keeps_k_of_the_shared_values_and_feeds_back_only_those(tmp_path):
    """k = ceil(0.1 n) of n = d_shared values, and each client's error feedback is a
    vector of d_shared (a codec over the full d would take k of 1,530 and keep 1,530)."""
    from fedmpi.runtime.compression import Codec

    z = {"up": "topk", "fraction": 0.1, "error_feedback": True}
    values = merged(method("fedper"), compression=z,
                    system={**TINY["system"], "checkpoint_every": 1})
    with run_file(tmp_path, "topk", values) as r:
        up = set(r.clients()["bytes_up"])
        states = [st for _, st in r.checkpoint().states()]
    assert up == {Codec("topk", fraction=0.1).encoded_bytes(D - HEAD)}
    assert up != {Codec("topk", fraction=0.1).encoded_bytes(D)}
    feedback = [v for st in states for k, v in st.items() if k.startswith("ef_")]
    assert feedback and all(v.shape == (D - HEAD,) for v in feedback)


def test_the_global_model_keeps_the_initial_private_values(tmp_path):
    """FedAvg's update adds zeros at the private coordinates: FedPer's global head and
    LG-FedAvg's global body are the initial model's, the rest moved."""
    for name, private in (("fedper", slice(D - HEAD, D)), ("lg_fedavg", slice(0, D - HEAD))):
        with run_file(tmp_path, name, method(name)) as r:
            x, x0 = r.model(), initial_model(method(name))
        assert np.array_equal(x[private], x0[private])
        shared = np.ones(D, bool)
        shared[private] = False
        assert not np.array_equal(x[shared], x0[shared])


def test_one_client_one_round_fedper_is_fedavg_on_the_shared_values(tmp_path):
    """One client, global lr 1: both train the whole model from x^0 over the same batches;
    FedPer's global body is FedAvg's bit for bit, and the head the client keeps is the
    head FedAvg's mean of one update gives (up to its rounding)."""
    one = merged(SPLIT, rounds=2, clients={**TINY["clients"], "per_round": 1},
                 system={**TINY["system"], "checkpoint_every": 1})
    with run_file(tmp_path, "fedper", method("fedper", one)) as per, \
            run_file(tmp_path, "fedavg", one) as avg:
        per_ckpt, avg_ckpt = per.checkpoint(), avg.checkpoint()   # after round 1
        assert per_ckpt.round == avg_ckpt.round == 1
        body, x = per_ckpt.server["x"][:D - HEAD], avg_ckpt.server["x"]
        client = int(per.clients()["client"][0])
        states = dict(per_ckpt.states())
    assert np.array_equal(body, x[:D - HEAD])
    assert list(states) == [client] and states[client]["private_started"][0] == 1
    assert np.allclose(states[client]["private"], x[D - HEAD:], rtol=1e-6, atol=1e-7)


def test_personal_scores_use_each_client_s_own_private_values(tmp_path):
    with run_file(tmp_path, "fedper", method("fedper")) as r:
        table, trained = r.client_eval(), set(r.clients()["client"].tolist())
    last = table["round"] == TINY["rounds"]
    clients = table["client"][last]
    never = np.array([int(c) not in trained for c in clients])
    personal, plain = table["personal_accuracy"][last], table["accuracy"][last]
    assert never.any() and (~never).any()
    assert np.array_equal(personal[never], plain[never])   # the initial head: the global model
    assert not np.array_equal(personal[~never], plain[~never])


def test_fedrep_trains_the_head_then_the_body(tmp_path):
    """rep_epochs = local_epochs: the head never trains (the client's head is the initial
    one); with 2 epochs and 1 for the body it does."""
    frozen = merged(method("fedrep"), system={**TINY["system"], "checkpoint_every": 1})
    both = merged(frozen, train={**TINY["train"], "local_epochs": 2})
    x0 = initial_model(frozen)
    head0 = x0[D - HEAD:]
    with run_file(tmp_path, "frozen", frozen) as a, run_file(tmp_path, "both", both) as b:
        heads_a = [st["private"] for _, st in a.checkpoint().states()]
        heads_b = [st["private"] for _, st in b.checkpoint().states()]
        assert not np.array_equal(a.model()[:D - HEAD], x0[:D - HEAD])
    assert all(np.array_equal(h, head0) for h in heads_a)
    assert not any(np.array_equal(h, head0) for h in heads_b)


def test_fedbabu_keeps_no_state_and_its_head_never_moves(tmp_path):
    values = merged(method("fedbabu"), system={**TINY["system"], "checkpoint_every": 1},
                    eval={**SPLIT["eval"], "client_finetune_epochs": 1})
    with run_file(tmp_path, "babu", values) as r:
        assert np.array_equal(r.model()[D - HEAD:], initial_model(values)[D - HEAD:])
        assert dict(r.checkpoint().states()) == {}
        assert np.isfinite(r.client_eval()["personal_accuracy"]).all()   # fine-tuned


def test_the_mask_is_whole_slots_the_same_in_storage_and_standard_order():
    module = build_model("cnn", 3, 10, 16, hidden=32, channels=(4, 8))
    flat = FlatModel(module, channels_last=True)
    for names in (["classifier"], ["body"], ["body.0", "classifier"]):
        mask = SharedMask(flat, names)
        perm = flat.canonical(torch.arange(flat.size)).numpy()
        for offset, n in mask.shared_runs + mask.private_runs:
            assert sorted(perm[offset:offset + n]) == list(range(offset, offset + n))
        v = torch.randn(flat.size)
        back = mask.put_private(mask.expand(mask.shared(v)), mask.private(v))
        assert torch.equal(back, v)
        assert mask.d_shared + mask.d_private == flat.size


@pytest.mark.slow
@needs_mpi
def test_fedper_is_bitwise_the_same_for_1_and_3_ranks(tmp_path):
    assert_same_on_3_ranks(tmp_path, merged(method("fedper"), system=DETERMINISTIC),
                           client_eval=True)


@pytest.mark.slow
@needs_mpi
def test_fedrep_is_bitwise_the_same_for_1_and_3_ranks(tmp_path):
    values = merged(method("fedrep"), system=DETERMINISTIC,
                    train={**TINY["train"], "local_epochs": 2})
    assert_same_on_3_ranks(tmp_path, values, client_eval=True)


def test_a_resumed_fedper_run_has_the_same_private_values(tmp_path):
    crashed, _ = run_and_resume(merged(method("lg_fedavg"), system=DETERMINISTIC, rounds=4),
                                tmp_path)
    with RunFile(tmp_path / "ref.h5") as ref, RunFile(crashed) as resumed:
        assert np.array_equal(ref.model(), resumed.model())
        for name, column in ref.client_eval().items():
            assert np.array_equal(column, resumed.client_eval()[name]), name


@pytest.mark.parametrize("over, message", [
    ({"algorithm": {"name": "fedper", "private": "head"}},
     "algorithm.private: expected list, got 'head'"),
    ({"algorithm": {"name": "fedper", "private": [1]}},
     "algorithm.private: must be a list of layer names or of head, body, norm, got [1]"),
    ({"algorithm": {"name": "fedper", "private": [""]}},
     "algorithm.private: must be a list of layer names or of head, body, norm, got ['']"),
    ({"algorithm": {"name": "fedrep", "rep_epochs": 2}},
     "algorithm.rep_epochs: the body's epochs come out of train.local_epochs = 1"),
    ({"algorithm": {"name": "fedrep"}, "system": {**TINY["system"], "client_group": 2},
      "train": {**TINY["train"], "optimizer": "adam"}},
     "system.client_group: train.optimizer 'adam' has no group form"),
])
def test_what_the_methods_cannot_take_is_refused_at_config_time(over, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        cfg.from_dict(merged(TINY, **over))


@pytest.mark.parametrize("algorithm, message", [
    ({"name": "fedper", "private": ["fc9"]}, "algorithm.private: the model has no layer 'fc9'"),
    ({"name": "fedper", "private": ["body", "head"]},
     "algorithm.private: every parameter would be private"),
    ({"name": "fedbn"}, "algorithm.private: the model has no norm layers (CNN)"),
])
def test_private_layers_the_model_lacks_are_refused_at_start(tmp_path, algorithm, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        run_file(tmp_path, "bad", merged(TINY, algorithm=algorithm))
    assert not (tmp_path / "bad.h5").exists()


def test_fedbn_keeps_the_batchnorm_layers_and_their_statistics(tmp_path):
    """TINY's CNN with BatchNorm after each convolution (4 and 8 channels): weight, bias,
    running mean and variance of each, 4 x 12 = 48 private values; each client's own
    statistics score its personal model."""
    values = merged(method("fedbn"), model={**TINY["model"], "norm": "batch"})
    with run_file(tmp_path, "fedbn", values) as r:
        attrs, table = r.attrs, r.client_eval()
        layers = json_list(attrs["private_layers"])
    assert attrs["private_params"] == 48 and attrs["num_params"] == D + 48
    assert sorted(layers) == sorted(f"body.{i}.{p}" for i in (1, 5) for p in
                                    ("weight", "bias", "running_mean", "running_var"))
    assert np.isfinite(table["personal_accuracy"]).all()


def json_list(value):
    import json
    return json.loads(value) if isinstance(value, str) else list(value)


def test_a_layer_the_model_lacks_is_one_line_exit_2_and_keeps_the_old_file(tmp_path):
    """Refused when the run starts (the model is built then), before the results file is
    touched: an existing file survives even --force."""
    from helpers import write_config

    with run_file(tmp_path, "run", TINY):
        pass
    out = tmp_path / "run.h5"
    before = out.read_bytes()
    path = write_config(tmp_path / "bad.toml", merged(TINY, algorithm={"name": "fedper",
                                                                        "private": ["fc9"]}),
                        output=str(out))
    proc = fedmpi(["run", str(path), "-q", "--force"])
    assert proc.returncode == 2 and out.read_bytes() == before
    assert proc.stderr.strip().splitlines() == [
        "fedmpi: config field algorithm.private: the model has no layer 'fc9'; its layers are "
        "body, classifier"]
