"""Self-supervised evaluation pieces: kNN (hand-computed votes, sharded == unsharded
bitwise), linear probe and fine-tuning on separable toys, stratified subsets, the
feature spectrum against a known covariance, effective rank."""

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedmpi.errors import UsageError
from fedmpi.evaluation import ssl as ssl_eval
from fedmpi.evaluation.spectrum import (combine_covariance_sums, covariance_sums, effective_rank,
                                        feature_spectrum, log10_spectrum, spectrum_from_sums)
from fedmpi.evaluation.ssl import (KnnPartial, features, fine_tune, knn_merge, knn_partial,
                                   knn_predict, knn_vote, linear_probe, merge_partials,
                                   random_resized_crop_flip, stratified_subset)


def clusters(n_per_class, dim=16, classes=3, spread=0.3, seed=0):
    """Gaussian clusters around well separated random centres (the same for every seed),
    labels 0..classes-1."""
    fixed = torch.Generator().manual_seed(99)
    centres = 3 * F.normalize(torch.randn(classes, dim, generator=fixed), dim=1)
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(classes).repeat_interleave(n_per_class)
    x = centres[y] + spread * torch.randn(len(y), dim, generator=g)
    perm = torch.randperm(len(y), generator=g)
    return x[perm], y[perm]


def unit(x):
    return F.normalize(x, dim=1)


def naive_knn(test, bank, labels, classes, k, t):
    """The FedU2 / InstDisc monitor as written there (topk + one-hot weighted sum)."""
    w, i = (test @ bank.T).topk(k, dim=1)
    one_hot = F.one_hot(labels[i], classes).float()
    return (one_hot * torch.exp(w / t)[..., None]).sum(1).argmax(1)


def same(a: KnnPartial, b: KnnPartial):
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("sims", "index", "labels"))


# ---- kNN ---------------------------------------------------------------------------------

def test_knn_vote_hand_computed_and_temperature():
    p = KnnPartial(torch.tensor([[0.9, 0.8, 0.7]]), torch.tensor([[4, 0, 2]]), torch.tensor([[1, 0, 0]]))
    # T = 0.1: e^9 = 8103 (class 1) > e^8 + e^7 = 4078 (class 0); T = 1: 2.46 < 4.24
    assert knn_vote(p, 3, 0.1).tolist() == [1]
    assert knn_vote(p, 3, 1.0).tolist() == [0]


def test_knn_separable_clusters_and_matches_naive():
    bank, bank_y = clusters(300)
    test, test_y = clusters(50, seed=1)
    pred = knn_predict(unit(test), unit(bank), bank_y, 3, k=200, temperature=0.1)
    assert (pred == test_y).float().mean() > 0.95
    assert torch.equal(pred, naive_knn(unit(test), unit(bank), bank_y, 3, 200, 0.1))


def random_split(n, rng):
    cuts = sorted(rng.sample(range(1, n), 6)) + [n - 1]  # includes a chunk of one row
    bounds = [0] + sorted(set(cuts)) + [n]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


@pytest.mark.parametrize("blocks", [(8, 16), (ssl_eval.TEST_BLOCK, ssl_eval.BANK_BLOCK)])
def test_sharded_merge_equals_unsharded_bitwise(monkeypatch, blocks):
    monkeypatch.setattr(ssl_eval, "TEST_BLOCK", blocks[0])
    monkeypatch.setattr(ssl_eval, "BANK_BLOCK", blocks[1])
    bank, bank_y = clusters(70, spread=1.0)
    bank, bank_y = torch.cat([bank, bank[:30]]), torch.cat([bank_y, bank_y[:30]])  # exact ties
    bank, test = unit(bank), unit(clusters(15, spread=1.0, seed=3)[0])
    k = 40
    whole = knn_partial(test, bank, bank_y, k)
    rng = random.Random(0)
    for _ in range(3):
        chunks = random_split(len(bank), rng)
        parts = [knn_partial(test, bank[a:b], bank_y[a:b], k, bank_offset=a) for a, b in chunks]
        rng.shuffle(parts)
        assert same(merge_partials(parts, k), whole)
        # associativity: two "workers" merge their own chunks first
        half = len(parts) // 2
        workers = [merge_partials(parts[half:], k), merge_partials(parts[:half], k)]
        assert same(merge_partials(workers, k), whole)
        assert torch.equal(knn_merge(parts, k, 0.1, 3), knn_vote(whole, 3, 0.1))
    # splitting the test set changes nothing either
    for a, b in random_split(len(test), rng):
        assert same(knn_partial(test[a:b], bank, bank_y, k), KnnPartial(
            whole.sims[a:b], whole.index[a:b], whole.labels[a:b]))


