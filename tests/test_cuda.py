"""What only a GPU shows, run where torch finds CUDA (CI has none: there they are skipped;
``FEDMPI_TEST_DEVICE=cpu`` runs the same checks on the CPU, to test the tests).

On the GPU: client groups give each client what the sequential path gives it, for every
method with a group form, and a group's batches gathered at once are each client's own;
a run follows the same run on the CPU and names the GPU's model as its kernels;
deterministic runs are bitwise the same for 1, 2 and 3 ranks (the server on the CPU, two
workers sharing the GPU with the dataset held once per node); a grouped run follows the
sequential one; bf16 and tf32 train; a deterministic run resumes to the bits of the run
that never stopped."""

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmpi import algorithms
from fedmpi.algorithms import ClientTask
from fedmpi.results import RunFile
from fedmpi.runtime.system import kernels, numerics

from conftest import needs_mpi, run_on_ranks
from helpers import TINY, merged, run_and_resume, write_config
from test_client_groups import (GROUP_BATCH_CASES, GROUPED, Samples, assert_same_uploads,
                                check_group_batches, clients, context, flat_model, payload_of,
                                state_of)
from test_client_groups import run_tiny as groups_run_tiny

DEVICE = torch.device(os.environ.get("FEDMPI_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(),
                                reason="no CUDA device (FEDMPI_TEST_DEVICE=cpu runs these on "
                                       "the CPU)")
# the GPU run against the CPU run of the same config: the same arithmetic in other kernels
# (cuDNN, cuBLAS), a few ulps per step, grown over two rounds of a small CNN
ACROSS_DEVICES = dict(rtol=1e-3, atol=1e-4)


def run_tiny(tmp_path, name, device=DEVICE.type, **over):
    """The groups tests' tiny in-process run, on ``device``."""
    system = {**over.pop("system", {}), "device": device}
    return groups_run_tiny(tmp_path, name, system=system, **over)


@pytest.mark.parametrize("model", ["cnn", "cnn-vmap", "2nn"])
@pytest.mark.parametrize("name", GROUPED)
def test_group_form_equals_the_sequential_local_update_on_the_device(name, model):
    """The batched kernels of a group on the GPU (the hand-written gradients of the CNN's
    and the 2NN's chains, vmap over the clients' parameters) against one client at a
    time on the GPU, in FP32 (TF32 off, as a run sets it)."""
    alg = algorithms.build(name, {})
    ctx = context(grad_clip=1.0)
    flat = flat_model(model, device=DEVICE, alg=alg)
    data = [Samples(s.x.to(DEVICE), s.y.to(DEVICE), s.key) for s in clients((9, 9, 6, 3))]
    tasks = [ClientTask(client=i, data=d, model=flat, device=DEVICE) for i, d in enumerate(data)]
    payload = payload_of(alg, flat, ctx)
    states = [{k: v.to(DEVICE) for k, v in state_of(alg, flat.size, i).items()} or None
              for i in range(len(tasks))]
    with numerics(DEVICE, "fp32", deterministic=False):
        one = [alg.local_update(t, payload, s, ctx) for t, s in zip(tasks, states)]
        group = alg.local_update_group(tasks, payload, states, ctx)
    assert group[0].delta.device.type == DEVICE.type
    assert_same_uploads(alg, one, group)


@pytest.mark.parametrize("modality,augment,skew,channels_last,split", GROUP_BATCH_CASES)
def test_a_groups_batches_on_the_device_are_its_clients_own(modality, augment, skew,
                                                           channels_last, split):
    """A group's batches gathered on the GPU at once (the index sent once, pinned) against
    each client's own batches there: the same bits, layout and padding."""
    check_group_batches(DEVICE, modality, augment, skew, channels_last, split)


def test_a_run_on_the_device_follows_the_cpu_run_and_names_its_kernels(tmp_path):
    with run_tiny(tmp_path, "cpu", device="cpu", rounds=2) as cpu, \
            run_tiny(tmp_path, "gpu", rounds=2) as gpu:
        np.testing.assert_allclose(gpu.model(), cpu.model(), **ACROSS_DEVICES)
        a, b = cpu.clients(), gpu.clients()
        for column in ("client", "steps", "n_samples", "bytes_up", "bytes_down"):
            assert np.array_equal(a[column], b[column])
        np.testing.assert_allclose(b["train_loss"], a["train_loss"], rtol=1e-3)
        (rank,) = gpu.attrs["ranks"]
        assert rank["device"].split(":")[0] == DEVICE.type
        assert rank["kernels"] == kernels(DEVICE)
        if DEVICE.type == "cuda":
            assert rank["kernels"] == torch.cuda.get_device_name(0)


def test_auto_groups_train_the_cnn_on_the_device(tmp_path):
    """On a GPU, where a small client's step leaves the device idle, "auto" groups the
    CNN's clients without timing them; on a CPU worker it groups them only where the
    set-up's probe timed the group faster, and the file records the probe."""
    with run_tiny(tmp_path, "auto", rounds=1,
                  system={"client_group": "auto", "threads": 1}) as run:
        if DEVICE.type == "cuda":
            assert run.attrs["client_group"] == TINY["clients"]["per_round"]
            assert "client_group_probe" not in run.attrs
        else:
            probe = run.attrs["client_group_probe"]
            faster = probe["group_s"] * 1.05 <= probe["sequential_s"]
            assert run.attrs["client_group"] == probe["chosen"] == (probe["group"] if faster
                                                                      else 1)


def test_a_grouped_run_on_the_device_follows_the_sequential_run(tmp_path):
    """SCAFFOLD: control variates through the client-state store, staged to the GPU on a
    side stream, in groups of 3."""
    one = run_tiny(tmp_path, "one", algorithm={"name": "scaffold"})
    grouped = run_tiny(tmp_path, "grouped", algorithm={"name": "scaffold"},
                       system={"client_group": 3})
    with one, grouped:
        np.testing.assert_allclose(grouped.model(), one.model(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(grouped.clients()["train_loss"], one.clients()["train_loss"],
                                   rtol=1e-4)


def test_fp32_is_fp32_on_the_device_and_tf32_is_not():
    """Under a run's "fp32" numerics a matrix product and a convolution on the device
    are FP32's (norm-wise within 1e-5 of float64; TF32's 10-bit mantissa is about 1e-4
    off), whichever API this torch uses for TF32; under "tf32" on a GPU that has it, the
    products are TF32's."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=gen), torch.randn(512, 256, generator=gen)
    x, w = torch.randn(8, 16, 20, 20, generator=gen), torch.randn(32, 16, 5, 5, generator=gen)
    exact = (a.double() @ b.double(), F.conv2d(x.double(), w.double()))

    def errors(precision):
        with numerics(DEVICE, precision, deterministic=False):
            got = ((a.to(DEVICE) @ b.to(DEVICE)).cpu(),
                   F.conv2d(x.to(DEVICE), w.to(DEVICE)).cpu())
        return [float((g.double() - e).norm() / e.norm()) for g, e in zip(got, exact)]

    assert max(errors("fp32")) < 1e-5
    if DEVICE.type == "cuda" and torch.cuda.get_device_capability(DEVICE) >= (8, 0):
        assert min(errors("tf32")) > 1e-5


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_reduced_precisions_train_on_the_device(tmp_path, precision):
    if DEVICE.type == "cpu" and precision == "bf16":
        pytest.skip("bf16 on the CPU needs AVX512-BF16 or AMX; tests/test_system.py covers it")
    train = {"local_epochs": 3, "lr": 0.1}   # TINY's loss then falls 2.08 -> 1.84 in FP32
    with run_tiny(tmp_path, precision, train=train, system={"precision": precision}) as run, \
            run_tiny(tmp_path, "fp32", train=train) as fp32:
        loss, reference = run.rounds()["train_loss"], fp32.rounds()["train_loss"]
        assert np.isfinite(run.model()).all()
        assert loss[-1] < loss[1] - 0.1
        np.testing.assert_allclose(loss[1:], reference[1:], atol=0.05)


@pytest.mark.slow
@needs_mpi
def test_deterministic_runs_on_the_device_are_bitwise_the_same_for_1_2_and_3_ranks(tmp_path):
    """One process (server and worker on the GPU), a CPU server with one GPU worker, and
    a CPU server with two workers sharing the GPU (the dataset once per node): FedDyn in
    groups of 2, client state on the server, the same bits."""
    config = write_config(tmp_path / "d.toml", rounds=2, algorithm={"name": "feddyn"},
                          system={"device": DEVICE.type, "gpu_share": True,
                                  "deterministic": True, "client_group": 2})
    models, ranks = [], []
    for out in run_on_ranks(config, (1, 2, 3), tmp_path).values():
        with RunFile(out) as run:
            models.append(run.model())
            ranks.append(run.attrs["ranks"])
    assert np.array_equal(models[0], models[1]) and np.array_equal(models[0], models[2])
    workers = [r for r in ranks[2] if r["rank"] > 0]
    assert [r["device"].split(":")[0] for r in workers] == [DEVICE.type] * 2
    assert ranks[2][0]["device"] == "cpu"


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "bulyan", "krum", "geomed"])
def test_robust_blocks_on_the_device_are_the_host_s_rules(rule):
    """A robust rule's blocks sorted and multiplied on the device (torch) against the
    host's (numpy, float64 products): the same aggregate and weights, to rounding."""
    from fedmpi import config as cfg
    from fedmpi.comm import LocalComm
    from fedmpi.runtime import robust
    from fedmpi.runtime.gram import weighted_sum
    config = cfg.from_dict({"clients": {"num": 20, "per_round": 11},
                            "robust": {"aggregator": rule, "f": 2}})
    coef = None if rule in robust.COORDINATE else robust.coefficients(rule, config)
    per_block = robust.coordinate_rule(rule, 2) \
        if rule in robust.COORDINATE or rule == "bulyan" else None
    g = torch.Generator().manual_seed(3)
    vectors = [torch.randn(300, generator=g) for _ in range(11)]
    vectors[4] += 20.0
    host = weighted_sum(LocalComm(), vectors, [np.arange(11)], 300, coef, block=64,
                        per_block=per_block)
    device = weighted_sum(LocalComm(), vectors, [np.arange(11)], 300, coef, block=64,
                          per_block=per_block, device=DEVICE)
    assert torch.allclose(host[0], device[0], rtol=1e-6, atol=1e-7)
    assert np.allclose(host[1], device[1], rtol=1e-9, atol=1e-12)


@pytest.mark.slow
@needs_mpi
def test_a_robust_run_on_the_device_is_bitwise_the_same_for_1_2_and_3_ranks(tmp_path):
    """The median's blocks on the GPU of whichever rank owns them: the same bits for one
    process, one GPU worker and two workers sharing the GPU."""
    config = write_config(tmp_path / "r.toml", rounds=2, robust={"aggregator": "median"},
                          system={"device": DEVICE.type, "gpu_share": True,
                                  "deterministic": True})
    models = []
    for out in run_on_ranks(config, (1, 2, 3), tmp_path).values():
        with RunFile(out) as run:
            models.append(run.model())
    assert np.array_equal(models[0], models[1]) and np.array_equal(models[0], models[2])


def test_a_deterministic_run_on_the_device_resumes_to_the_uninterrupted_bits(tmp_path):
    """Augmentation draws on the GPU, keyed per client, and SCAFFOLD's control variates
    come back from the checkpoint: a run that died after round 4 resumes from its round-2
    checkpoint to the same model."""
    values = merged(TINY, rounds=4, data={"augment": True},
                    algorithm={"name": "scaffold"},
                    system={"device": DEVICE.type, "deterministic": True,
                            "checkpoint_every": 2})
    crashed, exp = run_and_resume(values, tmp_path)
    assert exp.start == 2
    with RunFile(tmp_path / "ref.h5") as a, RunFile(crashed) as b:
        assert np.array_equal(a.model(), b.model())
        assert np.array_equal(a.rounds()["test_acc"], b.rounds()["test_acc"], equal_nan=True)
