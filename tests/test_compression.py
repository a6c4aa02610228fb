"""Compressed messages ([compression]): exact byte formulas for every codec, the identities
(top-k and rand-k of everything, fp16 of representable values), QSGD's unbiasedness, the
error-feedback invariants, and through the runtime: the ledger's encoded sizes, resume
with error feedback, 1-3 ranks bitwise, and what is refused at config time."""

import sys

import numpy as np
import pytest
import torch

from fedmpi import algorithms
from fedmpi import config as cfg
from fedmpi.algorithms.base import RoundContext, Upload
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment
from fedmpi.runtime.compression import Codec, Compression
from fedmpi.runtime.rng import torch_generator

from conftest import mpirun, needs_mpi
from helpers import TINY, merged, run_and_resume, write_config


# ---- codecs -------------------------------------------------------------------------------

@pytest.mark.parametrize("codec,n,expected", [
    (Codec("none"), 1000, 4000),
    (Codec("fp16"), 1001, 2002),
    (Codec("bf16"), 7, 14),
    # qsgd: a float32 norm per bucket + (b + 1) bits a value, packed
    (Codec("qsgd", bits=4, bucket=64), 1000, 16 * 4 + 625),      # 1000 = 15 buckets + 40
    (Codec("qsgd", bits=4), 1000, 4 + 625),                      # one bucket
    (Codec("qsgd", bits=1, bucket=3), 10, 4 * 4 + 3),            # 20 bits -> 3 bytes
    (Codec("qsgd", bits=16, bucket=0), 3, 4 + 7),                # 51 bits -> 7 bytes
    # topk: 4k + indices at ceil(log2 n) bits or an n-bit bitmap, the smaller
    (Codec("topk", fraction=0.01), 1000, 10 * 4 + 13),           # 100 index bits
    (Codec("topk", fraction=0.5), 1000, 500 * 4 + 125),          # the bitmap is smaller
    (Codec("topk", count=3), 1000, 3 * 4 + 4),                   # 30 bits
    (Codec("topk", fraction=1.0), 1000, 4000),                   # everything: no indices
    (Codec("randk", fraction=0.01), 1000, 40),                   # indices from the shared stream
    (Codec("randk", count=2000), 1000, 4000),
    (Codec("sign"), 1000, 125 + 4),
    (Codec("sign"), 1001, 126 + 4),
])
def test_exact_encoded_bytes(codec, n, expected):
    assert codec.encoded_bytes(n) == expected


def test_message_bytes_count_the_incompressible_at_full_width():
    c = cfg.from_dict(merged(TINY, algorithm={"name": "fednova"}, compression={"up": "sign"}))
    codecs = Compression(c, algorithms.build("fednova", c.algorithm.params), 1000)
    assert codecs.message_bytes(1000, "train") == (4000, 129 + 4)   # a_i: one float32
    c = cfg.from_dict(merged(TINY, algorithm={"name": "scaffold"}, compression={
        "up": "topk", "fraction": 0.01, "messages": ["delta", "delta_c"], "down": "fp16"}))
    codecs = Compression(c, algorithms.build("scaffold", c.algorithm.params), 1000)
    assert codecs.message_bytes(1000, "train") == (2 * 2000, 2 * 53)
    c = cfg.from_dict(merged(TINY, algorithm={"name": "scaffold"}, compression={"up": "topk"}))
    codecs = Compression(c, algorithms.build("scaffold", c.algorithm.params), 1000)
    assert codecs.message_bytes(1000, "train") == (8000, 53 + 4000)   # delta_c at full width


def test_identities():
    v = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    g = torch_generator(0, "t", 1)
    assert torch.equal(Codec("topk", fraction=1.0).decode(v), v)
    assert torch.equal(Codec("randk", fraction=1.0).decode(v, g), v)
    exact = torch.tensor([0.5, -1.25, 1024.0, 2.0 ** -15, 0.0, -2.0 ** -14, 65504.0])   # fp16 values
    assert torch.equal(Codec("fp16").decode(exact), exact)
    assert torch.equal(Codec("bf16").decode(torch.tensor([0.5, -3.0, 2.0 ** 100])),
                       torch.tensor([0.5, -3.0, 2.0 ** 100]))


def test_sparsifiers_keep_what_they_say():
    v = torch.tensor([0.1, -5.0, 0.3, 4.0, -0.2, 0.0])
    assert Codec("topk", count=2).decode(v).tolist() == [0, -5.0, 0, 4.0, 0, 0]
    r = Codec("randk", count=3).decode(v, torch_generator(1, "t", 2))
    kept = r != 0
    assert int(kept.sum()) == 3 and torch.equal(r[kept], v[kept])
    s = Codec("sign").decode(v)
    assert torch.allclose(s.abs(), v.abs().mean().expand(6)) and s[1] < 0 and s[5] > 0