def test_knn_ties_broken_by_bank_index():
    v = unit(torch.tensor([[1.0, 2.0], [2.0, 1.0]]))
    bank = torch.cat([v[1:], v[:1], v[:1], v[:1]])       # rows 1, 2, 3 are the same vector
    labels = torch.tensor([0, 1, 2, 1])
    whole = knn_partial(v[:1], bank, labels, k=2)
    assert whole.index.tolist() == [[1, 2]]
    parts = [knn_partial(v[:1], bank[b:b + 1], labels[b:b + 1], 2, bank_offset=b) for b in (3, 2, 1, 0)]
    assert same(merge_partials(parts, 2), whole)


def test_knn_bank_smaller_than_k_pads_with_zero_weight():
    bank, test = unit(torch.eye(3)), unit(torch.tensor([[1.0, 0.1, 0.0]]))
    p = knn_partial(test, bank, torch.tensor([2, 0, 1]), k=5)
    assert p.index[0, :3].tolist() == [0, 1, 2] and torch.isinf(p.sims[0, 3:]).all()
    assert knn_vote(p, 3).tolist() == [2]
    empty = knn_partial(test, bank[:0], torch.zeros(0, dtype=torch.long), k=5)
    assert same(merge_partials([empty, p], 5), p)


def test_knn_rejects_bad_parameters():
    with pytest.raises(UsageError, match="^k must"):
        knn_partial(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), k=0)
    with pytest.raises(UsageError, match="^temperature must"):
        knn_vote(KnnPartial(torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.long),
                            torch.zeros(1, 1, dtype=torch.long)), 2, 0.0)


# ---- features ----------------------------------------------------------------------------

def test_features_chunked_eval_mode_and_normalised():
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.Dropout(0.5))
    enc.train()
    x = torch.randint(0, 256, (10, 3, 2, 2), dtype=torch.uint8)
    z = features(enc, x, chunk_size=3)
    assert enc.training and z.dtype == torch.float32 and z.shape == (10, 5)
    with torch.no_grad():
        assert torch.allclose(z, enc.eval()(x.float() / 255), atol=1e-6)  # dropout off
    zn = features(enc, x, prepare=lambda b: b.float() / 255, chunk_size=4, normalize=True)
    assert torch.allclose(zn.norm(dim=1), torch.ones(10), atol=1e-6)
    assert torch.allclose(zn, unit(z), atol=1e-6)


# ---- linear probe ------------------------------------------------------------------------

def test_linear_probe_separable_and_deterministic():
    x, y = clusters(100)
    tx, ty = clusters(30, seed=1)
    accs = [linear_probe(x, y, tx, ty, 3, torch.Generator().manual_seed(5), epochs=20, batch_size=64)
            for _ in range(2)]
    assert accs[0] > 0.95 and accs[0] == accs[1]
    with pytest.raises(UsageError, match="^epochs must"):
        linear_probe(x, y, tx, ty, 3, torch.Generator(), epochs=0)


