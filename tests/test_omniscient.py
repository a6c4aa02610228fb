"""The colluding attacks (fedmpi.runtime.omniscient): ALIE, IPM, min-max and min-sum made
where the updates are, each equal to a direct numpy reference over the gathered updates
(the min-max/min-sum gamma also to the paper's step-halving search), the same bits for 1,
2 and 3 ranks, and what the rule made of the attackers in /clients."""

import sys
from statistics import NormalDist

import numpy as np
import pytest
import torch

from fedmpi import config as cfg
from fedmpi.comm import LocalComm
from fedmpi.runtime import omniscient, robust
from fedmpi.runtime.gram import weighted_sum

from conftest import mpirun, needs_mpi
from helpers import TINY, assert_same_on_ranks, merged, run_file

N, D = 9, 50
BAD = np.array([2, 5])


def _x(seed=0):
    return np.random.default_rng(seed).normal(size=(N, D))


def _attack(kind, direction="std", scale=1.0):
    config = cfg.from_dict(merged(TINY, attack={"kind": kind, "fraction": 0.2, "scale": scale,
                                                "direction": direction},
                                  robust={"aggregator": "mean"}))
    return omniscient.CohortAttack(config, BAD)


def _poisoned_mean(x, kind, **kw):
    """The plain mean of the rows as the attack leaves them, through the sharded path."""
    total, _ = weighted_sum(LocalComm(), [torch.from_numpy(v).float() for v in x], [np.arange(N)],
                            D, None, block=16, per_block=robust.coordinate_rule("mean", 0),
                            cohort=_attack(kind, **kw))
    return total.numpy().astype(np.float64)


def _benign(x):
    good = np.setdiff1d(np.arange(N), BAD)
    x32 = x.astype(np.float32).astype(np.float64)   # the vectors travel as float32
    return x32, x32[good]


def _with(x, bad_row):
    out = x.copy()
    out[BAD] = bad_row
    return out.mean(axis=0)


def test_alie_sends_mu_minus_z_sigma_with_the_paper_s_z():
    x, good = _benign(_x())
    s = int(np.floor(N / 2 + 1)) - len(BAD)
    z = NormalDist().inv_cdf((N - s) / N)
    ref = _with(x, good.mean(axis=0) - z * good.std(axis=0, ddof=1))
    assert np.allclose(_poisoned_mean(x, "alie"), ref, atol=1e-6)


def test_ipm_sends_minus_epsilon_times_the_benign_mean():
    x, good = _benign(_x(1))
    ref = _with(x, -0.5 * good.mean(axis=0))
    assert np.allclose(_poisoned_mean(x, "ipm", scale=0.5), ref, atol=1e-6)


def _search(good, p, fits, init=10.0, tol=1e-5):
    """Shejwalkar and Houmansadr's step-halving search for the largest gamma that fits."""
    lam, step, best = init, init / 2, 0.0
    while abs(step) > tol:
        if fits(good.mean(axis=0) + lam * p):
            best = lam
            lam += step
        else:
            lam -= step
        step /= 2
    return best


@pytest.mark.parametrize("kind", ["min_max", "min_sum"])
@pytest.mark.parametrize("direction", ["std", "sign", "unit"])
def test_min_max_and_min_sum_take_the_largest_gamma_that_fits(kind, direction):
    x, good = _benign(_x(2))
    mu = good.mean(axis=0)
    p = {"std": -good.std(axis=0, ddof=1), "sign": -np.sign(mu),
         "unit": -mu / np.linalg.norm(mu)}[direction]
    dist = ((good[:, None] - good[None]) ** 2).sum(axis=2)
    if kind == "min_max":
        def fits(v):
            return ((good - v) ** 2).sum(axis=1).max() <= dist.max()
    else:
        def fits(v):
            return ((good - v) ** 2).sum() <= dist.sum(axis=1).max()
    gamma = _search(good, p, fits, init=100.0, tol=1e-9)
    got = _poisoned_mean(x, kind, direction=direction)
    bad = (got * N - np.delete(x, BAD, axis=0).sum(axis=0)) / len(BAD)
    exact = np.linalg.norm(bad - mu) / np.linalg.norm(p)
    assert np.isclose(exact, gamma, rtol=1e-4)
    assert fits(mu + exact * (1 - 1e-6) * p) and not fits(mu + exact * (1 + 1e-3) * p)


def test_no_attack_where_a_round_has_no_attacker_or_no_benign_client():
    attack = _attack("alie")
    assert attack.round(np.array([0, 1, 3])) is None
    assert attack.round(np.array([2, 5])) is None
    assert attack.round(np.array([1, 2])) is not None


def test_alie_moves_the_median_and_the_record_says_who_counted(tmp_path):
    """ALIE's rows sit inside the benign spread, so the median takes them: the attackers'
    robust_weight is not 0, and each round's weights sum to 1."""
    values = merged(TINY, rounds=2, clients={**TINY["clients"], "per_round": 8},
                    attack={"kind": "alie", "fraction": 0.25}, robust={"aggregator": "median"})
    with run_file(tmp_path, "alie", values) as r:
        c = r.clients()
        bad = set(r.partition()["malicious"].tolist())
    assert set(c["malicious"][np.isin(c["client"], list(bad))]) == {1}
    for t in (1, 2):
        w = c["robust_weight"][c["round"] == t]
        assert np.isclose(w.sum(), 1.0)
    attackers = np.isin(c["client"], list(bad))
    assert attackers.any() and c["robust_weight"][attackers].sum() > 0


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("kind, rule, ranks", [("alie", "median", 2), ("min_max", "bulyan", 3),
                                               ("min_sum", "krum", 3)])
def test_a_cohort_attack_is_the_same_bits_for_1_and_n_ranks(tmp_path, kind, rule, ranks):
    values = merged(TINY, system={**TINY["system"], "deterministic": True},
                    clients={**TINY["clients"], "per_round": 8},
                    robust={"aggregator": rule, "f": 1},
                    attack={"kind": kind, "fraction": 0.25})
    assert_same_on_ranks(tmp_path, values, ranks, client_columns=("robust_weight",))


@pytest.mark.slow
@needs_mpi
@pytest.mark.parametrize("ranks, rule", [(2, "trimmed_mean"), (3, "bulyan"), (5, "krum"),
                                         (5, "median")])
def test_the_sharded_rule_is_the_gather_on_rank_0_reference_bit_for_bit(ranks, rule):
    """benchmarks/robust.py --check: the rule as a run computes it (transpose, blocks) and
    the same rule over every update gathered on rank 0, the same bits."""
    import json
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "robust.py"
    proc = mpirun(ranks, [sys.executable, str(script), "--mode", "reduce", "--rule", rule,
                          "--params", "150000", "--clients", "11", "--repeat", "1", "--check"])
    assert json.loads(proc.stdout)["sharded_equals_gathered"] is True


@pytest.mark.parametrize("device, says", [("nope", "--device 'nope': give cpu, cuda or cuda:N"),
                                          ("cuda:0", "torch finds no CUDA device here")])
def test_the_robust_benchmark_refuses_a_device_it_cannot_use(device, says):
    """One line from argparse, exit 2, before any MPI or work (a GPU machine: only the
    bad name)."""
    import subprocess
    from pathlib import Path
    if device != "nope" and torch.cuda.is_available():
        pytest.skip("this machine has the device")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "robust.py"
    proc = subprocess.run([sys.executable, str(script), "--device", device],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(says)

