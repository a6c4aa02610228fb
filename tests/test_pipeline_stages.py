"""The update pipeline's stages (fedmpi.runtime.participation, stages, aggregate): a new
client stage plugs in without touching the engine and reduces to the method without it;
the participation stage refuses at config time what it cannot run; the per-step gradient
clip's new name, with the old one still read."""

import h5py
import numpy as np
import pytest
import torch

from fedmpi import config as cfg
from fedmpi.algorithms import build
from fedmpi.errors import UsageError
from fedmpi.results import RunFile
from fedmpi.runtime import participation
from fedmpi.runtime.stages import ClientStage, Encode, Staleness, UpdateStatistics, client_stages
from fedmpi.runtime.compression import Compression

from conftest import ROOT, fedmpi
from harness import Simulation, quadratic_task
from helpers import TINY, merged, write_config

CENTERS = {0: [1.0, 0.0], 1: [0.0, 1.0], 2: [2.0, 2.0]}


class ClipUpdate(ClientStage):
    """docs/design.md's example: each update scaled to L2 norm at most ``bound``."""

    def __init__(self, bound: float):
        self.bound = bound

    def upload(self, upload, state, key):
        norm = float(torch.linalg.vector_norm(upload.delta))
        upload.delta = upload.delta * min(1.0, self.bound / max(norm, 1e-12))
        return upload, {}


class Count(ClientStage):
    """Per-client state (participations so far) and an extra sum (participants)."""

    def state_sizes(self):
        return {"count": 1}

    def sums(self, p, d):
        return {"_ones": 1}

    def upload(self, upload, state, key):
        seen = 0.0 if state is None or "count" not in state else float(state["count"][0])
        return upload, {"count": torch.tensor([seen + 1.0])}

    def contribute(self, contribution, upload, meta):
        return {**contribution, "_ones": torch.ones(1)}

    def summarize(self, p, sums, gathered):
        return {"participants_summed": float(sums["_ones"][0])}


def simulate(stages, rounds=1, participants=(0, 1)):
    sim = Simulation(build("fedavg", {}), {c: quadratic_task(c, CENTERS[c]) for c in CENTERS},
                     x0=[0.0, 0.0], stages=stages)
    diagnostics = [sim.round(participants, t=t, lr=0.1) for t in range(rounds)]
    return sim, diagnostics


def test_a_clip_stage_that_never_binds_is_fedavg_bit_for_bit_and_one_that_binds_is_the_closed_form():
    plain, _ = simulate(None)
    loose, _ = simulate([Encode(Compression(None, build("fedavg", {}), 2)), ClipUpdate(1e9)])
    assert torch.equal(plain.state["x"], loose.state["x"])
    # one SGD step from 0: Delta_i = 0.1 c_i, norm 0.1; clipped to 0.05: 0.05 c_i; equal n_i
    tight, _ = simulate([ClipUpdate(0.05)])
    assert tight.state["x"].tolist() == pytest.approx([0.025, 0.025], abs=1e-7)
    assert not torch.equal(plain.state["x"], tight.state["x"])


def test_a_stage_keeps_per_client_state_and_its_extra_sums_stay_out_of_the_server_update():
    plain, _ = simulate(None, rounds=2)
    counted, diagnostics = simulate([Count()], rounds=2)
    assert torch.equal(plain.state["x"], counted.state["x"])   # the algorithm never saw _ones
    assert [d["participants_summed"] for d in diagnostics] == [2.0, 2.0]
    assert {c: float(s["count"][0]) for c, s in counted.client_states.items()} == {0: 2.0, 1: 2.0}
    assert 2 not in counted.client_states   # never took part: no state


def test_the_runs_stages_are_assembled_from_the_config():
    alg = build("fedavg", {})
    plain = cfg.from_dict(merged())
    kinds = [type(s) for s in client_stages(plain, Compression(plain, alg, 10))]
    assert kinds == [Encode, UpdateStatistics]
    buffered = cfg.from_dict(merged(system_model={"profiles": "lognormal", "policy": "fedbuff",
                                                  "concurrency": 4, "buffer": 2}))
    assert [type(s) for s in client_stages(buffered, Compression(buffered, alg, 10))] == \
        [Encode, Staleness, UpdateStatistics]
    assert participation.stage(plain) is participation.Sync
    assert participation.stage(buffered) is participation.Async
    clocked = merged(system_model={"profiles": "lognormal", "policy": "deadline", "deadline": 5.0})
    assert participation.stage(cfg.from_dict(clocked)) is participation.Clocked


def test_the_asynchronous_stage_serves_fedavg_s_server_side_only():
    assert participation.Async.serves("fedavg") and participation.Async.serves("fedprox")
    assert not participation.Async.serves("scaffold")   # its own server update and payload
    assert not participation.Async.serves("fnrfl")      # two phases
    with pytest.raises(UsageError, match="system_model.policy: asynchronous FL serves methods "
                                         "with FedAvg's server side; 'scaffold' has its own"):
        cfg.from_dict(merged(algorithm={"name": "scaffold"},
                             system_model={"profiles": "lognormal", "policy": "fedasync"}))


# ---- train.grad_clip, once train.clip_norm ------------------------------------------------

def test_the_old_name_of_the_gradient_clip_is_read_as_the_new_one():
    old = cfg.from_dict(merged(train={**TINY["train"], "clip_norm": 3.0}))
    new = cfg.from_dict(merged(train={**TINY["train"], "grad_clip": 3.0}))
    assert old.train.grad_clip == 3.0 and old == new and old.digest() == new.digest()
    assert "clip_norm" not in old.to_dict()["train"]
    values = cfg.apply_overrides(merged(), ["train.clip_norm=2.5"])
    assert cfg.from_dict(values).train.grad_clip == 2.5
    # a file with the old name, --set with the new: the --set wins, as for any field
    values = cfg.apply_overrides(merged(train={**TINY["train"], "clip_norm": 3.0}),
                                 ["train.grad_clip=4"])
    assert cfg.from_dict(values).train.grad_clip == 4


def test_both_names_at_once_are_refused_with_one_line_and_no_file(tmp_path):
    out = tmp_path / "run.h5"
    path = write_config(tmp_path / "both.toml", train={**TINY["train"], "clip_norm": 3.0,
                                                       "grad_clip": 3.0}, output=str(out))
    proc = fedmpi(["run", str(path), "-q"])
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip() == ("fedmpi: config field train.grad_clip: given also by its old "
                                   "name train.clip_norm; keep one (train.grad_clip)")


def test_a_results_file_written_with_the_old_name_reads_with_the_new(tmp_path):
    source = ROOT / "tests" / "data" / "results-v1.h5"
    with h5py.File(source, "r") as f:
        assert '"clip_norm"' in f.attrs["config"]   # written before the rename
    with RunFile(source) as run:
        config, attrs = run.config, run.attrs
    assert "clip_norm" not in config["train"] and np.isfinite(config["train"]["grad_clip"])
    assert attrs["config"] == config
