"""The runtime: owns the loop. ``run_experiment`` is what ``fedmpi run`` calls on every rank."""

from __future__ import annotations

from ..comm import Comm, make_comm
from .experiment import CLIENT_FIELDS, EXIT_PREEMPTED, ROUND_FIELDS, Experiment
from .observers import default_observers
from .plan import place, sample_clients


def run_experiment(config, comm: Comm | None = None, *, force: bool = False,
                   quiet: bool = False, resume: bool = False, observers=()) -> Experiment:
    """Run ``config`` on this rank (single process when ``comm`` is None and no launcher);
    ``resume``: continue the run in ``config.output_path()`` from its checkpoint;
    ``observers``: called after the default ones (a tuning trial's pruner)."""
    experiment = Experiment(config, comm or make_comm(), force=force, quiet=quiet, resume=resume,
                            observers=default_observers(quiet) + list(observers))
    experiment.run()
    return experiment


__all__ = ["CLIENT_FIELDS", "EXIT_PREEMPTED", "ROUND_FIELDS", "Experiment", "place", "run_experiment",
           "sample_clients"]