def test_qsgd_is_unbiased():
    """The mean of N encodings converges to v: each coordinate's decoded value is one of
    two adjacent levels ||v|| l / s, so its variance is at most (||v|| / s)^2 / 4."""
    v = torch.randn(64, generator=torch.Generator().manual_seed(3))
    codec, N = Codec("qsgd", bits=2), 4000
    total = torch.zeros(64, dtype=torch.float64)
    for i in range(N):
        total += codec.decode(v, torch_generator(0, "unbiased", i)).double()
    bound = torch.linalg.vector_norm(v).item() / 3 / 2 / N ** 0.5   # s = 2^2 - 1
    assert torch.all((total / N - v.double()).abs() <= 5 * bound)
    assert not torch.equal(codec.decode(v, torch_generator(0, "u", 1)), v)   # not the identity


def test_qsgd_levels_and_buckets():
    v = torch.tensor([3.0, -4.0, 0.0, 0.0, 1.0])
    out = Codec("qsgd", bits=3, bucket=2).decode(v, torch_generator(0, "q", 0))
    norms = [5.0, 5.0, 0.0, 0.0, 1.0]
    for x, y, norm in zip(v.tolist(), out.tolist(), norms):
        assert (x == 0 and y == 0) or (np.sign(x) == np.sign(y) and
                                       abs(round(abs(y) / norm * 7) - abs(y) / norm * 7) < 1e-5)


def test_qsgd_bucket_past_the_vector_is_one_bucket_without_allocating_it():
    """A bucket larger than the vector (here 10^12 values, 4 TB if allocated) is the one
    bucket of the whole vector: the same decode and byte count as bucket = 0, in the
    vector's memory. Found by a hostile config that the kernel's OOM killer ended."""
    v = torch.randn(300, generator=torch.Generator().manual_seed(2))
    huge, whole = Codec("qsgd", bits=4, bucket=10**12), Codec("qsgd", bits=4)
    assert torch.equal(huge.decode(v, torch_generator(0, "q", 1)),
                       whole.decode(v, torch_generator(0, "q", 1)))
    assert huge.encoded_bytes(300) == whole.encoded_bytes(300)


def test_error_feedback_keeps_what_was_not_sent():
    """Classic EF: e = (v + e_prev) - decoded each time, so sum(decoded) + e_T = sum(v)."""
    c = cfg.from_dict(merged(TINY, compression={"up": "topk", "fraction": 0.05,
                                                "error_feedback": True}))
    codecs = Compression(c, algorithms.build("fedavg", {}), 200)
    gen = torch.Generator().manual_seed(5)
    state, sent, inputs = None, torch.zeros(200, dtype=torch.float64), torch.zeros(200, dtype=torch.float64)
    for t in range(30):
        v = torch.randn(200, generator=gen)
        before = torch.zeros(200) if state is None else torch.from_numpy(state["ef_delta"])
        upload, new = codecs.upload(Upload(delta=v.clone(), num_samples=1, loss=0.0, steps=1),
                                    state, (t, 0, 0))
        assert torch.equal(new["ef_delta"], v + before - upload.delta)
        assert int((upload.delta != 0).sum()) == 10
        sent += upload.delta.double()
        inputs += v.double()
        state = {"ef_delta": new["ef_delta"].numpy()}
    torch.testing.assert_close(sent + torch.from_numpy(state["ef_delta"]).double(), inputs,
                               rtol=0, atol=1e-5)


def test_ef21_moves_the_shared_estimate_by_the_compressed_difference():
    c = cfg.from_dict(merged(TINY, compression={"up": "topk", "count": 3, "error_feedback": True,
                                                "feedback": "ef21"}))
    codecs = Compression(c, algorithms.build("fedavg", {}), 10)
    v = torch.arange(10, dtype=torch.float32)
    g = torch.ones(10)
    upload, new = codecs.upload(Upload(delta=v.clone(), num_samples=1, loss=0.0, steps=1),
                                {"ef21_delta": g.numpy()}, (0, 0, 0))
    expected = g + Codec("topk", count=3).decode(v - g)
    assert torch.equal(upload.delta, expected) and torch.equal(new["ef21_delta"], expected)


