"""benchmarks/peers: the exported workload is fedmpi's work, step for step.

The peer comparison rests on one premise: a runner that follows the workload file
(sampled clients, batch order, initial weights, learning rates) does the SGD steps
``fedmpi run`` does. The bare runner is checked against a real ``fedmpi run`` here;
pfl's and Flower's runners need their own venvs (benchmarks/peers/make_venvs.sh) and
are checked by compare.py itself, which fails on a step count that differs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedmpi import config as cfgmod
from fedmpi.results import RunFile

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

from export import config_values, export  # noqa: E402


def small_w2(rounds: int = 2) -> dict:
    values = config_values("w2", rounds, "2nn")
    values["data"] = {"dataset": "synthetic", "num_train": 600, "num_test": 200,
                      "channels": 1, "size": 28}
    values["clients"] = {"num": 20, "per_round": 4}
    values["system"]["threads"] = 1
    return values


def test_export_refuses_more_than_one_epoch(tmp_path):
    values = small_w2()
    values["train"]["local_epochs"] = 2
    with pytest.raises(ValueError, match="train.local_epochs must be 1 .*got 2"):
        export(values, tmp_path / "w.npz")
    assert not (tmp_path / "w.npz").exists()


def test_compare_refuses_a_missing_peer_venv_before_any_work(tmp_path):
    proc = subprocess.run([sys.executable, str(PEERS / "compare.py"), "w2", "--venvs",
                           str(tmp_path / "none"), "--variants", "bare", "flower"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"compare.py: error: variant flower: no {tmp_path / 'none' / 'flower'}; make it "
        f"with bash benchmarks/peers/make_venvs.sh flower")


def test_a_variant_with_other_steps_fails_the_comparison(tmp_path):
    """The comparison is only of the same work: a runner that took one step less (a
    batch lost at a client's end, a cohort cut short) stops the script."""
    from compare import summarise

    params = tmp_path / "p.npy"
    np.save(params, np.zeros(3, np.float32))
    row = {"rounds": [1.0, 1.0], "steps": 100, "acc": 0.5, "params": str(params), "peak_mb": 1.0}
    assert [r["variant"] for r in summarise([("bare", row), ("pfl", dict(row))], 100)] == \
        ["bare", "pfl"]
    with pytest.raises(SystemExit, match="flower: 99 SGD steps, the workload has 100"):
        summarise([("bare", row), ("flower", {**row, "steps": 99})], 100)


@pytest.mark.slow
def test_bare_runner_does_fedmpis_steps(tmp_path):
    values = small_w2()
    meta = export(values, tmp_path / "w.npz")
    z = np.load(tmp_path / "w.npz")
    assert z["clients"].shape == (2, 4)
    assert meta["steps"] == sum(-(-(z["offsets"][j + 1] - z["offsets"][j]) // 10)
                                for j in range(8))
    bare = subprocess.run([sys.executable, str(PEERS / "run_bare.py"), str(tmp_path / "w.npz"),
                           str(tmp_path), "--threads", "1"], capture_output=True, text=True,
                          check=True)
    result = json.loads(bare.stdout.strip().splitlines()[-1])

    config = tmp_path / "w2.toml"
    config.write_text(cfgmod.to_toml(values))
    subprocess.run([sys.executable, "-m", "fedmpi", "run", "-q", str(config), "-o",
                    str(tmp_path / "run.h5")], check=True, capture_output=True)
    with RunFile(tmp_path / "run.h5") as run:
        steps = int(run.clients()["steps"].sum())
        acc = float(run.rounds()["test_acc"][-1])
        ours = np.concatenate([np.asarray(v, np.float32).reshape(-1)
                               for v in run.state_dict().values()])
    assert result["steps"] == steps == meta["steps"]
    bare_params = np.load(result["params"])
    # the same steps in another summation order: equal up to float rounding
    np.testing.assert_allclose(bare_params, ours, atol=1e-5)
    assert abs(result["acc"] - acc) <= 0.01
