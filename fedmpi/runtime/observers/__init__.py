"""What the round engine calls at named points, beside the round itself: checkpoints,
divergence, preemption, the room left for the file, progress lines, probes and local
spectra. Each is one small module; the engine knows only the hooks below.

- ``on_setup(exp)``: every rank, once set up, before the first round (collectives allowed);
- ``before_round(exp, t)``: every rank, before round t's first phase;
- ``client_hook(exp, t, p)``: a worker's callable ``(client, upload) -> seconds`` run
  after each local update of phase p, or None (the default: nothing per client);
- ``after_evaluate(exp, t, timers)``: every rank, after round t's evaluation step;
- ``after_round(exp, record)``: server, once the round (or round 0) is on disk;
- ``on_end(exp)``: server, once the results file is closed (completed, pruned, diverged,
  stopped to be resumed, or failed on an error).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RoundRecord:
    """A written round, as observers see it: ``round`` counts from 1 (0: the initial model)."""
    round: int
    row: dict
    ranks: np.ndarray    # records.RANK_DTYPE, one per rank

    @property
    def signalled(self) -> bool:
        return bool(self.ranks["signalled"].any())


class Observer:
    def on_setup(self, exp) -> None:
        pass

    def before_round(self, exp, t: int) -> None:
        pass

    def client_hook(self, exp, t: int, p: int):
        return None

    def after_evaluate(self, exp, t: int, timers) -> None:
        pass

    def after_round(self, exp, record: RoundRecord) -> None:
        pass

    def on_end(self, exp) -> None:
        pass


def default_observers(quiet: bool) -> list[Observer]:
    """In calling order: a diverged round is neither checkpointed nor interrupted, and
    the progress line comes once the round's file work is done."""
    # deferred: each observer module imports Observer from this package (a cycle at load time)
    from .checkpoint import Checkpoint
    from .divergence import Divergence
    from .preemption import Preemption
    from .probes import Probes
    from .progress import Progress
    from .spectra import LocalSpectra
    from .storage import Storage
    from .tracking import Tracking
    spectra = LocalSpectra()
    out = [spectra, Probes(spectra), Divergence(), Storage(), Checkpoint(), Preemption(),
           Tracking()]
    return out if quiet else out + [Progress()]
