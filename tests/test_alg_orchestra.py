"""Orchestra: Sinkhorn-Knopp by hand, the equal-size K-means and the server's SGD
clustering on separable points, the setup round, one local update re-derived with plain
modules (clustering + rotation loss, EMA before each step, memory, local centroids),
placement independence, refusals, and real runs: status completed, FL bytes the declared
closed form for both target placements."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedmpi import config as cfgmod
from fedmpi.algorithms import build
from fedmpi.algorithms.base import ClientData, ClientTask, RoundContext
from fedmpi.algorithms.clustering import equal_size_kmeans, generator_for, sgd_clustering, sinkhorn
from fedmpi.algorithms.orchestra import rotated
from fedmpi.comm import LocalComm
from fedmpi.errors import UsageError
from fedmpi.flat import FlatModel
from fedmpi.models import build_model
from fedmpi.results import RunFile
from fedmpi.runtime import run_experiment

from helpers import SSL, merged

HEADS = {"proj_dim": 6, "proj_hidden": 8}
BACKBONE = {"hidden": 8, "channels": [2, 3]}
B, TAU = 4, 0.9
SMALL = {"proj_dim": 16, "proj_hidden": 32, "global_clusters": 8, "local_clusters": 4,
         "memory_size": 32, "global_iters": 20}


class FixedViews(ClientData):
    """Two fixed 'augmented' views of 2B images: the steps are reproducible by hand."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.v1 = torch.rand(2 * B, 1, 16, 16, generator=g)
        self.v2 = torch.rand(2 * B, 1, 16, 16, generator=g)
        self.y = torch.zeros(2 * B, dtype=torch.long)
        self.num_samples = 2 * B

    def view_batches(self, epochs, batch_size):
        for _ in range(epochs):
            for i in range(0, self.num_samples, batch_size):
                yield (self.v1[i:i + batch_size], self.v2[i:i + batch_size]), self.y[i:i + batch_size]


def setup(seed=0, client=0, **params):
    alg = build("orchestra", {**HEADS, "global_clusters": 3, "local_clusters": 2,
                              "memory_size": 8, **params})
    torch.manual_seed(seed)
    flat = FlatModel(alg.build_model(build_model, "cnn", 1, 10, 16, dict(BACKBONE)))
    task = ClientTask(client=client, data=FixedViews(seed), model=flat, device=torch.device("cpu"))
    return alg, task


def ctx(lr=0.1, round=1, participants=(0,)):
    return RoundContext(round=round, phase="train", lr=lr, lr_prev=lr, global_lr=1.0,
                        weight_decay=0.0, grad_clip=0.0, local_epochs=1, batch_size=B,
                        num_clients=4, participants=participants, seed=0)


def unit_centroids(alg, seed=5):
    g = torch.Generator().manual_seed(seed)
    p = alg.params
    return F.normalize(torch.randn(p.global_clusters, p.proj_dim, generator=g), dim=1).reshape(-1)


def payload(alg, x, centroids):
    out = {"x": x, "centroids": centroids}
    if alg.params.target == "global":
        out["target"] = x[:alg.target_size(len(x))].clone()
    return out


