"""Weight decay under client momentum (fedmpi.algorithms.momentum): where the decay acts
is a recorded choice, ``decay = "matched" | "code"``, and each method declares the decay
per unit of gradient it amounts to at its fixed point (``effective_weight_decay``).

Checked here: the fixed point on a quadratic client is the closed form of the declared
effective decay, for every method and placement; FedMIM(alpha = (a, 0), beta = 0) is
FedCM(alpha = 1 - a) with a decay, under either placement; the results file records
the choice and the effective decay; a file from before the parameter resumes as it ran."""

import json

import h5py
import numpy as np
import pytest

from fedmpi import config as cfgmod
from fedmpi.algorithms import build
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

from conftest import fedmpi
from harness import Simulation, quadratic_task
from helpers import TINY, merged
from test_alg_fedmim import CENTERS, fedcm_reference
from test_checkpoint import assert_same_run, reference_and_crash

CENTER = [2.0, -1.0, 0.5]
WD = 0.2


@pytest.mark.parametrize("name, params, effective", [
    ("fedavg", {}, WD),
    ("fedcm", {"alpha": 0.5}, WD),
    ("fedcm", {"alpha": 0.5, "decay": "code"}, WD / 0.5),
    ("mofedsam", {"alpha": 0.25, "rho": 0.0, "decay": "code"}, WD / 0.25),
    ("fedmim", {"J": 1, "alpha": [0.6], "beta": [0.0]}, WD),
    ("fedmim", {"J": 1, "alpha": [0.6], "beta": [0.0], "decay": "code"}, WD / 0.4),
])
def test_fixed_point_is_the_declared_effective_decay(name, params, effective):
    """One client, f(w) = 0.5 ||w - c||^2: at the fixed point the local steps stop moving
    and m is 0, so g + lambda_eff w = 0, x* = c / (1 + lambda_eff) in closed form."""
    alg = build(name, params)
    assert alg.effective_weight_decay(WD) == pytest.approx(effective)
    sim = Simulation(alg, {0: quadratic_task(0, CENTER, steps=3)}, x0=[0.0, 0.0, 0.0])
    for t in range(300):
        sim.round([0], t=t, lr=0.1, lr_prev=0.1, weight_decay=WD)
    expected = np.asarray(CENTER) / (1 + effective)
    np.testing.assert_allclose(sim.state["x"].numpy(), expected, rtol=1e-4, atol=1e-5)


def test_the_code_placement_decays_ten_times_fedavgs_at_alpha_point_one():
    assert build("fedcm", {"decay": "code"}).effective_weight_decay(1e-3) == pytest.approx(1e-2)
    assert build("fedcm", {}).effective_weight_decay(1e-3) == 1e-3
    assert build("fedmrur", {"decay": "code"}).effective_weight_decay(5e-4) == pytest.approx(5e-3)
    assert build("fedcm", {"alpha": 0.0, "decay": "code"}).effective_weight_decay(1e-3) == float("inf")
    assert build("fedcm", {"alpha": 0.0, "decay": "code"}).effective_weight_decay(0.0) == 0.0


SCHEDULE = [[0, 1, 2], [0, 2], [1, 2], [0, 1, 2], [0, 1]]