def test_the_standard_probe_is_scale_free_and_learns_where_the_raw_one_oscillates():
    """A collapsed encoder's features: the class signal small beside a large common
    component, norms in the hundreds (FedX-BYOL's 30-round CNN: median norm 659). Adam's
    lr 3e-3 then moves the logits by hundreds a step and the raw probe scores near chance;
    standardised, the features are the clusters again, whatever their scale."""
    x, y = clusters(100, dim=32, classes=4)
    tx, ty = clusters(40, dim=32, classes=4, seed=1)
    offset = 20 * torch.randn(32, generator=torch.Generator().manual_seed(7))

    def probe(scale, head_input):
        return linear_probe(scale * (x + offset), y, scale * (tx + offset), ty, 4,
                            torch.Generator().manual_seed(3), epochs=20, batch_size=64,
                            head_input=head_input)

    a, b = ssl_eval.standardize(x + offset, tx + offset)
    a2, b2 = ssl_eval.standardize(1024 * (x + offset), 1024 * (tx + offset))
    assert torch.equal(a, a2) and torch.equal(b, b2)        # a power of 4: exactly scale-free
    assert probe(1024.0, "standard") == probe(1.0, "standard") > 0.95
    assert probe(1024.0, "raw") < 0.7
    constant = torch.cat([x, torch.ones(len(x), 1)], 1)     # a dead unit: shifted, not divided by 0
    assert torch.isfinite(ssl_eval.standardize(constant, constant)[0]).all()
    with pytest.raises(UsageError, match="head_input='bn': must be 'raw' or 'standard'"):
        probe(1.0, "bn")


# ---- stratified subset -------------------------------------------------------------------

def test_stratified_subset_counts_and_seed():
    labels = np.repeat([0, 1, 2], [100, 50, 7])
    idx = stratified_subset(torch.as_tensor(labels), 0.1, seed=3)
    assert np.bincount(labels[idx]).tolist() == [10, 5, 1]   # round(0.7) = 1 and never 0
    assert len(np.unique(idx)) == len(idx) and np.all(np.diff(idx) > 0)
    assert np.array_equal(idx, stratified_subset(labels, 0.1, seed=3))
    assert not np.array_equal(idx, stratified_subset(labels, 0.1, seed=4))
    assert np.bincount(labels[stratified_subset(labels, 0.01, 0)]).tolist() == [1, 1, 1]
    assert len(stratified_subset(labels, 1.0, 0)) == len(labels)
    for bad in (0, 1.5):
        with pytest.raises(UsageError, match="^fraction must"):
            stratified_subset(labels, bad, 0)


# ---- augmentation and fine-tuning --------------------------------------------------------

