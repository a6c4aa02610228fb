"""Probes of the global encoder (eval.probes) into /eval every ``eval.probe_every``
rounds and after the last (fedmpi.runtime.probes); every rank takes part."""

from __future__ import annotations

import time

from .. import probes
from ..scoring import load_eval_model
from . import Observer


def probe_round(config, t: int) -> bool:
    e = config.eval
    return bool(e.probes) and (t == config.rounds - 1
                               or (e.probe_every > 0 and (t + 1) % e.probe_every == 0))


class Probes(Observer):
    def __init__(self, spectra):
        self.spectra = spectra   # the clients' local spectra of this round, if taken

    def after_evaluate(self, exp, t: int, timers) -> None:
        if not probe_round(exp.config, t):
            return
        t0 = time.perf_counter()
        load_eval_model(exp)
        encoder = exp.flat.module.encoder if exp.comm.is_worker else None
        local = {c: values for c, (values, _) in self.spectra.local.items()}
        row, values, local = probes.run(exp.comm, encoder, exp.data, exp.num_classes,
                                        exp.config, t + 1, local)
        timers.eval += time.perf_counter() - t0
        if exp.comm.is_server:
            exp.writer.append_eval(row, values, local)
            if not exp.quiet:
                print(probes.describe(row), flush=True)
