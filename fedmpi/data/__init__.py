"""Datasets as tensors, client partitions as index arrays, batched on-device augmentation.

- `registry`: `register(name, modality=, locate=, hint=)` makes a loader a dataset
  (built-in or a plugin's); `load_dataset(name, data_dir, seed, **options)` -> `Dataset`
  (uint8 images, text ids or float32 tabular features; int64 labels), checked.
- `sources`: the built-in datasets; `arrays`: your own .npz/HDF5 file (`from_arrays`).
- `partition`: `make_partition(kind, labels, num_clients, seed, ...)` -> `Partition` (CSR):
  iid, dirichlet (optionally balanced or with quantity skew), pathological, quantity, natural.
- `heterogeneity`: label-skew statistics and the client x class heatmap.
- `augment`: `augment(x_uint8, generator, ...)` / `to_float(...)` for the training loop.
"""

from fedmpi.data import leaf, tff  # register leaf_femnist, ..., tff_emnist, ...: LEAF and TFF files
from fedmpi.data.arrays import from_arrays  # registers "arrays" (after the built-ins)
from fedmpi.data.augment import augment, to_float
from fedmpi.data.partition import (Partition, class_counts, dirichlet, iid, make_partition,
                                   natural, partition_params, pathological, quantity)
from fedmpi.data.registry import (DATASETS, MODALITIES, DatasetSpec, available_datasets,
                                  check_dataset, check_present, check_dataset_options, dataset_modality,
                                  load_dataset, register)
from fedmpi.data.sources import Dataset

__all__ = [
    "DATASETS", "MODALITIES", "Dataset", "DatasetSpec", "Partition", "augment", "leaf", "tff",
    "available_datasets", "check_dataset", "check_present", "check_dataset_options", "class_counts",
    "dataset_modality", "dirichlet", "from_arrays", "iid", "load_dataset", "make_partition",
    "natural", "partition_params", "pathological", "quantity", "register", "to_float",
]
