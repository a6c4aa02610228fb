"""Client sampling (clients.sampling, clients.empty_rounds): uniform (fixed size), Bernoulli
(each client independently, a variable count) and size-weighted draws, all keyed by
(seed, round) alone; and rounds nobody takes part in, through the real runtime."""

import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from fedmpi import config as cfg
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment
from fedmpi.runtime.participation import Sync
from fedmpi.runtime.plan import place, sample_clients
from fedmpi.runtime.rng import numpy_rng

from conftest import fedmpi, mpirun, needs_mpi
from helpers import TINY, merged, write_config


def draws(rounds, *args, **kw):
    return [sample_clients(5, t, *args, **kw) for t in range(rounds)]


# ---- the draws ------------------------------------------------------------------------

def test_uniform_is_the_default_and_the_same_draw_as_before():
    """The default is the fixed-size uniform draw, bit for bit what it always was."""
    for t in range(5):
        before = np.sort(numpy_rng(5, "sample", t).choice(40, size=7, replace=False))
        assert np.array_equal(sample_clients(5, t, 40, 7), before)
        assert np.array_equal(sample_clients(5, t, 40, 7, "uniform", empty="skip"), before)
    assert cfg.from_dict({}).clients.sampling == "uniform"
    assert cfg.from_dict({}).clients.empty_rounds == "redraw"


@pytest.mark.parametrize("sampling", ["uniform", "bernoulli", "size"])
def test_every_scheme_is_keyed_by_seed_and_round_only(sampling):
    sizes = np.arange(1, 31)
    a = sample_clients(0, 5, 30, 6, sampling, sizes=sizes)
    assert np.array_equal(a, sample_clients(0, 5, 30, 6, sampling, sizes=sizes))
    assert not np.array_equal(a, sample_clients(0, 6, 30, 6, sampling, sizes=sizes))
    assert not np.array_equal(a, sample_clients(1, 5, 30, 6, sampling, sizes=sizes))
    assert a.dtype == np.int64 and np.all(np.diff(a) > 0) and 0 <= a.min() and a.max() < 30
    if sampling != "bernoulli":
        assert len(a) == 6


def test_bernoulli_count_is_binomial_with_mean_per_round():
    """|S_t| ~ Binomial(N, q), q = S / N: the mean over R rounds is S within 4 standard
    errors sqrt(N q (1 - q) / R); every client is in with frequency q."""
    n, s, rounds = 100, 10, 2000
    q = s / n
    sets = draws(rounds, n, s, "bernoulli", empty="skip")
    counts = np.array([len(x) for x in sets])
    assert abs(counts.mean() - s) < 4 * math.sqrt(n * q * (1 - q) / rounds)
    assert abs(counts.var() - n * q * (1 - q)) < 0.15 * n * q * (1 - q)   # not a fixed size
    frequency = np.bincount(np.concatenate(sets), minlength=n) / rounds
    assert np.all(np.abs(frequency - q) < 5 * math.sqrt(q * (1 - q) / rounds))


def test_redraw_never_yields_an_empty_round_and_skip_does():
    """N = 40, S = 1: P(empty) = (1 - 1/40)^40 ~ 0.36. redraw draws again from the same
    stream (so the draw is the skip one whenever that one is not empty)."""
    skip = draws(300, 40, 1, "bernoulli", empty="skip")
    redraw = draws(300, 40, 1, "bernoulli", empty="redraw")
    empty = sum(len(x) == 0 for x in skip)
    assert 0.25 * 300 < empty < 0.47 * 300
    assert all(len(x) for x in redraw)
    assert all(np.array_equal(a, b) for a, b in zip(skip, redraw) if len(a))
    # redrawn rounds are still deterministic
    assert all(np.array_equal(a, b) for a, b in zip(redraw, draws(300, 40, 1, "bernoulli")))


