"""FedU^2's local spectra (eval.local_spectra): on probe rounds, the feature spectrum of
each client's local model right after its training, sent with the probes."""

from __future__ import annotations

import time
from functools import partial

from ...evaluation import spectrum, spectrum_worker
from . import Observer
from .probes import probe_round


class LocalSpectra(Observer):
    def __init__(self):
        self.local = {}   # this worker's client -> (spectrum of its local model, seconds)

    def before_round(self, exp, t: int) -> None:
        self.local = {}

    def client_hook(self, exp, t: int, p: int):
        """Taken in the first phase only, on probe rounds."""
        if p == 0 and exp.config.eval.local_spectra and probe_round(exp.config, t):
            return partial(self._take, exp)
        return None

    def _take(self, exp, c, upload) -> float:
        t1 = time.perf_counter()   # the client's local model, before it is reloaded
        values = spectrum([spectrum_worker(exp.flat.module.encoder, exp.data, 0, 1)])
        seconds = time.perf_counter() - t1
        self.local[c] = (values, seconds)
        return seconds