@pytest.mark.parametrize("decay", ["matched", "code"])
def test_fedmim_reduces_to_fedcm_with_weight_decay(decay):
    """The FedMIM paper's reduction, now with wd > 0: FedMIM(alpha = (a, 0), beta = 0) is
    FedCM(alpha = 1 - a) under the same placement (equal n_i and K, no clipping: FedMIM
    clips g, FedCM the mixed v)."""
    a, wd = 0.7, 0.05
    tasks = lambda: {c: quadratic_task(c, CENTERS[c], steps=3, num_samples=20) for c in CENTERS}  # noqa: E731
    mim = Simulation(build("fedmim", {"alpha": [a, 0.0], "beta": [0.0, 0.0], "decay": decay}),
                     tasks(), x0=[0.0, 0.0, 0.0])
    cm = Simulation(build("fedcm", {"alpha": 1 - a, "decay": decay}), tasks(), x0=[0.0, 0.0, 0.0])
    reference = fedcm_reference(1 - a, 3, SCHEDULE, 0.2, wd, decay)
    for t, clients in enumerate(SCHEDULE):
        mim.round(clients, t=t, lr=0.2, weight_decay=wd)
        cm.round(clients, t=t, lr=0.2, weight_decay=wd)
        np.testing.assert_allclose(mim.state["x"].numpy(), cm.state["x"].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(cm.state["x"].numpy(), reference[t], rtol=1e-5, atol=1e-6)
    # the placements differ: the other one is not this one
    other = fedcm_reference(1 - a, 3, SCHEDULE, 0.2, wd, "code" if decay == "matched" else "matched")
    assert not np.allclose(cm.state["x"].numpy(), other[-1], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", ["fedcm", "mofedsam", "fedmrur", "fedmim"])
def test_a_bad_placement_is_one_line(name):
    with pytest.raises(UsageError, match=r"^config field algorithm.decay: 'inside' is not allowed; "
                                         r"choose one of matched, code$"):
        build(name, {"decay": "inside"})


def tiny_run(tmp_path, name, algorithm, wd):
    values = merged(TINY, rounds=2, algorithm={"name": name, **algorithm},
                    train={"weight_decay": wd}, system={"deterministic": True})
    values["output"] = str(tmp_path / f"{name}-{algorithm.get('decay', 'default')}.h5")
    run_experiment(cfgmod.from_dict(values), LocalComm(), quiet=True)
    return values["output"]


def test_results_file_records_the_placement_and_the_effective_decay(tmp_path):
    code = tiny_run(tmp_path, "fedcm", {"decay": "code"}, 1e-3)
    matched = tiny_run(tmp_path, "fedcm", {}, 1e-3)
    fedavg = tiny_run(tmp_path, "fedavg", {}, 1e-3)
    with RunFile(code) as a, RunFile(matched) as b, RunFile(fedavg) as c:
        assert a.config["algorithm"]["decay"] == "code" and b.config["algorithm"]["decay"] == "matched"
        assert a.attrs["effective_weight_decay"] == pytest.approx(1e-2)
        assert b.attrs["effective_weight_decay"] == c.attrs["effective_weight_decay"] == 1e-3
        assert not np.array_equal(a.model(), b.model())   # the placement changed the training
    out = fedmpi(["report", code], check=True).stdout
    assert "weight decay 0.001 a step; effective 0.01 (algorithm.decay = 'code')" in out
    assert "weight decay 0.001 a step; effective 0.001" in fedmpi(["report", fedavg], check=True).stdout


def test_a_file_from_before_the_parameter_resumes_with_the_placement_it_ran(tmp_path):
    """Files written before ``decay`` existed ran FL-Simulator's placement and record no
    ``decay``: a resume must finish them so, not switch to today's default halfway."""
    ref, crashed = reference_and_crash(tmp_path, algorithm={"name": "fedcm", "decay": "code"},
                                       train={"weight_decay": 0.01})
    with h5py.File(crashed, "r+") as f:
        config = json.loads(f.attrs["config"])
        del config["algorithm"]["decay"]
        f.attrs["config"] = json.dumps(config)
        f.attrs["status"] = "interrupted"   # stopped by a signal: no writer left to check
    proc = fedmpi(["run", "--resume", crashed], check=True)
    assert proc.stderr.count("algorithm.decay = 'code': the file predates the parameter") == 1
    with RunFile(ref) as a, RunFile(crashed) as b:
        assert b.status == "completed"
        assert_same_run(a, b)


@pytest.mark.parametrize("name, params", [("fedcm", {}), ("fedcm", {"decay": "code"}),
                                          ("mofedsam", {"rho": 0.1}),
                                          ("mofedsam", {"rho": 0.1, "decay": "code"})])
def test_client_groups_place_the_decay_as_one_client_after_another(name, params):
    from test_client_groups import assert_same_uploads, both_paths, context

    assert_same_uploads(*both_paths(name, context(weight_decay=1e-2), params=params))
