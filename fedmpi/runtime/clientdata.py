"""The worker's copy of the data, and each client's view of it.

The whole training set is held once per worker as tensors on the device (uint8 images,
text ids, float32 tabular features; on the CPU these are the node's one shared copy,
``Comm.node_shared``, so nothing here may write into them); a client is an index set
into it. A batch is one index gather, for images one conversion to float (with the
crop/flip augmentation batched on the device) and, for convolutional models, NHWC
layout. No DataLoader, no per-sample Python.
"""

from __future__ import annotations

import numpy as np
import torch

from ..algorithms.base import ClientData, active_counts
from ..data.augment import ClientSkew, crop_flip, normalise, skewed_float, to_float
from ..data.ssl_augment import two_views
from .rng import torch_generator


# The server's public set (FNR-FL's F_i, A_i and refinement) is read as FNR-FL's authors'
# code reads it (LonelyMoonDesert/FNR-FL, NIID-Bench's get_dataloader: the public loader
# has the test transform, no crop/flip): never through the training augmentation.
UNAUGMENTED_STREAMS = ("public",)


class DeviceData:
    """Training and test tensors of one dataset on one device."""

    def __init__(self, dataset, device: torch.device, *, augment: bool, crop_padding: int,
                 flip: bool, channels_last: bool):
        self.device = device
        self.train_x = dataset.train_x.to(device)
        self.train_y = dataset.train_y.to(device)
        self.test_x = dataset.test_x.to(device)
        self.test_y = dataset.test_y.to(device)
        self.mean, self.std = dataset.mean, dataset.std
        self.modality = getattr(dataset, "modality", "image")
        self.augment, self.crop_padding, self.flip = augment, crop_padding, flip
        self.channels_last = channels_last

    def prepare(self, x_uint8: torch.Tensor, generator: torch.Generator | None,
                skew: ClientSkew | None = None, augment: bool | None = None) -> torch.Tensor:
        """A batch as the model takes it: token ids for text; tabular features as stored
        (standardised by the loader; no augmentation, no skew: config validation refuses
        image transforms for them); for images crop/flip (when augmenting: ``augment``,
        None = ``data.augment``), the client's feature skew, normalisation. ``generator``
        None = test."""
        if self.modality == "text":
            return x_uint8.long()
        if self.modality == "tabular":
            return x_uint8
        if generator is not None and (self.augment if augment is None else augment):
            x_uint8 = crop_flip(x_uint8, generator, self.crop_padding, self.flip)
        if generator is not None and skew is not None:
            return skewed_float(x_uint8, skew, generator, self.mean, self.std, self.channels_last)
        return to_float(x_uint8, self.mean, self.std, channels_last=self.channels_last)

    def client(self, indices: np.ndarray, seed: int, round_: int, client: int,
               phase: int, split: str = "train", stream: str = "",
               skew: ClientSkew | None = None, poison=None) -> "TensorClientData":
        """A client's view of ``indices`` into ``split`` (train, or test for FNR-FL's leaky
        public set); ``stream`` names a separate random stream (the public set's). A stream
        in UNAUGMENTED_STREAMS is read without the crop/flip whatever ``data.augment`` says.
        ``poison``: a malicious client's (fedmpi.runtime.poison.ClientPoison)."""
        view = TensorClientData(self, indices, seed, (round_, client, phase), split, stream,
                                skew, augment=False if stream in UNAUGMENTED_STREAMS else None)
        view.poison = poison
        return view


# A client's samples gathered with one index at most (then sliced into its batches)
GATHER_BYTES = 8 << 20