def test_every_declared_download_is_in_the_payload():
    """What an algorithm declares compressible exists in its payload (else a cast would
    silently do nothing while the ledger counts it compressed)."""
    d = 12
    ctx = RoundContext(round=0, phase="train", lr=0.1, lr_prev=0.1, global_lr=1.0,
                       weight_decay=0.0, grad_clip=0.0, local_epochs=1, batch_size=4,
                       num_clients=4, participants=(0, 1), seed=0)
    for name, cls in algorithms.REGISTRY.items():
        alg = cls()
        declared = alg.compressible(d)
        if not declared["down"]:
            continue
        payload = alg.payload(alg.init_server_state(torch.zeros(d)), ctx)
        assert set(declared["down"]) <= set(payload), name
        assert all(payload[k].numel() == n for k, n in declared["down"].items()), name


# ---- through the runtime ------------------------------------------------------------------

def run(tmp_path, name, **over):
    values = merged(TINY, **over)
    values["output"] = str(tmp_path / f"{name}.h5")
    run_experiment(cfg.from_dict(values), LocalComm(), quiet=True)
    return RunFile(tmp_path / f"{name}.h5")


def test_everything_kept_is_no_compression_bitwise(tmp_path):
    over = dict(rounds=2, system={"threads": 1})
    with run(tmp_path, "none", **over) as a, \
            run(tmp_path, "topk", **over, compression={"up": "topk", "fraction": 1.0,
                                                       "error_feedback": True}) as b, \
            run(tmp_path, "randk", **over, compression={"up": "randk", "fraction": 1.0}) as c:
        assert np.array_equal(a.model(), b.model()) and np.array_equal(a.model(), c.model())
        assert np.array_equal(a.clients()["bytes_up"], b.clients()["bytes_up"])