def flat_of(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


# ---- Sinkhorn-Knopp and the clusterings ----------------------------------------------------

def test_sinkhorn_one_iteration_by_hand_and_its_marginals():
    s = torch.tensor([[0.9, 0.1], [0.8, 0.3], [0.2, 0.7]], dtype=torch.float64)
    lam = 2.0
    # by hand: Q = softmax(lam s) per row; u = 1/K / (Q^T 1/N); v = 1/N / (Q u); N diag(v) Q diag(u)
    q = torch.exp(lam * s) / torch.exp(lam * s).sum(1, keepdim=True)
    u = (1 / 2) / (q.T @ torch.full((3,), 1 / 3, dtype=torch.float64))
    v = (1 / 3) / (q @ u)
    expected = 3 * v[:, None] * q * u[None, :]
    assert torch.allclose(sinkhorn(s, lam, max_iters=1), expected, atol=1e-12)
    # every sample's mass is exactly 1 after any number of iterations ...
    assert torch.allclose(expected.sum(1), torch.ones(3, dtype=torch.float64), atol=1e-12)
    # ... and iterating balances the centroids: N / K = 1.5 each
    p = sinkhorn(s, lam, max_iters=200, tol=0.0)
    assert torch.allclose(p.sum(1), torch.ones(3, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(p.sum(0), torch.full((2,), 1.5, dtype=torch.float64), atol=1e-9)
    assert not torch.allclose(q.sum(0), torch.full((2,), 1.5, dtype=torch.float64), atol=1e-2)


def separable(k=4, per=8, dim=6, noise=0.05, seed=0):
    """k orthogonal unit directions, ``per`` noisy unit points around each."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.eye(dim)[:k]
    noisy = centres.repeat_interleave(per, 0) + noise * torch.randn(k * per, dim, generator=g)
    points = F.normalize(noisy, dim=1)
    return centres, points


def matched(found, centres):
    """Each true centre's best cosine among ``found``, and which it was."""
    cos = centres @ found.T
    return cos.max(1).values, cos.argmax(1)


def test_equal_size_kmeans_recovers_separable_clusters_with_equal_sizes():
    centres, points = separable()
    found = equal_size_kmeans(points, 4, 5, torch.Generator().manual_seed(1), lam=25.0,
                              sinkhorn_iters=10)
    best, which = matched(found, centres)
    assert torch.all(best > 0.99) and len(set(which.tolist())) == 4
    assert torch.allclose(found.norm(dim=1), torch.ones(4))
    # the same generator seed gives the same bits
    again = equal_size_kmeans(points, 4, 5, torch.Generator().manual_seed(1), lam=25.0, sinkhorn_iters=10)
    assert torch.equal(found, again)


def partition(points, centroids, k=4, per=8):
    """Each true cluster's points' nearest centroid, [k, per]."""
    return (points @ centroids.T).argmax(1).view(k, per)


def recovered(labels):
    """Every true cluster on one centroid of its own."""
    return bool((labels == labels[:, :1]).all()) and len(set(labels[:, 0].tolist())) == len(labels)


def test_server_sgd_clustering_recovers_separable_local_centroids():
    """The code's rule at its defaults (500 steps, lr 0.01, momentum 0.9, decay 1e-4):
    the centroids need not sit on the clusters' means, they partition them."""
    centres, points = separable()
    start = F.normalize(torch.rand(4, 6, generator=torch.Generator().manual_seed(2)) * 2 - 1, dim=1)
    found = sgd_clustering(points, start, temperature=0.1, steps=500, lr=0.01, momentum=0.9,
                           weight_decay=1e-4)
    assert recovered(partition(points, found))
    assert not recovered(partition(points, start))
    assert torch.allclose(found.norm(dim=1), torch.ones(4), atol=1e-6)


@pytest.mark.parametrize("clustering", ["sgd", "kmeans"])
def test_server_update_averages_and_clusters_the_uploads(clustering):
    alg = build("orchestra", {"proj_dim": 6, "global_clusters": 4, "local_clusters": 4,
                              "memory_size": 8, "global_clustering": clustering,
                              "global_iters": 500 if clustering == "sgd" else 5})
    centres, points = separable()
    d = 10 + alg.head_size()
    state = alg.init_server_state(torch.zeros(d))
    assert not state["centroids"].any() and state["target"].shape == (alg.target_size(d),)
    sums = {"delta": torch.ones(d) * 6.0, "weight": torch.tensor([3.0]),
            "target": torch.ones(alg.target_size(d)) * 3.0}
    gathered = {"centroids": points.double().numpy().reshape(8, -1)}   # 8 clients x 4 rows
    alg.server_update(state, sums, gathered, ctx(participants=tuple(range(8))))
    assert torch.equal(state["x"], torch.full((d,), 2.0))
    assert torch.equal(state["target"], torch.ones(alg.target_size(d)))
    assert recovered(partition(points, state["centroids"].view(4, 6)))


def test_kmeans_server_refuses_fewer_uploads_than_global_clusters():
    alg = build("orchestra", {"proj_dim": 6, "global_clusters": 9, "local_clusters": 4,
                              "memory_size": 8, "global_clustering": "kmeans"})
    state = alg.init_server_state(torch.zeros(40))
    sums = {"delta": torch.zeros(40), "weight": torch.ones(1), "target": torch.zeros(alg.target_size(40))}
    with pytest.raises(UsageError, match="algorithm.global_clusters: 9 global clusters"):
        alg.server_update(state, sums, {"centroids": np.zeros((2, 24))}, ctx(participants=(0, 1)))


def test_rotation_turns_each_image_by_its_own_quarter_turns():
    x = torch.arange(2 * 1 * 3 * 3, dtype=torch.float32).reshape(2, 1, 3, 3)
    k = torch.tensor([1, 3])
    out = rotated(x, k)
    assert torch.equal(out[0], torch.rot90(x[0], 1, dims=(1, 2)))
    assert torch.equal(out[1], torch.rot90(x[1], 3, dims=(1, 2)))


# ---- the client ------------------------------------------------------------------------------

def test_setup_round_only_fills_the_memory_and_clusters_it():
    alg, task = setup()
    x = task.model.params.clone()
    p = alg.params
    up = alg.local_update(task, payload(alg, x, torch.zeros(p.global_clusters * p.proj_dim)),
                          {}, ctx())
    assert up.steps == 0 and torch.equal(up.delta, torch.zeros_like(x))
    assert torch.equal(up.extras["target"], torch.zeros(alg.target_size(len(x))))
    # the memory: the target's (= global online's) normalised projections of view 1
    module = copy.deepcopy(task.model.module)
    FlatModel(module).load(x)
    with torch.no_grad():
        z = F.normalize(module.project(task.data.v1), dim=1)
    expected = equal_size_kmeans(z, 2, p.local_iters, generator_for(0, "orchestra-local", 1, 0))
    assert torch.allclose(up.extras["centroids"], expected.reshape(-1), atol=1e-6)


@pytest.mark.parametrize("target", ["global", "local"])
def test_two_steps_by_hand(target):
    """Plain modules: xi <- tau xi + (1 - tau) theta *before* each step, the cluster loss of
    target(v1) -> online(v2), the rotation loss on rotated v1, SGD; memory of t1."""
    lr, T = 0.1, 0.1
    alg, task = setup(tau_ema=TAU, target=target)
    p = alg.params
    x = task.model.params.clone()
    n = alg.target_size(len(x))
    c = unit_centroids(alg)
    state = {"target": torch.zeros(n), "seen": torch.zeros(1)} if target == "local" else {}
    up = alg.local_update(task, payload(alg, x, c), state, ctx(lr=lr))

    online = copy.deepcopy(task.model.module)
    FlatModel(online).load(x)
    tgt = online.target_copy()
    C = c.view(p.global_clusters, p.proj_dim)
    angles = generator_for(0, "orchestra-rotation", 1, 0)
    memory, losses = [], []
    for (v1, v2), _ in task.data.view_batches(1, B):
        with torch.no_grad():
            for xi, w in zip(tgt.parameters(), online.parameters()):   # online's head is last
                xi.mul_(TAU).add_(w, alpha=1 - TAU)
            t1 = F.normalize(tgt.project(v1), dim=1)
        memory.append(t1)
        soft = F.softmax(t1 @ C.T / T, dim=1)
        logp = torch.log(F.softmax(F.normalize(online.project(v2), dim=1) @ C.T / T, dim=1))
        k = torch.randint(4, (len(v1),), generator=angles)
        v3 = torch.stack([torch.rot90(img, int(r), dims=(1, 2)) for img, r in zip(v1, k)])
        loss = -(soft * logp).sum(1).mean() + F.cross_entropy(online.rotation(online.project(v3)), k)
        grads = torch.autograd.grad(loss, list(online.parameters()))
        with torch.no_grad():
            for w, g in zip(online.parameters(), grads):
                w.sub_(lr * g)
        losses.append(loss.item())
    assert up.steps == 2 and abs(up.loss - np.mean(losses)) < 1e-5
    # two float32 SGD steps by two orders of the same sums: 8e-6 apart (of weights up to
    # 1.08) on a CPU with AVX-512/AMX kernels, 1e-6 on others
    assert torch.allclose(x + up.delta, flat_of(online), atol=2e-5)
    kept = up.extras["target"] + x[:n] if target == "global" else up.state["target"]
    assert torch.allclose(kept, flat_of(tgt), atol=1e-6)
    local = equal_size_kmeans(torch.cat(memory), 2, p.local_iters,
                              generator_for(0, "orchestra-local", 1, 0))
    assert torch.allclose(up.extras["centroids"], local.reshape(-1), atol=1e-5)
    if target == "local":
        assert up.state["seen"].item() == 1 and "target" not in up.extras


def test_without_rotation_there_is_no_head_and_the_target_is_the_whole_model():
    alg, task = setup(rotation_weight=0.0)
    assert not hasattr(task.model.module, "rotation") and alg.head_size() == 0
    assert alg.target_size(task.model.size) == task.model.size
    x = task.model.params.clone()
    up = alg.local_update(task, payload(alg, x, unit_centroids(alg)), {}, ctx())
    assert up.steps == 2 and not torch.equal(up.delta, torch.zeros_like(x))


def test_placement_never_changes_a_client():
    """The same two clients trained in either order on one worker: the same bits."""
    def train(order):
        alg, task = setup()
        x = task.model.params.clone()
        out = {}
        for client in order:
            task.client = client
            out[client] = alg.local_update(task, payload(alg, x, unit_centroids(alg)), {}, ctx())
        return out
    a, b = train([0, 1]), train([1, 0])
    for client in (0, 1):
        assert torch.equal(a[client].delta, b[client].delta)
        assert torch.equal(a[client].extras["centroids"], b[client].extras["centroids"])
    assert not torch.equal(a[0].delta, a[1].delta)   # own rotation angles and K-means starts


def test_declared_sizes():
    alg = build("orchestra", {})
    d = 10 ** 6
    t = alg.target_size(d)
    assert alg.head_size() == 4 * 512 + 4 and alg.params.proj_hidden == 512
    assert alg.traffic(d, "train") == (d + t + 128 * 512, d + t + 16 * 512)
    assert alg.gather_sizes(d) == {"centroids": 16 * 512}
    assert alg.contribution_sizes(d) == {"delta": d, "weight": 1, "target": t}
    assert alg.client_state_sizes(d) == {}
    local = build("orchestra", {"target": "local"})
    assert local.traffic(d, "train") == (d + 128 * 512, d + 16 * 512)
    assert local.client_state_sizes(d) == {"target": t, "seen": 1}
    assert local.contribution_sizes(d) == {"delta": d, "weight": 1}


# ---- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("global_clusters", 0), ("local_clusters", 0), ("memory_size", 0), ("temperature", 0.0),
    ("tau_ema", 1.5), ("cluster_weight", -1.0), ("rotation_weight", -0.1), ("target", "shared"),
    ("local_iters", 0), ("global_clustering", "spectral"), ("global_iters", 0),
    ("cluster_lr", 0.0), ("cluster_momentum", 1.0), ("cluster_weight_decay", -1e-4),
    ("sinkhorn_lambda", 0.0), ("local_sinkhorn_iters", 0), ("global_sinkhorn_iters", 0),
    ("local_clusters", 1.5)])
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(UsageError, match=f"algorithm.{field}"):
        build("orchestra", {field: value})


def test_memory_smaller_than_the_local_clusters_is_refused():
    with pytest.raises(UsageError, match="algorithm.memory_size: must be >= local_clusters = 16"):
        build("orchestra", {"memory_size": 8})


def test_a_client_with_fewer_projections_than_local_clusters_uploads_each_as_a_centroid():
    """4 projections, 8 local clusters: the 4 normalised projections, cycled to 8 rows."""
    alg, task = setup(local_clusters=8, memory_size=8)
    task.data.num_samples = 4   # one batch of 4 in the setup pass
    task.data.v1, task.data.v2 = task.data.v1[:4], task.data.v2[:4]
    p = alg.params
    x = task.model.params.clone()
    upload = alg.local_update(task, payload(alg, x, torch.zeros(p.global_clusters * p.proj_dim)), {}, ctx())
    centroids = alg.gather(upload)["centroids"].view(8, p.proj_dim)
    assert torch.equal(centroids[:4], centroids[4:])
    assert torch.allclose(centroids.norm(dim=1), torch.ones(8))
    assert len({tuple(row.tolist()) for row in centroids[:4]}) == 4   # four distinct projections


# ---- real runs ---------------------------------------------------------------------------------

def run_single(path, **algorithm):
    values = merged(SSL, algorithm={"name": "orchestra", **SMALL, **algorithm}, rounds=2)
    del values["algorithm"]["pred_hidden"]
    values["output"] = str(path)
    exp = run_experiment(cfgmod.from_dict(values), LocalComm(), quiet=True)
    return exp, RunFile(values["output"])


@pytest.mark.parametrize("target", ["global", "local"])
def test_real_run_completes_and_fl_bytes_are_the_closed_form(tmp_path, target):
    exp, run = run_single(tmp_path / f"{target}.h5", target=target)
    d, p = exp.d, SMALL["proj_dim"]
    t = d - (4 * p + 4) if target == "global" else 0
    down = (d + t + SMALL["global_clusters"] * p) * 4
    up = (d + t + SMALL["local_clusters"] * p) * 4
    k = SSL["clients"]["per_round"]
    with run:
        rounds = run.rounds()
        assert run.status == "completed"
        assert rounds["fl_bytes_down"].tolist() == [0] + [k * down] * 2   # 0: round 0
        assert rounds["fl_bytes_up"].tolist() == [0] + [k * up] * 2
        assert np.all(run.clients()["bytes_up"] == up)
        assert rounds["train_loss"][1] == 0.0 and rounds["train_loss"][2] > 0   # setup, then training
        assert run.config["algorithm"]["global_clustering"] == "sgd"
    centroids = exp.state["centroids"].view(SMALL["global_clusters"], p)
    assert torch.allclose(centroids.norm(dim=1), torch.ones(len(centroids)), atol=1e-5)
    assert (len(exp.store) > 0) == (target == "local")   # FedBYOL's client state, or none
