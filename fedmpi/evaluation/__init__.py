"""Evaluation of the global model, sharded over workers so the result does not depend on
their number.

- ``supervised``: test accuracy and loss of a classifier over fixed test-set chunks.
- ``ssl``: a self-supervised encoder's kNN monitor, linear probe and fine-tuning (FedU^2's
  protocols), in pieces that merge exactly; ``spectrum``: its feature spectrum, likewise.
- ``sharded``: the workers' and the server's share of the kNN monitor and of the probes
  into /eval, over those pieces.
"""

from .sharded import (knn_accuracy, knn_worker, probe_column, probe_tasks, run_probe, spectrum,
                      spectrum_worker)
from .spectrum import effective_rank
from .supervised import chunks_of, combine, evaluate_chunks

__all__ = [
    "chunks_of", "combine", "effective_rank", "evaluate_chunks", "knn_accuracy", "knn_worker",
    "probe_column", "probe_tasks", "run_probe", "spectrum", "spectrum_worker",
]