def test_the_ledger_counts_encoded_sizes(tmp_path):
    with run(tmp_path, "q", rounds=2, system={"threads": 1},
             compression={"up": "qsgd", "bits": 4, "bucket": 100, "down": "bf16"}) as r:
        d = len(r.model())
        clients, rounds = r.clients(), r.rounds()
        assert np.all(clients["bytes_down"] == 2 * d)
        assert np.all(clients["bytes_up"] == 4 * -(-d // 100) + -(-d * 5 // 8))
        for t in (1, 2):
            mine = clients["round"] == t
            assert rounds["fl_bytes_up"][t] == clients["bytes_up"][mine].sum()
            assert rounds["fl_bytes_down"][t] == clients["bytes_down"][mine].sum()
        assert r.config["compression"]["up"] == "qsgd"


def test_resume_with_error_feedback_is_bitwise_the_uninterrupted_run(tmp_path):
    values = merged(TINY, rounds=5, system={"deterministic": True, "checkpoint_every": 2},
                    compression={"up": "topk", "fraction": 0.05, "error_feedback": True})
    crashed, exp = run_and_resume(values, tmp_path)   # died after round 5 was flushed: resume from 4
    assert exp.start == 4
    with RunFile(tmp_path / "ref.h5") as a, RunFile(crashed) as b:
        assert np.array_equal(a.model(), b.model())
        assert np.array_equal(a.rounds()["test_acc"], b.rounds()["test_acc"], equal_nan=True)


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("algorithm,messages,ranks", [("fedavg", ["delta"], (2, 3)),
                                                      ("scaffold", ["delta", "delta_c"], (2, 3))])
def test_topk_with_error_feedback_is_bitwise_the_same_for_1_2_and_3_ranks(
        tmp_path, algorithm, messages, ranks):
    """FedAvg, and SCAFFOLD (its c_i and two error-feedback vectors per client move
    between ranks): one process against mpirun."""
    over = dict(rounds=2, algorithm={"name": algorithm}, system={"deterministic": True},
                compression={"up": "topk", "fraction": 0.05, "error_feedback": True,
                             "messages": messages})
    config = write_config(tmp_path / "c.toml", **over)
    for n in ranks:
        mpirun(n, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o",
                   str(tmp_path / f"n{n}.h5")])
    with run(tmp_path, "n1", **over) as a:
        for n in ranks:
            with RunFile(tmp_path / f"n{n}.h5") as b:
                assert np.array_equal(a.model(), b.model())
                assert np.array_equal(a.rounds()["test_acc"], b.rounds()["test_acc"], equal_nan=True)
                assert np.array_equal(a.clients()["bytes_up"], b.clients()["bytes_up"])


# ---- refused at config time ---------------------------------------------------------------

@pytest.mark.parametrize("section,over,message", [
    ({"up": "zip"}, {}, "compression.up: 'zip' is not allowed"),
    ({"down": "topk"}, {}, "compression.down: 'topk' is not allowed"),
    ({"up": "topk", "fraction": 0.0}, {}, "compression.fraction: must be in (0, 1], got 0.0"),
    ({"up": "topk", "fraction": 1.5}, {}, "compression.fraction: must be in (0, 1], got 1.5"),
    ({"up": "randk", "count": -1}, {}, "compression.count: must be >= 0"),
    ({"up": "qsgd", "bits": 0}, {}, "compression.bits: must be in 1..16, got 0"),
    ({"up": "qsgd", "bits": 17}, {}, "compression.bits: must be in 1..16, got 17"),
    ({"up": "qsgd", "bucket": -4}, {}, "compression.bucket: must be >= 0"),
    ({"up": "sign", "feedback": "ef3"}, {}, "compression.feedback: 'ef3' is not allowed"),
    ({"error_feedback": True}, {}, "compression.error_feedback: feeds back what an upload codec"),
    ({"up": "topk", "messages": ["a"]}, {"algorithm": {"name": "fednova"}},
     "compression.messages: 'a' is not an upload algorithm 'fednova' declares compressible"),
    ({"up": "topk", "messages": []}, {}, "compression.messages: a list of distinct upload names"),
    ({"up": "topk"}, {"algorithm": {"name": "fnrfl"}, "data": {"public_size": 60}},
     "compression.up: algorithm 'fnrfl' declares no message that may be compressed"),
])
def test_bad_compression_is_a_one_line_error(section, over, message):
    with pytest.raises(UsageError) as err:
        cfg.from_dict(merged(TINY, **over, compression=section))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_virtual_clock_times_the_encoded_messages(tmp_path):
    with run(tmp_path, "vt", rounds=2, system={"threads": 1},
             system_model={"profiles": "lognormal", "step_time": 0.05},
             compression={"up": "sign", "error_feedback": True, "down": "fp16"}) as r:
        clients, part, d = r.clients(), r.partition(), len(r.model())
        assert np.all(clients["bytes_up"] == -(-d // 8) + 4) and np.all(clients["bytes_down"] == 2 * d)
        c = clients["client"].astype(int)
        speed, down, up, lat = (part[f"device_{k}"] for k in ("speed", "down_mbps", "up_mbps", "latency"))
        expected = clients["bytes_down"] * 8 / (down[c] * 1e6) + lat[c] + \
            clients["steps"] * 0.05 / speed[c] + clients["bytes_up"] * 8 / (up[c] * 1e6) + lat[c]
        np.testing.assert_allclose(clients["vt_end"] - clients["vt_start"], expected, rtol=1e-12)


def test_report_and_plot_show_the_compressed_upload(tmp_path):
    """report: up MB and MB/round by default once a run compresses, equal to the file's
    sums; plot --x upload: accuracy against the cumulative uploaded MB."""
    import csv
    import io

    from click.testing import CliRunner
    from matplotlib.figure import Figure

    from fedmpi import analysis as fa
    from fedmpi.analysis.cli import commands

    over = dict(rounds=2, system={"threads": 1})
    run(tmp_path, "plain", **over).close()
    run(tmp_path, "sign", **over, compression={"up": "sign", "error_feedback": True}).close()
    paths = [str(tmp_path / "plain.h5"), str(tmp_path / "sign.h5")]
    result = CliRunner().invoke(commands, ["report", *paths, "--format", "csv"])
    assert result.exit_code == 0, result.output
    rows = {row["compression.up"]: row for row in csv.DictReader(io.StringIO(result.stdout))}
    for up, path in (("none", paths[0]), ("sign", paths[1])):
        with RunFile(path) as r:
            rounds = r.rounds()
        assert float(rows[up]["upload_mb_mean"]) == pytest.approx(rounds["fl_bytes_up"].sum() / 1e6)
        total = rounds["fl_bytes_up"].sum() + rounds["fl_bytes_down"].sum()
        assert float(rows[up]["mb_per_round_mean"]) == pytest.approx(total / 2 / 1e6)
    assert float(rows["sign"]["upload_mb_mean"]) < float(rows["none"]["upload_mb_mean"]) / 25
    plain = CliRunner().invoke(commands, ["report", paths[0], paths[0]])
    assert "up MB" not in plain.stdout   # nobody compresses: the default columns stay
    ax = Figure().add_subplot()
    fa.plot_accuracy(fa.load(paths[1]), ax, x="upload")
    with RunFile(paths[1]) as r:
        rounds = r.rounds()
    xs, _ = ax.get_lines()[0].get_data()
    np.testing.assert_allclose(xs, np.cumsum(rounds["fl_bytes_up"])[np.isfinite(rounds["test_acc"])] / 1e6)
    assert ax.get_xlabel() == "cumulative FL upload (MB)"
    out = tmp_path / "up.png"
    result = CliRunner().invoke(commands, ["plot", *paths, "--x", "upload", "--log-x", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