def test_size_weighted_prefers_big_clients():
    """Ten clients of 10 samples, ten of 100, five a round: the big ones are taken far
    more often, but less than ten times as often (successive sampling is not exactly
    proportional); a client without samples never."""
    sizes = np.array([10] * 10 + [100] * 10 + [0])
    sets = draws(1000, 21, 5, "size", sizes=sizes)
    assert all(len(x) == 5 for x in sets)
    frequency = np.bincount(np.concatenate(sets), minlength=21) / 1000
    small, big = frequency[:10].mean(), frequency[10:20].mean()
    assert big > 4 * small and big < 10 * small and frequency[20] == 0
    assert min(frequency[10:20]) > max(frequency[:10])
    with pytest.raises(UsageError, match="clients.sampling"):
        sample_clients(0, 0, 21, 5, "size", sizes=np.array([0] * 17 + [5] * 4))


def test_size_weights_are_the_sample_counts_of_who_holds_the_slots():
    """Dynamic population: the server weighs slot s by the size of the identity in slot s
    in round t, then maps the slots to identities (FederatedSplit.sample)."""
    population = np.array([[0, 1, 2, 3], [4, 5, 2, 3]])   # slots 0, 1 replaced in stage 1

    class Split:
        holdout = None   # clients.holdout: no slot held out

        def active(self, t):
            return population[min(t // 10, 1)]

        def sample(self, slots, t):
            return np.sort(self.active(t)[slots])

    sizes = np.array([1, 1, 1000, 1000, 1000, 1000])      # identities 4, 5 are big newcomers
    clients = SimpleNamespace(num=4, per_round=2, sampling="size", empty_rounds="redraw")
    stage = Sync(SimpleNamespace(seed=0, clients=clients), Split(), sizes)
    early = np.concatenate([stage.select(t, None) for t in range(10)])
    late = np.concatenate([stage.select(t, None) for t in range(10, 20)])
    assert np.bincount(early, minlength=6)[[2, 3]].sum() > 15 and set(late) <= {2, 3, 4, 5}
    assert min(np.bincount(late, minlength=6)[2:]) > 0


def test_placement_of_a_variable_count_over_workers():
    """Fewer participants than workers, or none: every worker still gets a (maybe empty) list."""
    sizes = np.arange(1, 11)
    for clients in (np.zeros(0, np.int64), np.array([7]), np.array([1, 2, 3, 4, 5, 6])):
        parts = place(clients, sizes, 3)
        assert len(parts) == 3 and sorted(np.concatenate(parts).tolist()) == clients.tolist()


# ---- bad input -------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, words", [
    (['clients.sampling="poisson"'], ["clients.sampling", "'poisson' is not allowed",
                                      "bernoulli, size, uniform"]),
    (['clients.empty_rounds="retry"'], ["clients.empty_rounds", "redraw, skip"]),
    (['clients.sampling="bernoulli"', "clients.per_round=0"], ["clients.per_round", "> 0"]),
    (['clients.sampling="bernoulli"', "clients.per_round=21"], ["clients.per_round",
                                                                 "exceeds clients.num = 20"]),
    (['clients.sampling="size"', "clients.per_round=-1"], ["clients.per_round", "> 0"]),
    (["clients.sampling=1"], ["clients.sampling"]),
])
def test_bad_sampling_settings_are_one_line_errors(overrides, words):
    with pytest.raises(UsageError) as err:
        cfg.resolve(None, None, overrides)
    message = str(err.value)
    assert "\n" not in message and message.startswith("config field ")
    for word in words:
        assert word in message, message


# ---- empty rounds through the runtime ---------------------------------------------------

# seed 3, N = 12, S = 1: rounds t = 0, 4, 5 draw nobody (the first round of the run among them)
EMPTY = dict(seed=3, clients={"num": 12, "per_round": 1, "sampling": "bernoulli",
                              "empty_rounds": "skip"})


def toy_reference(x0, sets, lam=0.5, beta=0.5):
    """toy_algorithms' closed form for given S_t; an empty S_t changes nothing."""
    x, m, last = x0.astype(np.float64), np.zeros(x0.size), {}
    for sampled in sets:
        if not len(sampled):
            continue
        deltas, scores = [], []
        for c in sampled:
            ci = np.full(x.size, (c + 1) / 10)
            deltas.append(lam * (ci - x) - 0.1 * m)
            last[c] = x + deltas[-1]
            scores.append(np.linalg.norm(ci - x))
        m = beta * m + np.mean(deltas, axis=0)
        x = x + m
        selected = np.sort(sampled[np.lexsort((sampled, -np.asarray(scores)))[:2]])
        x = x + np.mean([0.25 * (last[j] - x) for j in selected], axis=0)
    return x