def test_resized_crop_identity_flip_and_determinism():
    x = torch.rand(6, 2, 5, 7)
    g = torch.Generator().manual_seed(0)
    whole = dict(scale=(1, 1), ratio=(7 / 5, 7 / 5))   # the full 5 x 7 image
    assert torch.allclose(random_resized_crop_flip(x, g, **whole, flip=False), x, atol=1e-5)
    out = random_resized_crop_flip(x, g, **whole)
    flipped = [torch.allclose(o, xi.flip(-1), atol=1e-5) for o, xi in zip(out, x)]
    kept = [torch.allclose(o, xi, atol=1e-5) for o, xi in zip(out, x)]
    assert all(f != k for f, k in zip(flipped, kept)) and any(flipped) and any(kept)
    a = random_resized_crop_flip(x, torch.Generator().manual_seed(1))
    b = random_resized_crop_flip(x, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.allclose(a, x)


def bars(n_per_class, seed):
    """8x8 uint8 images: class 0 bright top half, 1 bright bottom half, 2 dark; noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(3).repeat_interleave(n_per_class)
    x = torch.full((len(y), 1, 8, 8), 40.0)
    x[y == 0, :, :4] = 200
    x[y == 1, :, 4:] = 200
    x += 30 * torch.randn(x.shape, generator=g)
    return x.clamp(0, 255).to(torch.uint8), y


def test_fine_tune_beats_chance_copies_encoder_and_is_deterministic():
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
    before = [p.detach().clone() for p in enc.parameters()]
    x, y = bars(20, 0)
    tx, ty = bars(20, 1)
    results = [fine_tune(enc, x, y, tx, ty, 3, torch.Generator().manual_seed(2), epochs=6,
                         batch_size=16, lr_encoder=0.05, eval_epochs=[3, 6]) for _ in range(2)]
    assert results[0] == results[1]
    assert set(results[0].accuracy) == {3, 6}
    assert results[0].best == max(results[0].accuracy.values()) > 0.6   # chance: 1/3
    assert all(torch.equal(a, b) for a, b in zip(before, enc.parameters()))
    with pytest.raises(UsageError, match="^eval_epochs must"):
        fine_tune(enc, x, y, tx, ty, 3, torch.Generator(), epochs=2, eval_epochs=[3])


def test_fine_tune_of_unnormalised_features_collapses_raw_and_learns_with_l2():
    """The encoder of a CNN without normalisation layers: the same features times 200
    (norms in the hundreds, as the McMahan CNN's). FedU^2's head lr 0.3 with momentum
    wrecks it under the raw head, to chance, as the FedU^2 pilot's probe did; the l2 head
    is scale-free, so the scaled encoder scores what the unscaled one does."""
    torch.manual_seed(0)
    conv = nn.Conv2d(1, 4, 3, padding=1)
    x, y = bars(20, 0)
    tx, ty = bars(20, 1)

    def tuned(scale, head_input):
        enc = nn.Sequential(conv, nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), _Times(scale))
        return fine_tune(enc, x, y, tx, ty, 3, torch.Generator().manual_seed(2), epochs=6,
                         batch_size=16, eval_epochs=[6], head_input=head_input).best

    assert tuned(200.0, "raw") <= 0.4                      # chance: 1/3
    assert tuned(200.0, "l2") == tuned(1.0, "l2") > 0.6
    with pytest.raises(UsageError, match="head_input='bn': must be 'raw' or 'l2'"):
        tuned(1.0, "bn")


class _Times(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return x * self.scale


# ---- spectrum ----------------------------------------------------------------------------

def with_covariance(n, variances, dim, seed=0):
    """n samples in `dim` dims whose sample covariance (1/n) is exactly Q diag(variances) Q^T."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, len(variances), generator=g, dtype=torch.float64)
    z -= z.mean(0)
    z = z @ torch.linalg.inv(torch.linalg.cholesky(z.T @ z / n)).T  # sample covariance = I
    q, _ = torch.linalg.qr(torch.randn(dim, len(variances), generator=g, dtype=torch.float64))
    return (z * torch.tensor(variances, dtype=torch.float64).sqrt()) @ q.T + 5.0


def test_spectrum_recovers_known_covariance_and_shards():
    feats = with_covariance(400, [4.0, 1.0, 0.25], dim=6)
    s = feature_spectrum(feats)
    assert torch.allclose(s[:3], torch.tensor([4.0, 1.0, 0.25], dtype=torch.float64), atol=1e-9)
    assert s[3:].abs().max() < 1e-9 and torch.all(s[:-1] >= s[1:])
    cuts = [(0, 0), (0, 1), (1, 150), (150, 150), (150, 151), (151, 400)]  # empty chunks too
    merged = combine_covariance_sums([covariance_sums(feats[a:b]) for a, b in cuts])
    assert torch.allclose(s, spectrum_from_sums(merged), atol=1e-9)
    logs = log10_spectrum(s, floor=1e-12)
    assert torch.allclose(logs[:2], torch.tensor([math.log10(4), 0.0], dtype=torch.float64))
    assert logs.min() >= -12


def test_effective_rank_isotropic_and_rank_one():
    isotropic, rank_one = with_covariance(200, [1.0] * 8, dim=8), with_covariance(200, [1.0], dim=8)
    assert effective_rank(feature_spectrum(isotropic)) == pytest.approx(8, abs=1e-9)
    assert effective_rank(feature_spectrum(rank_one)) == pytest.approx(1, abs=1e-6)
    assert effective_rank(torch.tensor([3.0, 1.0])) == pytest.approx(
        math.exp(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))))


def test_the_probe_heads_are_config_choices():
    from fedmpi import config as cfg

    assert cfg.resolve(preset="fussl_fmnist_silo").eval.finetune_head == "raw"   # FedU^2's code
    assert cfg.resolve(preset="fussl_fmnist_silo",
                       overrides=["eval.finetune_head=l2"]).eval.finetune_head == "l2"
    with pytest.raises(UsageError, match=r"^config field eval.finetune_head: 'bn' is not allowed"):
        cfg.resolve(preset="fussl_fmnist_silo", overrides=["eval.finetune_head=bn"])
    assert cfg.resolve(preset="fussl_fmnist_silo").eval.linear_head == "raw"
    with pytest.raises(UsageError, match=r"^config field eval.linear_head: 'l2' is not allowed"):
        cfg.resolve(preset="fussl_fmnist_silo", overrides=["eval.linear_head=l2"])
