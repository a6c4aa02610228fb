"""The runtime: owns the loop. ``run_experiment`` is what ``fedmpi run`` calls on every rank."""

from __future__ import annotations

from ..comm import Comm, make_comm
from .experiment import CLIENT_FIELDS, ROUND_FIELDS, Experiment
from .plan import place, sample_clients


def run_experiment(config, comm: Comm | None = None, *, force: bool = False,
                   quiet: bool = False) -> Experiment:
    """Run ``config`` on this rank (single process when ``comm`` is None and no launcher)."""
    experiment = Experiment(config, comm or make_comm(), force=force, quiet=quiet)
    experiment.run()
    return experiment


__all__ = ["CLIENT_FIELDS", "ROUND_FIELDS", "Experiment", "place", "run_experiment",
           "sample_clients"]