def test_skipped_rounds_leave_model_and_server_state_unchanged(tmp_path):
    """Two phases, client state, server momentum (toy_probe): a round with nobody does not
    call server_update (momentum would decay, 0/0 would be NaN), trains and writes no
    client, moves no FL byte, and is still evaluated and counted in the lr schedule."""
    values = merged(TINY, plugins=["toy_algorithms"], algorithm={"name": "toy_probe"},
                    rounds=6, train={"lr_decay": 0.9}, data={"num_test": 40},
                    eval={"batch_size": 40}, output=str(tmp_path / "toy.h5"), **EMPTY)
    c = cfg.from_dict(values)
    sets = [sample_clients(c.seed, t, 12, 1, "bernoulli", empty="skip") for t in range(6)]
    empty = [t + 1 for t, s in enumerate(sets) if not len(s)]
    assert empty == [1, 5, 6]
    exp = run_experiment(c, LocalComm(), quiet=True)
    with RunFile(c.output_path()) as run:
        assert run.status == "completed"   # NaN train_loss of a skipped round is no divergence
        np.testing.assert_allclose(run.model(), toy_reference(_initial(c), sets),
                                   rtol=1e-5, atol=1e-5)
        rounds = run.rounds()
        assert rounds["n_participants"].tolist() == [0] + [len(s) for s in sets]
        for r in empty:
            assert rounds["fl_bytes_down"][r] == rounds["fl_bytes_up"][r] == 0
            assert np.isnan(rounds["train_loss"][r]) and rounds["update_norm"][r] == 0
            assert np.isnan(rounds["client_update_norm_mean"][r])
            assert rounds["test_acc"][r] == rounds["test_acc"][r - 1]      # the same model
            assert rounds["test_loss"][r] == rounds["test_loss"][r - 1]
        np.testing.assert_allclose(rounds["lr"][1:], c.train.lr * 0.9 ** np.arange(6), rtol=1e-12)
        clients = run.clients()
        assert sorted(set(clients["round"].tolist())) == [2, 3, 4]
        assert clients["client"][clients["phase"] == 0].tolist() == [1, 3, 6]
        # the ledger: per-client traffic times the round's participants, phase by phase
        # (train: 2d down, d + 2 up; refine, min(2, k) of them: d down, d up)
        d, k = exp.d, np.array([len(s) for s in sets])
        refine = np.minimum(2, k)
        assert rounds["fl_bytes_down"][1:].tolist() == (4 * (2 * d * k + d * refine)).tolist()
        assert rounds["fl_bytes_up"][1:].tolist() == (4 * ((d + 2) * k + d * refine)).tolist()


def test_a_draw_of_clients_without_samples_trains_nobody(tmp_path):
    """partition.min_size = 0 leaves clients empty; a round that drew only such clients
    ended FedAvg (a mean weighted by n_i: 0/0) with a ZeroDivisionError traceback, FedAdam
    with a false "training diverged". The round now trains nobody, as a skipped empty
    draw; rounds that drew anyone with samples are as before."""
    values = merged(TINY, seed=4, rounds=4, data={"num_train": 40}, partition={"min_size": 0},
                    clients={"num": 40, "per_round": 2}, output=str(tmp_path / "e.h5"))
    c = cfg.from_dict(values)
    run_experiment(c, LocalComm(), quiet=True)
    with RunFile(c.output_path()) as run:
        sizes, rounds = run.partition()["client_sizes"], run.rounds()
        assert run.status == "completed"
    drawn = [sizes[sample_clients(c.seed, t, 40, 2)] for t in range(4)]
    assert [s.tolist() for s in drawn] == [[1, 2], [0, 0], [0, 2], [1, 0]]
    assert rounds["n_participants"].tolist() == [0, 2, 0, 2, 2]
    assert rounds["fl_bytes_down"][2] == rounds["fl_bytes_up"][2] == 0
    assert rounds["update_norm"][2] == 0 and rounds["test_acc"][2] == rounds["test_acc"][1]


