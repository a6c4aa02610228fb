"""The one-run privacy audit (``privacy.audit_canaries``; fedmpi.audit, the Canaries
stage of fedmpi.runtime.dp): its statistics in closed form, and on real runs a lower
bound that is large without noise and below the accountant's epsilon with it, the same
after a resume and on 3 ranks."""

import math
import sys

import h5py
import numpy as np
import pytest

import fedmpi.analysis as fa
from fedmpi import audit
from fedmpi.analysis.report import report_table
from fedmpi import config as cfg
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

from conftest import fedmpi, mpirun, needs_mpi
from helpers import TINY, merged, run_and_resume, run_file, write_config


def test_every_guess_right_without_delta_is_randomised_response_s_bound():
    """delta = 0, v = r: the p-value is q^r, q = e^eps / (1 + e^eps); the bound is the eps
    where q^r equals the level."""
    for r, level in ((20, 0.05), (100, 0.0125), (500, 0.01)):
        q = level ** (1 / r)
        assert audit.epsilon_lower_bound(10 * r, r, r, 0.0, level) == \
            pytest.approx(math.log(q / (1 - q)), abs=1e-5)


def test_the_p_value_is_the_paper_s_sum_written_out():
    m, r, v, eps, delta = 1000, 60, 45, 0.8, 1e-5
    q = math.exp(eps) / (1 + math.exp(eps))
    pmf = [math.comb(r, k) * q ** k * (1 - q) ** (r - k) for k in range(r + 1)]
    alpha = max(sum(pmf[v - i:v]) / i for i in range(1, v + 1))
    want = sum(pmf[v:]) + 2 * m * delta * alpha
    assert audit.p_value(m, r, v, eps, delta) == pytest.approx(want, rel=1e-10)
    assert audit.p_value(m, r, v, 50.0, 0.1) == 1.0      # capped
    with pytest.raises(ValueError, match="0 <= v <= r <= m"):
        audit.p_value(10, 20, 5, 1.0, 0.0)


def test_scores_that_know_nothing_bound_nothing_and_perfect_ones_bound_the_most():
    rng = np.random.default_rng(7)
    included = rng.random(1000) < 0.5
    blind = audit.audit(rng.normal(size=1000), included, 1e-5)
    assert blind["audit_epsilon"] < 0.5
    perfect = audit.audit(included.astype(float), included, 1e-5)
    inside = int(included.sum())   # k of each side all right while k <= min(in, out)
    bounds = {2 * k: audit.epsilon_lower_bound(1000, 2 * k, 2 * k - max(0, k - inside)
                                               - max(0, k - (1000 - inside)), 1e-5, 0.05 / 4)
              for k in (50, 100, 250, 500)}
    assert perfect["audit_epsilon"] == max(bounds.values()) > 4.5
    assert bounds[perfect["audit_guesses"]] == perfect["audit_epsilon"]
    assert audit.audit(np.zeros(1), np.ones(1, bool), 1e-5)["audit_epsilon"] == 0.0


# 100 clients, half a round by Poisson sampling (an empty draw: 2^-100), 1000 canaries,
# 8 rounds (an included canary never drawn: 2^-8)
AUDITED = merged({**TINY, "partition": {"kind": "iid"}}, rounds=8,
                 clients={"num": 100, "per_round": 50, "sampling": "bernoulli"},
                 system={**TINY["system"], "deterministic": True, "checkpoint_every": 3},
                 privacy={"mechanism": "central", "clip": 1.0, "delta": 1e-5,
                          "audit_canaries": 1000})


def audited(tmp_path, name, sigma):
    path = tmp_path / f"{name}.h5"
    values = merged(AUDITED, privacy={**AUDITED["privacy"], "noise_multiplier": sigma})
    run_experiment(cfg.from_dict({**values, "output": str(path)}), LocalComm(), quiet=True)
    return path


def test_without_noise_the_audit_finds_the_canaries_and_with_noise_stays_below_epsilon(tmp_path):
    with RunFile(audited(tmp_path, "open", 0.0)) as run:
        rounds = run.rounds()
        assert run.attrs["privacy_audit_canaries"] == 1000
    assert np.isnan(rounds["audit_epsilon"][:-1]).all()        # the last round's only
    assert rounds["audit_epsilon"][-1] > 4                    # 1000 canaries can show ~4.7
    assert rounds["audit_correct"][-1] >= 0.95 * rounds["audit_guesses"][-1]
    noisy = audited(tmp_path, "noisy", 1.0)
    with RunFile(noisy) as run:
        last = {k: v[-1] for k, v in run.rounds().items()}
    assert 0 < last["audit_epsilon"] < last["epsilon"]
    # fedmpi report: epsilon and the audit's bound, as columns of their own
    csv = report_table(fa.load(noisy, tmp_path / "open.h5"), fmt="csv").splitlines()
    head, rows = csv[0].split(","), sorted(line.split(",") for line in csv[1:])
    for row in rows:
        cell = dict(zip(head, row))
        private = cell["privacy.noise_multiplier"] == "1.0"
        assert float(cell["epsilon_mean"]) == (last["epsilon"] if private else math.inf)
        assert (float(cell["audit_epsilon_mean"]) == last["audit_epsilon"]) == private
    text = report_table(fa.load(noisy), fmt="text")
    assert " ε " in text.splitlines()[0] and "audit ε" in text.splitlines()[0]
    assert "audit ε: the one-run audit's lower bound on epsilon (95% confidence)" in text


