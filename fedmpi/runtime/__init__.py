"""The runtime: owns the loop. ``run_experiment`` is what ``fedmpi run`` calls on every rank."""

from __future__ import annotations

from ..comm import Comm, make_comm
from .experiment import CLIENT_FIELDS, EXIT_PREEMPTED, ROUND_FIELDS, Experiment
from .plan import place, sample_clients


def run_experiment(config, comm: Comm | None = None, *, force: bool = False,
                   quiet: bool = False, resume: bool = False) -> Experiment:
    """Run ``config`` on this rank (single process when ``comm`` is None and no launcher);
    ``resume``: continue the run in ``config.output_path()`` from its checkpoint."""
    experiment = Experiment(config, comm or make_comm(), force=force, quiet=quiet, resume=resume)
    experiment.run()
    return experiment


__all__ = ["CLIENT_FIELDS", "EXIT_PREEMPTED", "ROUND_FIELDS", "Experiment", "place", "run_experiment",
           "sample_clients"]