def _initial(c):
    """x^0 as the runtime builds it (seeded model init)."""
    import torch

    from fedmpi.flat import FlatModel
    from fedmpi.models import build_model
    from fedmpi.runtime.rng import key_seed

    torch.manual_seed(key_seed(c.seed, "init"))
    model = build_model(c.model.name, 1, 10, 16, **c.model.options)
    return FlatModel(model).params.detach().numpy()


def test_resume_over_skipped_rounds_is_bitwise_the_uninterrupted_run(tmp_path):
    """SCAFFOLD (server and client state) with empty rounds 1 and 5: resumed from the
    round-4 checkpoint, round 5 is skipped again and the file ends as the reference."""
    from test_checkpoint import assert_same_run, reference_and_crash

    ref, crashed = reference_and_crash(tmp_path, algorithm={"name": "scaffold"}, **EMPTY)
    values = cfg.from_dict({**RunFile(crashed).config, "output": str(crashed)})
    exp = run_experiment(values, LocalComm(), quiet=True, resume=True)
    assert exp.start == 4
    with RunFile(ref) as a, RunFile(crashed) as b:
        assert b.status == "completed"
        assert_same_run(a, b)
        assert b.rounds()["n_participants"].tolist() == [0, 0, 1, 1, 1, 0]
        assert np.isnan(b.rounds()["train_loss"][5])


@needs_mpi
@pytest.mark.slow
def test_bernoulli_under_mpirun_is_bitwise_the_single_process_run(tmp_path):
    """Deterministic Bernoulli sampling with a skipped round, 1 process vs mpirun -n 3
    (two workers), FNR-FL (two phases; refines floor(k / 2) of the k participants): seed 5
    draws k = 1, 2, 0, 4, so a round with one client (one worker idle, nobody refined),
    a round with nobody (both idle, no phase runs) and full rounds."""
    config = write_config(tmp_path / "b.toml", seed=5, rounds=4,
                          clients={"num": 12, "per_round": 2, "sampling": "bernoulli",
                                   "empty_rounds": "skip"},
                          algorithm={"name": "fnrfl", "refine_epochs": 1},
                          data={"public_size": 60}, system={"deterministic": True})
    fedmpi(["run", "-q", str(config), "-o", str(tmp_path / "single.h5")], check=True)
    mpirun(3, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o",
               str(tmp_path / "n3.h5")])
    with RunFile(tmp_path / "single.h5") as a, RunFile(tmp_path / "n3.h5") as b:
        assert b.status == "completed" and b.attrs["world_size"] == 3
        ra, rb = a.rounds(), b.rounds()
        assert rb["n_participants"].tolist() == [0, 1, 2, 0, 4]
        assert np.isnan(rb["train_loss"][3]) and rb["fl_bytes_up"][3] == rb["update_norm"][3] == 0
        for name in ("train_loss", "test_loss", "test_acc", "fl_bytes_down", "fl_bytes_up",
                     "n_participants", "update_norm", "lr"):
            assert np.array_equal(ra[name], rb[name], equal_nan=True), name
        assert np.array_equal(a.model(), b.model())
        for name in ("round", "phase", "client", "train_loss", "update_norm"):
            assert np.array_equal(a.clients()[name], b.clients()[name], equal_nan=True), name
        refined = b.clients()["round"][b.clients()["phase"] == 1]
        assert refined.tolist() == [2, 4, 4]
        assert np.all(rb["mpi_bytes"][1:] > 0)


def test_reports_and_plot_titles_say_per_round_is_expected_under_bernoulli():
    from fedmpi.analysis.plot import default_title
    from fedmpi.analysis.run_summary import _experiment

    def clients(**kw):
        return dict(_experiment({"clients": {"num": 100, "per_round": 10, **kw}}))["clients"]

    assert clients() == clients(sampling="uniform") == "100 total, 10 per round"
    assert clients(sampling="bernoulli") == "100 total, 10 expected (bernoulli) per round"
    assert clients(sampling="size") == "100 total, 10 (size-weighted) per round"

    def run(**kw):
        values = {"clients.num": 100, "clients.per_round": 10, **kw}
        return SimpleNamespace(get=lambda key, default=None: values.get(key, default))

    assert default_title([run(), run()]) == "100 clients, 10 per round"
    assert default_title([run(**{"clients.sampling": "bernoulli"})] * 2) == \
        "100 clients, 10 per round, bernoulli sampling"