@pytest.mark.slow
def test_a_resumed_audit_is_the_uninterrupted_one(tmp_path):
    values = merged(AUDITED, privacy={**AUDITED["privacy"], "noise_multiplier": 1.0})
    crashed, _ = run_and_resume(values, tmp_path)    # from the checkpoint after round 6
    ref = tmp_path / "ref.h5"
    with h5py.File(ref, "r") as f:
        assert f["checkpoint"].attrs["round"] == 6
    with RunFile(ref) as a, RunFile(crashed) as b:
        assert np.array_equal(a.model(), b.model())
        for name in ("audit_epsilon", "audit_correct", "epsilon", "test_acc"):
            assert np.array_equal(a.rounds()[name], b.rounds()[name], equal_nan=True)


@pytest.mark.slow
@needs_mpi
def test_an_audited_run_with_adaptive_clipping_is_bitwise_the_same_on_3_ranks(tmp_path):
    """Canaries, central noise and adaptive clipping's noisy count: the server's stages
    and the clip it sends down each round are the same for any number of workers."""
    private = {**AUDITED["privacy"], "noise_multiplier": 1.0, "clip": 0.05, "clip_quantile": 0.5}
    values = merged(AUDITED, privacy=private)
    config = write_config(tmp_path / "audit.toml", values)
    mpirun(3, [sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o",
               str(tmp_path / "n3.h5")])
    run_experiment(cfg.from_dict({**values, "output": str(tmp_path / "one.h5")}), LocalComm(),
                   quiet=True)
    with RunFile(tmp_path / "one.h5") as a, RunFile(tmp_path / "n3.h5") as b:
        assert np.array_equal(a.model(), b.model())
        assert len(set(a.rounds()["dp_clip"][1:])) == 8
        for name in ("audit_epsilon", "audit_correct", "epsilon", "dp_clip", "dp_unclipped"):
            assert np.array_equal(a.rounds()[name], b.rounds()[name], equal_nan=True)


@pytest.mark.parametrize("privacy, clients, message", [
    ({"mechanism": "off", "audit_canaries": 10}, {},
     "privacy.audit_canaries: needs privacy.mechanism = \"central\""),
    ({"audit_canaries": 1}, {}, "privacy.audit_canaries: must be 0 (no audit) or from 2 to"),
    ({"audit_canaries": -5}, {}, "privacy.audit_canaries: must be 0 (no audit) or from 2 to"),
    ({"audit_canaries": 10 ** 20}, {}, "privacy.audit_canaries"),
    ({"audit_canaries": 10}, {"sampling": "uniform"},
     "privacy.audit_canaries: the canaries join rounds as Poisson-sampled clients"),
])
def test_an_audit_that_cannot_be_run_is_refused(privacy, clients, message):
    values = merged(AUDITED, privacy={**AUDITED["privacy"], **privacy},
                    clients={**AUDITED["clients"], **clients})
    with pytest.raises(UsageError, match=__import__("re").escape(message)):
        cfg.from_dict(values)


def test_more_canaries_than_coordinates_is_one_line_exit_2_and_no_file(tmp_path):
    out = tmp_path / "run.h5"
    values = merged(AUDITED, privacy={**AUDITED["privacy"], "audit_canaries": 90_000},
                    output=str(out))
    proc = fedmpi(["run", str(write_config(tmp_path / "big.toml", values)), "-q"])
    assert proc.returncode == 2 and not out.exists(), proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert line.startswith("fedmpi: config field privacy.audit_canaries: each canary has a "
                           "coordinate of its own; at most the model's ")


@pytest.mark.parametrize("name", ["lg_fedavg", "fedper"])
def test_the_audit_with_private_layers_places_its_canaries_among_the_shared_ones(tmp_path, name):
    """Only the shared coordinates are released, so the canaries are among them and are
    scored there: without noise the audit finds them, whether the shared part is the head
    after a private body (LG-FedAvg: 330 coordinates for 300 canaries) or the body before
    a private head (FedPer); a FedPer without private layers is FedAvg's audit, bit for bit."""
    canaries = {**AUDITED["privacy"], "noise_multiplier": 0.0, "audit_canaries": 300}
    values = merged(AUDITED, rounds=4, algorithm={"name": name}, privacy=canaries)
    with run_file(tmp_path, name, values) as run:
        last = {k: v[-1] for k, v in run.rounds().items()}
        assert run.attrs["shared_params"] < run.attrs["num_params"]
    assert last["audit_correct"] >= 0.95 * last["audit_guesses"] and last["audit_epsilon"] > 2
    plain = merged(values, algorithm={"name": "fedavg"})
    none = merged(values, algorithm={"name": "fedper", "private": []})
    with run_file(tmp_path, "fedavg", plain) as a, run_file(tmp_path, "none", none) as b:
        assert np.array_equal(a.model(), b.model())
        for column in ("audit_epsilon", "audit_correct", "audit_guesses"):
            assert np.array_equal(a.rounds()[column], b.rounds()[column], equal_nan=True)
