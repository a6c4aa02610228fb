"""Datasets as tensors, client partitions as index arrays, batched on-device augmentation.

- `sources`: `load_dataset(name, data_dir, seed)` -> `Dataset` (uint8 images, int64 labels).
- `partition`: `make_partition(kind, labels, num_clients, seed, ...)` -> `Partition` (CSR):
  iid, dirichlet (optionally balanced or with quantity skew), pathological, quantity, natural.
- `heterogeneity`: label-skew statistics and the client x class heatmap.
- `augment`: `augment(x_uint8, generator, ...)` / `to_float(...)` for the training loop.
"""

from fedmpi.data.augment import augment, to_float
from fedmpi.data.partition import (Partition, class_counts, dirichlet, iid, make_partition,
                                   natural, partition_params, pathological, quantity)
from fedmpi.data.sources import (DATASETS, Dataset, available_datasets, check_dataset_options,
                                 load_dataset)

__all__ = [
    "DATASETS", "Dataset", "Partition", "augment", "available_datasets", "check_dataset_options",
    "class_counts",
    "dirichlet", "iid", "load_dataset", "make_partition", "natural", "partition_params",
    "pathological", "quantity", "to_float",
]