class TensorClientData(ClientData):
    """Batches of one client: order and augmentation keyed by (seed, round, client, phase);
    ``augment`` False: never crop/flip (None: as ``data.augment``)."""

    def __init__(self, data: DeviceData, indices: np.ndarray, seed: int, key: tuple[int, ...],
                 split: str = "train", stream: str = "", skew: ClientSkew | None = None,
                 augment: bool | None = None):
        self.data, self.skew, self.augment = data, skew, augment
        self.x = data.train_x if split == "train" else data.test_x
        self.y = data.train_y if split == "train" else data.test_y
        self.purpose = f"-{stream}" if stream else ""
        self.indices = torch.as_tensor(indices, dtype=torch.int64)
        self.num_samples = len(indices)
        self.seed, self.key = seed, key
        self._label_counts = None
        self.poison = None   # a malicious client's batches' poison (fedmpi.runtime.poison)

    def _poisoned(self, batch: torch.Tensor):
        """The batch's images and labels, through the client's poison if it has one."""
        x, y = self.x[batch], self.y[batch]
        return (x, y) if self.poison is None else self.poison.apply(batch, x, y)

    def label_counts(self, num_classes: int) -> torch.Tensor:
        """``ClientData.label_counts``: computed once per client object, on the device, by
        comparing the labels with each class, 2^16 samples at a time (no ``bincount``, which
        reads the labels' max back to the host on a GPU; no atomics, so deterministic)."""
        if self._label_counts is None or len(self._label_counts) != num_classes:
            y = self.y[self.indices.to(self.y.device)]
            classes = torch.arange(num_classes, device=y.device)
            counts = torch.zeros(num_classes, dtype=torch.int64, device=y.device)
            for start in range(0, len(y), 1 << 16):
                counts += (y[start:start + (1 << 16)].unsqueeze(1) == classes).sum(0)
            self._label_counts = counts
        return self._label_counts

    def batches(self, epochs: int, batch_size: int):
        """The client's batches, in its keyed order. Without a poison (which sees each
        batch's indices) the samples of up to GATHER_BYTES of batches are gathered with one
        index and sliced: a batch's rows fresh from a large training set cost a CPU about
        as much as 600 rows gathered at once cost per 50 (W1: 0.21 against 0.14 ms a batch,
        measured inside a run), and a GPU one kernel instead of several."""
        if self.poison is not None:
            for batch, aug in self._index_batches(epochs, batch_size):
                x, y = self._poisoned(batch)
                yield self.data.prepare(x, aug, self.skew, self.augment), y
            return
        row = max(self.x[:1].numel() * self.x.element_size(), 1)
        span = max(1, GATHER_BYTES // (row * batch_size)) * batch_size
        for idx, aug in self._epoch_orders(epochs):
            for lo in range(0, len(idx), span):
                chunk = idx[lo:lo + span]
                xs, ys = self.x[chunk], self.y[chunk]
                for start in range(0, len(chunk), batch_size):
                    yield (self.data.prepare(xs[start:start + batch_size], aug, self.skew,
                                             self.augment), ys[start:start + batch_size])

    def poisson_batches(self, steps: int, rate: float):
        """Sample-level DP-SGD's batches: at each of ``steps`` steps every sample is in
        the batch independently with probability ``rate`` (Poisson sampling, which the
        accounting assumes), drawn from the client's own keyed stream; a batch may be
        empty."""
        draw = torch_generator(self.seed, "dp-sgd-batch" + self.purpose, *self.key)
        aug_device = self.data.device if self.data.device.type == "cuda" else "cpu"
        aug = torch_generator(self.seed, "augment" + self.purpose, *self.key, device=aug_device)
        for _ in range(steps):
            idx = self.indices[torch.rand(self.num_samples, generator=draw, dtype=torch.float64) < rate]
            if self.data.device.type == "cuda":
                idx = idx.to(self.data.device)
            x, y = self._poisoned(idx)
            yield self.data.prepare(x, aug, self.skew, self.augment), y

    def view_batches(self, epochs: int, batch_size: int):
        """((view1, view2), y): SimCLR's two augmentations, normalised with the dataset's
        statistics like every other batch. (The FedU^2 code feeds [0, 1] views to a
        BatchNorm ResNet; fedmpi's models have no BatchNorm, and the plain CNN does not
        learn from uncentred views: NT-Xent stays at chance.) The client's feature skew,
        if any, is not applied to views."""
        d = self.data
        for batch, aug in self._index_batches(epochs, batch_size):
            views = two_views(self.x[batch], aug)
            yield tuple(normalise(v, d.mean, d.std, d.channels_last) for v in views), self.y[batch]

    @classmethod
    def group_batches(cls, clients: list["TensorClientData"], epochs: int, batch_size: int):
        """``ClientData.group_batches`` with one gather a step for the whole group: every
        client's batch order is drawn up front from its own keyed stream, as ``batches``
        draws it, into a [K, G, B] index (short batches padded with their first sample)
        sent to the device once; a step is then one gather and one conversion of a x B
        samples, not a of each. The values are the per-client path's, bit for bit (the
        conversion is per sample). Where a batch's conversion draws randomness
        (augmentation, feature skew), the clients read different tensors or one is
        poisoned (its labels mapped), the per-client path serves. (A W2 round's batches, 50 clients: 29.9 ms per client and
        5.1 ms gathered on an H200; 14 and 3.2-3.6 ms on a 2-core CPU, where assembling
        the index in torch, not numpy, took 5.1 ms; ``benchmarks/cross_device.py
        --batches``.)"""
        first = clients[0] if clients else None
        if first is None or any(c.data is not first.data or c.x is not first.x
                                or c._draws_randomness() or c.poison is not None
                                for c in clients):
            yield from super().group_batches(clients, epochs, batch_size)
            return
        active = active_counts(clients, epochs, batch_size)
        # assembled in numpy (a tenth of a torch operator's host time each), then shared
        index = np.zeros((len(active), len(clients), batch_size), dtype=np.int64)
        weights = np.zeros((len(active), len(clients), batch_size), dtype=np.float32)
        full = [True] * len(active)
        for i, c in enumerate(clients):
            c._draw_group_rows(index[:, i], weights[:, i], full, epochs, batch_size)
        index, weights = torch.from_numpy(index), torch.from_numpy(weights)
        if first.data.device.type == "cuda":   # asynchronous only from pinned memory
            index = index.pin_memory().to(first.data.device, non_blocking=True)
            weights = weights.pin_memory().to(first.data.device, non_blocking=True)
        for k, a in enumerate(active):
            batch = index[k, :a].reshape(-1)
            x = first.data.prepare(first.x[batch], None)
            yield (x.view(a, batch_size, *x.shape[1:]), first.y[batch].view(a, batch_size),
                   None if full[k] else weights[k, :a])

    def _draws_randomness(self) -> bool:
        """Whether ``DeviceData.prepare`` draws from this client's augmentation stream."""
        if self.data.modality != "image":
            return False
        return self.skew is not None or (self.data.augment if self.augment is None
                                         else self.augment)

    def _draw_group_rows(self, index: np.ndarray, weights: np.ndarray, full: list[bool],
                         epochs: int, batch_size: int) -> None:
        """This client's batches into its rows of a group's index [K, B] and weights
        [K, B] (``group_batches``); ``full[k]`` cleared where its k-th batch is short."""
        n, b = self.num_samples, batch_size
        per_epoch = -(-n // b)
        whole, short = n // b, n - (per_epoch - 1) * b
        order = torch_generator(self.seed, "batch" + self.purpose, *self.key)
        indices = self.indices.numpy()  # host sync: none, a CPU tensor's memory (once a round)
        for e in range(epochs):
            # host sync: none, a CPU generator's permutation (once a client and epoch)
            idx = indices[torch.randperm(n, generator=order).numpy()]
            epoch = slice(e * per_epoch, (e + 1) * per_epoch)
            rows, w = index[epoch], weights[epoch]
            rows[:whole] = idx[:whole * b].reshape(whole, b)
            w[:whole] = 1.0 / b
            if whole < per_epoch:   # a short last batch: padded with its first sample
                rows[-1, :short] = idx[whole * b:]
                rows[-1, short:] = idx[whole * b]
                w[-1, :short] = 1.0 / short
                full[epoch.stop - 1] = False

    def _epoch_orders(self, epochs: int):
        """Each epoch's sample indices in a keyed random order, with the keyed augmentation
        generator (the same for every epoch: it draws on)."""
        order = torch_generator(self.seed, "batch" + self.purpose, *self.key)
        aug_device = self.data.device if self.data.device.type == "cuda" else "cpu"
        aug = torch_generator(self.seed, "augment" + self.purpose, *self.key, device=aug_device)
        for _ in range(epochs):
            idx = self.indices[torch.randperm(self.num_samples, generator=order)]
            if self.data.device.type == "cuda":   # asynchronous only from pinned memory
                idx = idx.pin_memory().to(self.data.device, non_blocking=True)
            yield idx, aug

    def _index_batches(self, epochs: int, batch_size: int):
        """Index batches in a keyed random order, with the keyed augmentation generator."""
        for idx, aug in self._epoch_orders(epochs):
            for start in range(0, self.num_samples, batch_size):
                yield idx[start:start + batch_size], aug
